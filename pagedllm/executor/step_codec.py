"""Compact wire format for an ExecuteModelRequest: one flat integer array, no pickling.

Layout (all one dtype, int32 when every value fits, else int64; the first byte says which):
    header   [n_chunks, n_swap_in, n_swap_out, n_copy, n_groups]
    per chunk [seq_id, start_pos, n_tokens, n_blocks, flags, table_version]   (flags: 1 = sample, 2 = all_logits;
              table_version -1 for None)
    all chunks' token ids, then all chunks' block tables, group by group (a hybrid model's groups: every table
    of a chunk has its n_blocks entries), then the three (src, dst) pair lists.
Chunks' prompt-embedding rows follow as a trailer (embeds_codec.py).
"""
from __future__ import annotations

import numpy as np

from pagedllm.executor.embeds_codec import append_embeds, attach_embeds, split_embeds
from pagedllm.worker.model_input import ExecuteModelRequest, SequenceChunk

_HEADER = 5
_META = 6
_DTYPES = {0: np.int32, 1: np.int64}
_INT32_MAX = np.iinfo(np.int32).max


def encode_request(req: ExecuteModelRequest) -> np.ndarray:
    """→ a uint8 array (1 dtype byte + the integer payload)."""
    chunks = req.chunks
    n_groups = 1 + (len(chunks[0].group_block_tables or ()) if chunks else 0)
    for c in chunks:
        extra = c.group_block_tables or ()
        if len(extra) != n_groups - 1 or any(len(t) != len(c.block_table) for t in extra):
            raise ValueError("every chunk of a step needs a table of its block_table's length in each KV cache group")
    meta = np.array(
        [(c.seq_id, c.start_pos, len(c.token_ids), len(c.block_table), int(c.sample) | (2 * int(c.all_logits)),
          -1 if c.table_version is None else c.table_version)
         for c in chunks],
        dtype=np.int64,
    ).reshape(-1, _META)
    parts = [
        np.array([len(chunks), len(req.blocks_to_swap_in), len(req.blocks_to_swap_out), len(req.blocks_to_copy),
                  n_groups], dtype=np.int64),
        meta.ravel(),
        np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=int(meta[:, 2].sum())),
        np.fromiter((b for c in chunks for b in c.block_table), dtype=np.int64, count=int(meta[:, 3].sum())),
    ]
    for g in range(n_groups - 1):
        parts.append(np.fromiter((b for c in chunks for b in c.group_block_tables[g]), dtype=np.int64,
                                 count=int(meta[:, 3].sum())))
    for pairs in (req.blocks_to_swap_in, req.blocks_to_swap_out, req.blocks_to_copy):
        parts.append(np.asarray(pairs, dtype=np.int64).reshape(-1))
    flat = np.concatenate(parts)
    code = 1 if flat.size and (flat.max() > _INT32_MAX or flat.min() < -_INT32_MAX) else 0
    payload = flat.astype(_DTYPES[code]).view(np.uint8)
    out = np.empty(1 + payload.size, dtype=np.uint8)
    out[0] = code
    out[1:] = payload
    return append_embeds(out, chunks)


def decode_request(buf: np.ndarray) -> ExecuteModelRequest:
    """Inverse of `encode_request` (accepts any uint8 buffer, e.g. a tensor's numpy view)."""
    buf, embeds = split_embeds(np.asarray(buf, dtype=np.uint8))
    code = int(buf[0])
    if code not in _DTYPES:
        raise ValueError(f"corrupt step message: dtype code {code} (allowed: {sorted(_DTYPES)})")
    flat = np.frombuffer(buf[1:].tobytes(), dtype=_DTYPES[code]).tolist()
    n_chunks, n_in, n_out, n_copy, n_groups = flat[:_HEADER]
    pos = _HEADER
    meta = [flat[pos + i * _META : pos + (i + 1) * _META] for i in range(n_chunks)]
    pos += n_chunks * _META
    tok_pos = pos
    blk_pos = pos + sum(m[2] for m in meta)
    all_blocks = sum(m[3] for m in meta)
    chunks = []
    for seq_id, start_pos, n_tok, n_blk, flags, version in meta:
        extra = [flat[blk_pos + g * all_blocks : blk_pos + g * all_blocks + n_blk] for g in range(1, n_groups)]
        chunks.append(
            SequenceChunk(
                seq_id=seq_id,
                token_ids=flat[tok_pos : tok_pos + n_tok],
                start_pos=start_pos,
                block_table=flat[blk_pos : blk_pos + n_blk],
                sample=bool(flags & 1),
                all_logits=bool(flags & 2),
                group_block_tables=extra or None,
                table_version=None if version < 0 else version,
            )
        )
        tok_pos += n_tok
        blk_pos += n_blk
    pos = blk_pos + (n_groups - 1) * all_blocks
    lists = []
    for n in (n_in, n_out, n_copy):
        pairs = flat[pos : pos + 2 * n]
        lists.append([(pairs[2 * i], pairs[2 * i + 1]) for i in range(n)])
        pos += 2 * n
    if pos != len(flat):
        raise ValueError(f"corrupt step message: {len(flat) - pos} trailing values")
    attach_embeds(chunks, embeds)
    return ExecuteModelRequest(chunks, lists[0], lists[1], lists[2])
