"""The two kernels of device-side n-gram speculation (kernels/triton_ngram.py; compiled on CUDA, Triton's
interpreter on CPU) against the plain-torch steps of spec_decode/device_ngram.py."""
from __future__ import annotations

import pytest
import torch

# First: without CUDA it sets TRITON_INTERPRET, which the kernel module's @triton.jit reads at import.
from tests.triton_setup import DEVICE, interpreter_numpy_shim

# isort: split
from pagedllm.kernels.reference import greedy_sample_with_logprob
from pagedllm.kernels.triton_ngram import accept_append, propose_rows
from pagedllm.spec_decode.device_ngram import accept_greedy, append_history, build_rows, propose_ngrams

interpreter_numpy_shim()


def _histories(seed: int, slots: int, width: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hist = torch.randint(0, vocab, (slots, width), generator=g)
    lens = torch.randint(1, width - 20, (slots,), generator=g)
    lens[0] = 1  # a one-token history: nothing can recur
    lens[1] = width - 20
    # A copied stretch: the last tokens of row 2 recur earlier, with more than k tokens after them.
    n2 = int(lens[2])
    if n2 > 40:
        hist[2, n2 - 6 : n2] = hist[2, 10:16]
    return hist, lens


@pytest.mark.parametrize("k,nmin,nmax", [(4, 1, 3), (8, 2, 4), (3, 4, 4)])
def test_propose_rows_matches_the_torch_steps(k: int, nmin: int, nmax: int) -> None:
    slots, width, block_size, bucket = 6, 300, 16, 48
    hist, lens = _histories(k * 10 + nmin, slots, width, vocab=5)  # a small vocabulary: many matches
    idx = torch.tensor([3, 0, 2, 5, 1])  # members in slot order of their own
    n, q = len(idx), k + 1
    table_width = 20  # 320 token slots: rows past it are clamped and write no KV
    g = torch.Generator().manual_seed(1)
    tables = torch.randint(0, 1000, (n, table_width), generator=g, dtype=torch.int32)
    capacity = torch.tensor([16, 64, 320, 32, 300])
    max_model_len = 310

    want_drafts, want_real = propose_ngrams(hist[idx], lens[idx], k, nmin, nmax)
    last = hist[idx].gather(1, (lens[idx] - 1)[:, None]).squeeze(1)
    rows = build_rows(last, want_drafts, lens[idx], tables, capacity, block_size, max_model_len)

    dev = torch.device(DEVICE)
    drafts = torch.full((n, k), -7, dtype=torch.long, device=dev)
    num_real = torch.full((n,), -7, dtype=torch.long, device=dev)
    ids, pos, slot_map = (torch.full((bucket,), -7, dtype=torch.long, device=dev) for _ in range(3))
    seq_lens = torch.full((bucket,), -7, dtype=torch.int32, device=dev)
    block_tables = torch.full((bucket, table_width + 4), -7, dtype=torch.int32, device=dev)
    propose_rows(hist.to(dev), lens.to(dev), idx.to(dev), tables.to(dev), capacity.to(dev), k, nmin, nmax,
                 block_size, max_model_len, drafts, num_real, ids, pos, slot_map, seq_lens, block_tables, bucket)

    assert drafts.cpu().tolist() == want_drafts.tolist()
    assert num_real.cpu().tolist() == want_real.tolist()
    assert want_real[2] > 0  # the copied stretch was found
    r = n * q
    assert ids[:r].cpu().tolist() == rows.input_ids.tolist()
    assert pos[:r].cpu().tolist() == rows.positions.tolist()
    assert slot_map[:r].cpu().tolist() == rows.slot_mapping.tolist()
    assert (slot_map[:r] == -1).any()  # some rows lie past a sequence's blocks
    assert seq_lens[:r].cpu().tolist() == rows.seq_lens.tolist()
    assert torch.equal(block_tables[:r, :table_width].cpu(), rows.block_tables)
    # Padding rows: token 0 at position 0, no KV write, one token of context, block 0.
    assert ids[r:].cpu().tolist() == [0] * (bucket - r) and pos[r:].cpu().tolist() == [0] * (bucket - r)
    assert slot_map[r:].cpu().tolist() == [-1] * (bucket - r) and seq_lens[r:].cpu().tolist() == [1] * (bucket - r)
    assert block_tables[r:, 0].cpu().tolist() == [0] * (bucket - r)


def test_propose_rows_rejects_a_small_bucket() -> None:
    z = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="static buffers too small"):
        propose_rows(torch.zeros((2, 8), dtype=torch.long), z[:2], z[:2], torch.zeros((2, 2), dtype=torch.int32),
                     z[:2], 3, 1, 2, 16, 32, torch.zeros((2, 3), dtype=torch.long), z[:2], z, z, z,
                     torch.zeros(4, dtype=torch.int32), torch.zeros((4, 2), dtype=torch.int32), 4)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_accept_append_matches_the_torch_steps(k: int) -> None:
    slots, width, vocab = 5, 40, 50
    q = k + 1
    g = torch.Generator().manual_seed(k)
    idx = torch.tensor([4, 1, 3, 2])
    n = len(idx)
    logits = torch.randn(n * q, vocab, generator=g)
    pred = logits.argmax(-1).view(n, q)
    drafts = torch.randint(0, vocab, (n, k), generator=g)
    drafts[0] = pred[0, :k]  # all accepted
    drafts[1, : k // 2] = pred[1, : k // 2]  # a prefix accepted
    num_real = torch.tensor([k, k // 2, 0, 1])
    hist = torch.randint(0, vocab, (slots, width), generator=g)
    lens = torch.tensor([5, 10, 15, width - 3, 20])  # slot 3 ends near the row's end: columns clamp
    remaining = torch.tensor([9, 2, 0, 100, 9])  # slot 1 may emit only two more; slot 2 nothing

    want_hist, want_lens, want_rem = hist.clone(), lens.clone(), remaining.clone()
    tokens, logprob, count, accepted = accept_greedy(logits, drafts, want_rem.index_select(0, idx))
    old_lens = want_lens.clone()
    append_history(want_hist, want_lens, idx, tokens, count)
    want_rem.index_add_(0, idx, -count)

    dev = torch.device(DEVICE)
    hist_d, lens_d, rem_d = hist.to(dev), lens.to(dev), remaining.to(dev)
    out = torch.zeros((slots, 2 * q + 3), dtype=torch.float64, device=dev)
    pred_d, lp_d = greedy_sample_with_logprob(logits)
    accept_append(pred_d.to(dev), lp_d.to(dev), drafts.to(dev), num_real.to(dev), idx.to(dev), hist_d, lens_d,
                  rem_d, out)
    assert lens_d.cpu().tolist() == want_lens.tolist()
    assert rem_d.cpu().tolist() == want_rem.tolist()
    for s in idx.tolist():  # every written column up to the old length + q; writes clamped to the last
        end = min(int(old_lens[s]) + q, width - 1)  # column collide there, in no defined order
        assert hist_d[s, :end].cpu().tolist() == want_hist[s, :end].tolist()
    out = out.cpu()
    assert out[:n, :q].long().tolist() == tokens.tolist()
    torch.testing.assert_close(out[:n, q : 2 * q].float(), logprob, rtol=1e-5, atol=1e-5)
    assert out[:n, 2 * q].long().tolist() == count.tolist()
    assert out[:n, 2 * q + 1].long().tolist() == torch.minimum(accepted, num_real).tolist()
    assert out[:n, 2 * q + 2].long().tolist() == num_real.tolist()
    assert count.tolist()[0] == min(k + 1, 9) and count.tolist()[1] <= 2 and count.tolist()[3] == 0
