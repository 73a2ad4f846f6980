"""A step's prompt-embedding rows (engine/prompt_embeds.py) written over its token embeddings."""
from __future__ import annotations

import torch

from pagedllm.worker.model_input import SequenceChunk


def write_prompt_embeds(embeds: torch.Tensor, chunks: list[SequenceChunk]) -> None:
    """In place: for each chunk with ``prompt_embeds`` (its first k positions' rows), those rows replace its first
    k rows of `embeds` (the step's input embeddings [tokens, hidden], the chunks' tokens in order)."""
    base = 0
    for c in chunks:
        rows = c.prompt_embeds
        if rows is not None:
            k = int(rows.shape[0])
            if k > len(c.token_ids) or rows.shape[1] != embeds.shape[1]:
                raise ValueError(f"sequence {c.seq_id}: {tuple(rows.shape)} prompt-embedding rows for a chunk of "
                                 f"{len(c.token_ids)} tokens of hidden size {embeds.shape[1]}.")
            embeds[base:base + k] = rows.to(device=embeds.device, dtype=embeds.dtype, non_blocking=True)
        base += len(c.token_ids)
