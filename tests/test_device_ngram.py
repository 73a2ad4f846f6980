"""Device-side n-gram speculation's tensor steps (spec_decode/device_ngram.py) against the host rules."""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm.spec_decode.device_ngram import accept_greedy, append_history, build_rows, propose_ngrams
from pagedllm.spec_decode.ngram_proposer import NgramProposer


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _history(seqs: list[list[int]], width: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    hist = torch.full((len(seqs), width), 7777, dtype=torch.long)  # stale values past each length
    for i, s in enumerate(seqs):
        hist[i, : len(s)] = torch.tensor(s)
    return hist.to(device), torch.tensor([len(s) for s in seqs], device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_device_proposals_equal_the_host_proposer_on_random_sequences(device):
    rng = random.Random(0)
    for k, nmin, nmax in ((4, 1, 4), (3, 2, 3), (8, 4, 4), (2, 1, 1)):
        host = NgramProposer(k, nmin, nmax)
        seqs = [[rng.randrange(6) for _ in range(rng.randrange(1, 60))] for _ in range(64)]
        hist, lens = _history(seqs, 80, device)
        drafts, num_real = propose_ngrams(hist, lens, k, nmin, nmax)
        for i, s in enumerate(seqs):
            want = host.propose(s, k)
            n = int(num_real[i])
            assert n == len(want), (s, k, nmin, nmax)
            assert drafts[i, :n].tolist() == want
            if not want:  # no match: the last token repeated, k rows all the same
                assert drafts[i].tolist() == [s[-1]] * k


def test_rows_follow_the_device_lengths_and_write_only_allocated_slots():
    drafts = torch.tensor([[5, 6], [8, 9]])
    lens = torch.tensor([3, 16])  # the last token sits at position 2, and at 15 (a block's end)
    tables = torch.tensor([[4, 0, 0], [2, 3, 0]], dtype=torch.int32)
    capacity = torch.tensor([16, 17])  # sequence 1 holds one slot of its second block
    rows = build_rows(torch.tensor([1, 2]), drafts, lens, tables, capacity, block_size=16, max_model_len=64)
    assert rows.input_ids.tolist() == [1, 5, 6, 2, 8, 9]
    assert rows.positions.tolist() == [2, 3, 4, 15, 16, 17]
    assert rows.seq_lens.tolist() == [3, 4, 5, 16, 17, 18]
    assert rows.slot_mapping.tolist() == [4 * 16 + 2, 4 * 16 + 3, 4 * 16 + 4, 2 * 16 + 15, 3 * 16, -1]
    assert rows.block_tables.tolist() == [[4, 0, 0]] * 3 + [[2, 3, 0]] * 3


def test_greedy_acceptance_appends_the_argmax_chain_up_to_the_budget():
    vocab, k = 10, 3
    drafts = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 7, 7]])
    argmax = torch.tensor([[1, 2, 9, 0], [0, 5, 6, 1], [7, 7, 7, 2]])  # accepts 2, 0 and 3 drafts
    logits = torch.nn.functional.one_hot(argmax.reshape(-1), vocab).float() * 5
    tokens, logprobs, count, accepted = accept_greedy(logits, drafts, torch.tensor([10, 10, 2]))
    assert tokens.tolist() == argmax.tolist()
    assert accepted.tolist() == [2, 0, 3]
    assert count.tolist() == [3, 1, 2]  # the third is capped by its budget
    assert torch.allclose(logprobs, logits.log_softmax(-1).max(-1).values.view(3, k + 1))
    hist, lens = _history([[1], [2, 3], [4]], 12)
    append_history(hist, lens, torch.tensor([2, 0, 1]), tokens, count)
    assert lens.tolist() == [1 + 1, 2 + 2, 1 + 3]
    assert hist[2, :4].tolist() == [4, 1, 2, 9]
    assert hist[0, :2].tolist() == [1, 0]
    assert hist[1, :4].tolist() == [2, 3, 7, 7]
