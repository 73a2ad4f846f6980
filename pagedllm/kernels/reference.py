"""PagedAttention and cache operations in plain torch.

This is the CPU execution path and the oracle every GPU kernel is tested against. Attention reads
past keys/values through block tables; decodes are batched into one gathered SDPA call, prompt
chunks without cached context attend to their own fresh K/V directly (no gather). A layer's sliding window
and logit soft cap (``sliding_window`` / ``logits_soft_cap``, None: off) apply to every path; with a soft cap the
scores are computed explicitly in float32 (SDPA cannot cap them).

Cache layout: ``key_cache``/``value_cache`` of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``,
so slot ``s`` is ``cache[s // block_size, s % block_size]``; stored slot-major (contiguous) or head-major
(``kernels/kv_layout.py``), a block is one contiguous run.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.kernels.metadata import AttentionMetadata, window_and_cap


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each token's K/V [T, H, D] into its slot; slots < 0 are skipped."""
    num_blocks, block_size, heads, dim = key_cache.shape
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    if key_cache.is_contiguous() and value_cache.is_contiguous():
        key_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
        value_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))
        return
    blk, off = slot_mapping // block_size, slot_mapping % block_size  # a head-major pool (kv_layout)
    key_cache[blk, off] = key.to(key_cache.dtype)
    value_cache[blk, off] = value.to(value_cache.dtype)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """[S, max_blocks] tables → contiguous [S, H, max_len, D] keys (or values)."""
    block_size = cache.shape[1]
    n_blocks = -(-max_len // block_size)
    return gather_blocks(cache, block_tables[:, :n_blocks].reshape(-1).long(), block_tables.shape[0], max_len)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, max_len: int) -> torch.Tensor:
    """Flat int64 block ids (num_seqs × blocks each) → [S, H, max_len, D] keys (or values)."""
    num_blocks, block_size, heads, dim = cache.shape
    gathered = cache.index_select(0, block_ids)  # [S·nb, bs, H, D]
    return gathered.view(num_seqs, -1, heads, dim)[:, :max_len].transpose(1, 2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float, causal: bool = False) -> torch.Tensor:
    """q [B, Hq, Lq, D], k/v [B, Hk, Lk, D] with Hq a multiple of Hk (GQA without copying K/V)."""
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float, soft_cap: float | None,
            causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """_sdpa, or with a soft cap or sinks the explicit float32 computation: scores · scale, c·tanh(s / c), the
    boolean `mask` (True: attend; broadcast over [B, Hq, Lq, Lk]), softmax (with each head's sink logit in its
    denominator), · V. Result in q's dtype."""
    if soft_cap is None and sinks is None:
        return _sdpa(q, k, v, mask, scale, causal)
    b, hq, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    qf = q.float().reshape(b, hk, hq // hk, lq, d)  # GQA: each KV head's query heads side by side
    scores = (qf @ k.float().unsqueeze(2).transpose(-1, -2)).view(b, hq, lq, lk) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    if causal:
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:  # softmax over [scores, sink], the sink's column dropped (it weighs no value)
        sink = sinks.float().view(1, hq, 1, 1).expand(b, hq, lq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :lk]
    probs = probs.reshape(b, hk, hq // hk, lq, lk)
    return (probs @ v.float().unsqueeze(2)).view(b, hq, lq, d).to(q.dtype)


@dataclass
class DecodeBucket:
    """Decodes of similar context length, batched into one padded SDPA call (derived once per step)."""

    idx: torch.Tensor | None  # rows of the batch in this bucket (None: all decodes, in order)
    block_ids: torch.Tensor  # flat int64 block ids, blocks_per_seq for each row
    num_seqs: int
    max_len: int
    mask: torch.Tensor | None  # [b, 1, 1, max_len] key-is-real mask; None when all lengths are equal


def _decode_buckets(meta: AttentionMetadata, block_size: int, min_bucket: int = 16, max_buckets: int = 4) -> list:
    """Group the decodes by context length (computed once per step, reused by every layer)."""
    if meta.decode_buckets is not None:
        return meta.decode_buckets
    nd = meta.num_decodes
    lens = meta.seq_lens_cpu[:nd]
    n_buckets = max(1, min(max_buckets, nd // min_bucket))
    parts: list = []
    if nd and n_buckets == 1:
        parts.append(None)
    elif nd:
        order = sorted(range(nd), key=lens.__getitem__)
        size = -(-nd // n_buckets)
        parts = [order[i : i + size] for i in range(0, nd, size)]
    device = meta.block_tables.device
    buckets = []
    for part in parts:
        idx = None if part is None else torch.tensor(part, dtype=torch.int64, device=device)
        rows = range(nd) if part is None else part
        max_len, min_len = max(lens[i] for i in rows), min(lens[i] for i in rows)
        tables = meta.block_tables[:nd] if idx is None else meta.block_tables.index_select(0, idx)
        block_ids = tables[:, : -(-max_len // block_size)].reshape(-1).long()
        mask = None
        if min_len != max_len:
            seq_lens = meta.seq_lens[:nd] if idx is None else meta.seq_lens.index_select(0, idx)
            mask = (torch.arange(max_len, device=device).unsqueeze(0) < seq_lens.unsqueeze(1))[:, None, None, :]
        buckets.append(DecodeBucket(idx, block_ids, tables.shape[0], max_len, mask))
    meta.decode_buckets = buckets
    return buckets


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for a flat batch [T, Hq, D] whose K/V were already written to the cache.

    `key`/`value` are this step's fresh K/V [T, Hk, D]; chunks with no cached context use them
    directly, everything else reads the cache through the block tables. `sliding_window` W: the query at
    position p sees keys p - W < j <= p only; `logits_soft_cap` c: scores become c·tanh(s / c) (None: off);
    `sinks` [Hq] (GPT-OSS's attention sinks): head h's softmax has one more logit, sinks[h], in its denominator,
    which weighs no value (None: off).
    """
    window_and_cap(sliding_window, logits_soft_cap)  # the kernels' checks
    out = torch.empty_like(query)
    nd = meta.num_decodes
    for bucket in _decode_buckets(meta, key_cache.shape[1]):
        idx = bucket.idx
        q = (query[:nd] if idx is None else query.index_select(0, idx)).unsqueeze(2)  # [b, Hq, 1, D]
        k = gather_blocks(key_cache, bucket.block_ids, bucket.num_seqs, bucket.max_len)
        v = gather_blocks(value_cache, bucket.block_ids, bucket.num_seqs, bucket.max_len)
        mask = bucket.mask
        if sliding_window is not None and bucket.max_len > sliding_window:
            # per row (the buckets are shared by every layer, the window is this layer's): keys older than it
            seq_lens = meta.seq_lens[:nd] if idx is None else meta.seq_lens.index_select(0, idx)
            recent = (torch.arange(bucket.max_len, device=q.device).unsqueeze(0)
                      >= (seq_lens - sliding_window).unsqueeze(1))[:, None, None, :]
            mask = recent if mask is None else mask & recent
        o = _attend(q, k.to(q.dtype), v.to(q.dtype), mask, scale, logits_soft_cap, sinks=sinks).squeeze(2)
        if idx is None:
            out[:nd] = o
        else:
            out.index_copy_(0, idx, o)
    prefill_attention(query, key, value, key_cache, value_cache, meta, scale, out, sliding_window=sliding_window,
                      logits_soft_cap=logits_soft_cap, sinks=sinks)
    return out


def prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    first_seq: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Fill `out` for the prompt chunks of sequences `first_seq` (default: the first after the decodes)
    onward: causal over their own tokens, plus their cached context read through the block table when they
    have one; within the last `sliding_window` keys of each query, scores soft-capped at `logits_soft_cap`, and
    each head's sink logit in its softmax (`sinks`, as paged_attention's), where set."""
    window_and_cap(sliding_window, logits_soft_cap)  # the kernels' checks
    first = meta.num_decodes if first_seq is None else first_seq
    start = sum(meta.query_lens_cpu[:first])
    for i in range(first, meta.num_seqs):
        qlen, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        end = start + qlen
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, qlen, D]
        ctx = seq_len - qlen
        windowed = sliding_window is not None and seq_len > sliding_window
        if ctx == 0 and not windowed:
            k = key[start:end].transpose(0, 1).unsqueeze(0)
            v = value[start:end].transpose(0, 1).unsqueeze(0)
            o = _attend(q, k.to(q.dtype), v.to(q.dtype), None, scale, logits_soft_cap, causal=True, sinks=sinks)
        else:
            if ctx == 0:
                k = key[start:end].transpose(0, 1).unsqueeze(0)
                v = value[start:end].transpose(0, 1).unsqueeze(0)
            else:
                k = gather_kv(key_cache, meta.block_tables[i : i + 1], seq_len)
                v = gather_kv(value_cache, meta.block_tables[i : i + 1], seq_len)
            # Query j (absolute position ctx + j) sees keys 0..ctx + j (with a window W: ctx + j - W + 1 on).
            rows = torch.arange(qlen, device=q.device).unsqueeze(1) + ctx
            cols = torch.arange(seq_len, device=q.device).unsqueeze(0)
            mask = cols <= rows
            if windowed:
                mask &= cols > rows - sliding_window
            o = _attend(q, k.to(q.dtype), v.to(q.dtype), mask, scale, logits_soft_cap, sinks=sinks)
        out[start:end] = o.squeeze(0).transpose(0, 1)
        start = end


def paged_attention_naive(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token-by-token, block-by-block attention straight from eq. 4 — the oracle's oracle (slow). A query at
    position p reads keys max(0, p - sliding_window + 1)..p; scores become c·tanh(s / c) with a soft cap c; head
    h's softmax denominator gains exp(sinks[h]) with sinks."""
    window_and_cap(sliding_window, logits_soft_cap)  # the kernels' checks
    num_blocks, block_size, hk, d = key_cache.shape
    hq = query.shape[1]
    rep = hq // hk
    out = torch.empty_like(query, dtype=torch.float32)
    t = 0
    for table, seq_len, qlen in zip(block_tables, seq_lens, query_lens):
        for j in range(qlen):
            pos = seq_len - qlen + j
            first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            keys = torch.stack([key_cache[table[p // block_size], p % block_size] for p in range(first, pos + 1)])
            vals = torch.stack([value_cache[table[p // block_size], p % block_size] for p in range(first, pos + 1)])
            for h in range(hq):
                scores = (keys[:, h // rep].float() @ query[t, h].float()) * scale
                if logits_soft_cap is not None:
                    scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
                if sinks is None:
                    probs = torch.softmax(scores, 0)
                else:
                    probs = torch.softmax(torch.cat([scores, sinks[h].float().view(1)]), 0)[:-1]
                out[t, h] = probs @ vals[:, h // rep].float()
            t += 1
    return out.to(query.dtype)


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Copy-on-write: for each (src, dst) row of `block_mapping` [N, 2], copy block src → dst in every layer."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long()
    dst = block_mapping[:, 1].long()
    for kc, vc in zip(key_caches, value_caches):
        kc[dst] = kc[src]
        vc[dst] = vc[src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks between pools (device ↔ CPU): dst[m[:,1]] = src[m[:,0]]."""
    if block_mapping.numel() == 0:
        return
    s = block_mapping[:, 0].long().to(src.device)
    d = block_mapping[:, 1].long().to(dst.device)
    dst[d] = src[s].to(dst.device)


def quantize_rows_q8(x: torch.Tensor) -> torch.Tensor:
    """The int8 GGUF linear's activation rounding (kernels/cpu_quant.py): per block of 32, q = round(x / d) with
    d = max|x| / 127; returns q · d in float32 (the values its integer dot products see)."""
    xb = x.float().reshape(*x.shape[:-1], -1, 32)
    d = xb.abs().amax(dim=-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).reshape(x.shape)


def gguf_linear(x: torch.Tensor, dense_weight: torch.Tensor, method: str) -> torch.Tensor:
    """Oracle of the GGUF linear: ``dense_weight`` is the weight dequantized (gguf.quants); ``int8`` rounds x
    the way the kernel does first, ``dequant`` uses x as is."""
    xin = quantize_rows_q8(x) if method == "int8" else x.float()
    return xin @ dense_weight.float().T


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Oracle of the structured-output mask: a copy of ``logits`` with ``-inf`` wherever bit ``t % 32`` of
    word ``t // 32`` of ``bitmask[r]`` is 0, for the listed rows only."""
    out = logits.clone()
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    for r in rows:
        bits = (bitmask[r].unsqueeze(1) >> shifts) & 1  # [words, 32]
        allowed = bits.reshape(-1)[:vocab].bool().to(logits.device)
        out[r] = out[r].masked_fill(~allowed, float("-inf"))
    return out


def greedy_sample_with_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax (first on ties) and its log-probability under the row's softmax, in float32."""
    x = logits.float()
    tokens = x.argmax(dim=-1)
    return tokens, x.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]
