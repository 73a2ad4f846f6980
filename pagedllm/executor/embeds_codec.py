"""The step message's trailer for prompt-embedding rows (SequenceChunk.prompt_embeds), for tensor-parallel ranks.

A step whose chunks carry no rows is sent as `step_codec` lays it out. One that does gets, after the integer
payload: a header of int64 [n_entries, dtype code, hidden size, (chunk index, rows) per entry], the entries' raw
bytes in that order, and 8 bytes (uint64) saying how long header and bytes are; the dtype byte's top bit marks it.
Raw bytes, not pickles: a rank never unpickles what it receives.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.worker.model_input import SequenceChunk

HAS_EMBEDS = 0x80  # set in the message's first (dtype) byte when the trailer follows
_DTYPES = {0: torch.float32, 1: torch.float16, 2: torch.bfloat16}
_CODES = {dt: code for code, dt in _DTYPES.items()}
_FOOTER = 8


def append_embeds(message: np.ndarray, chunks: list[SequenceChunk]) -> np.ndarray:
    """`message` (step_codec's uint8 layout), with the chunks' prompt-embedding rows appended when any has some."""
    entries = [(i, c.prompt_embeds) for i, c in enumerate(chunks) if c.prompt_embeds is not None]
    if not entries:
        return message
    dtype, hidden = entries[0][1].dtype, int(entries[0][1].shape[1])
    if dtype not in _CODES:
        raise ValueError(f"prompt embeddings of dtype {dtype} cannot be sent to the workers; allowed: "
                         f"{list(_CODES)}.")
    header = [len(entries), _CODES[dtype], hidden]
    blobs = []
    for i, rows in entries:
        rows = rows.detach().to(device="cpu", dtype=dtype).contiguous()
        if rows.dim() != 2 or rows.shape[1] != hidden:
            raise ValueError(f"chunk {i}: prompt embeddings of shape {tuple(rows.shape)}, expected [rows, {hidden}].")
        header += [i, int(rows.shape[0])]
        blobs.append(rows.view(torch.uint8).numpy().reshape(-1))
    trailer = np.concatenate([np.asarray(header, dtype=np.int64).view(np.uint8), *blobs])
    out = np.concatenate([message, trailer, np.asarray([trailer.size], dtype=np.uint64).view(np.uint8)])
    out[0] |= HAS_EMBEDS
    return out


def split_embeds(buf: np.ndarray) -> tuple[np.ndarray, list[tuple[int, torch.Tensor]]]:
    """→ (the message without the trailer, its first byte's flag cleared; [(chunk index, rows)])."""
    if not buf.size or not buf[0] & HAS_EMBEDS:
        return buf, []
    if buf.size < 1 + _FOOTER:
        raise ValueError("corrupt step message: too short for its prompt-embeddings trailer")
    n = int(buf[-_FOOTER:].view(np.uint64)[0])
    start = buf.size - _FOOTER - n
    if n < 24 or start < 1:
        raise ValueError(f"corrupt step message: a prompt-embeddings trailer of {n} bytes")
    trailer = buf[start:start + n]
    n_entries, code, hidden = (int(x) for x in trailer[:24].view(np.int64))
    if code not in _DTYPES or hidden < 1 or n_entries < 1:
        raise ValueError(f"corrupt step message: prompt-embeddings header ({n_entries}, {code}, {hidden})")
    head = 24 + 16 * n_entries
    pairs = trailer[24:head].view(np.int64).reshape(-1, 2)
    dtype = _DTYPES[code]
    row_bytes = hidden * torch.tensor([], dtype=dtype).element_size()
    pos, entries = head, []
    for i, rows in pairs.tolist():
        size = rows * row_bytes
        raw = torch.from_numpy(trailer[pos:pos + size].copy())
        entries.append((i, raw.view(dtype).reshape(rows, hidden)))
        pos += size
    if pos != n:
        raise ValueError(f"corrupt step message: {n - pos} stray bytes in the prompt-embeddings trailer")
    message = buf[:start].copy()
    message[0] &= ~HAS_EMBEDS & 0xFF
    return message, entries


def attach_embeds(chunks: list[SequenceChunk], entries: list[tuple[int, torch.Tensor]]) -> None:
    """Give each decoded chunk its rows back."""
    for i, rows in entries:
        if not 0 <= i < len(chunks):
            raise ValueError(f"corrupt step message: prompt embeddings for chunk {i} of {len(chunks)}")
        chunks[i].prompt_embeds = rows
