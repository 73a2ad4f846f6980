"""The plain-torch paged attention (the CPU path) against a token-by-token oracle of eq. 4."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import reference
from pagedllm.kernels.metadata import AttentionMetadata


def _make_batch(seed: int, block_size: int, hq: int, hk: int, d: int, query_lens, ctx_lens, num_blocks=64):
    """Random K/V already in a shuffled pool; returns everything paged_attention needs."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(num_blocks, block_size, hk, d, generator=g)
    vc = torch.randn(num_blocks, block_size, hk, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, seq_lens, slots = [], [], []
    for q, c in zip(query_lens, ctx_lens):
        n = c + q
        nb = -(-n // block_size)
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        seq_lens.append(n)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, n)]
    t = sum(query_lens)
    query = torch.randn(t, hq, d, generator=g)
    key = torch.randn(t, hk, d, generator=g)
    value = torch.randn(t, hk, d, generator=g)
    max_b = max(map(len, tables))
    bt = torch.tensor([tb + [0] * (max_b - len(tb)) for tb in tables], dtype=torch.int32)
    qsl = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32)
    nd = 0
    while nd < len(query_lens) and query_lens[nd] == 1:
        nd += 1
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), block_tables=bt, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=qsl, seq_lens_cpu=seq_lens, query_lens_cpu=list(query_lens), num_decodes=nd,
        max_seq_len=max(seq_lens), max_query_len=max(query_lens),
    )
    return query, key, value, kc, vc, meta, tables


@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("hq,hk", [(4, 4), (8, 2), (9, 3)])
def test_paged_attention_matches_naive_oracle(block_size, hq, hk):
    # 20 decodes of ragged length (so the length buckets kick in), then prefill chunks with and without context.
    query_lens = [1] * 20 + [7, 13, 5]
    ctx_lens = [3 + 11 * i % 60 for i in range(20)] + [0, 9, 30]
    q, k, v, kc, vc, meta, tables = _make_batch(block_size * 31 + hq, block_size, hq, hk, 16, query_lens, ctx_lens,
                                                num_blocks=2048 // block_size + 64)
    reference.reshape_and_cache(k, v, kc, vc, meta.slot_mapping)
    out = reference.paged_attention(q, k, v, kc, vc, meta, scale=16**-0.5)
    expected = reference.paged_attention_naive(q, kc, vc, tables, meta.seq_lens_cpu, query_lens, 16**-0.5)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_reshape_and_cache_skips_padding_slots():
    kc = torch.zeros(4, 2, 1, 3)
    vc = torch.zeros(4, 2, 1, 3)
    key = torch.arange(9.0).view(3, 1, 3)
    reference.reshape_and_cache(key, -key, kc, vc, torch.tensor([5, -1, 0]))
    assert torch.equal(kc.view(-1, 1, 3)[5], key[0]) and torch.equal(kc.view(-1, 1, 3)[0], key[2])
    assert kc.view(-1, 1, 3)[[1, 2, 3, 4, 6, 7]].abs().sum() == 0
    assert torch.equal(vc.view(-1, 1, 3)[5], -key[0])


def test_copy_and_swap_blocks():
    kcs = [torch.randn(6, 4, 2, 8) for _ in range(3)]
    vcs = [torch.randn(6, 4, 2, 8) for _ in range(3)]
    before = [k.clone() for k in kcs]
    reference.copy_blocks(kcs, vcs, torch.tensor([[0, 5], [2, 3]]))
    for k, b in zip(kcs, before):
        assert torch.equal(k[5], b[0]) and torch.equal(k[3], b[2]) and torch.equal(k[1], b[1])
    cpu = torch.zeros(3, 4, 2, 8)
    reference.swap_blocks(kcs[0], cpu, torch.tensor([[5, 1], [4, 0]]))
    assert torch.equal(cpu[1], kcs[0][5]) and torch.equal(cpu[0], kcs[0][4]) and cpu[2].abs().sum() == 0
