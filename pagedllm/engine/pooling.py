"""Pooling requests (embeddings): which runner an engine takes, and how a prompt's hidden states become one vector.

A pooling engine runs prompts only. Its model runner hands back the final hidden states (after the last norm)
where a generating engine hands back logits; a request finishes when its last prompt chunk has run, with the
last token's state (LAST), the mean over every token (MEAN) or the first token's (CLS), L2-normalized unless
asked not to be.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.config import PoolerConfig
from pagedllm.model.models.registry import is_base_model
from pagedllm.pooling_params import PoolingParams


def resolve_runner(runner: str, convert: str, hf_config: Any) -> str:
    """vLLM's --runner / --convert → "generate" or "pooling"."""
    base = is_base_model(hf_config)
    if convert == "embed":
        if runner == "generate":
            raise ValueError("convert='embed' makes an embedding model, which runs the pooling runner: drop "
                             "runner='generate' or pass runner='pooling'.")
        return "pooling"
    if runner == "auto":
        return "pooling" if base else "generate"
    if runner == "generate" and base:
        archs = getattr(hf_config, "architectures", None)
        raise ValueError(f"this checkpoint ({archs[0]}) has no LM head, so it cannot generate text: serve it with "
                         f"runner='pooling' (--runner pooling) for embeddings.")
    return runner


def matryoshka_dimensions(hf_config: Any) -> tuple[int, ...] | None:
    """The output sizes a Matryoshka model was trained for (vLLM reads `is_matryoshka` / `matryoshka_dimensions`
    from config.json); () = any size up to the hidden size; None = not a Matryoshka model."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return tuple(int(d) for d in dims)
    return () if getattr(hf_config, "is_matryoshka", False) else None


@dataclass
class PoolingState:
    """One pooling request's running reduction over its prompt rows (robust to a recomputed prompt: rows of
    positions already seen are skipped)."""

    params: PoolingParams
    pooling_type: str
    normalize: bool
    sum: torch.Tensor | None = None
    first: torch.Tensor | None = None
    next_pos: int = 0  # rows of positions below this were reduced already
    result: torch.Tensor | None = None

    @classmethod
    def of(cls, params: PoolingParams, pooler: PoolerConfig) -> PoolingState:
        normalize = pooler.normalize if params.normalize is None else params.normalize
        return cls(params, pooler.pooling_type, normalize)

    @property
    def wants_every_row(self) -> bool:
        """MEAN and CLS read rows before the last one (LAST reads the last row only)."""
        return self.pooling_type != "LAST"

    def add_rows(self, start_pos: int, rows: torch.Tensor) -> None:
        """Rows of positions start_pos … start_pos + len(rows) - 1 (MEAN, CLS)."""
        skip = max(0, self.next_pos - start_pos)
        new = rows[skip:].float()
        if not len(new):
            return
        if self.pooling_type == "MEAN":
            part = new.sum(dim=0)
            self.sum = part if self.sum is None else self.sum + part
        elif self.pooling_type == "CLS" and start_pos + skip == 0:
            self.first = new[0].clone()
        self.next_pos = start_pos + skip + len(new)

    def finish(self, last_row: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The pooled vector (float32, on the CPU), once the prompt's last row ran."""
        if self.pooling_type == "LAST":
            vec = last_row.float().clone()  # the row may sit in a buffer the next step reuses
        elif self.pooling_type == "MEAN":
            vec = self.sum / num_tokens
        else:
            vec = self.first
        if self.params.dimensions is not None:
            vec = vec[: self.params.dimensions]
        if self.normalize:
            vec = torch.nn.functional.normalize(vec, p=2.0, dim=-1)
        self.result = vec.cpu()
        return self.result
