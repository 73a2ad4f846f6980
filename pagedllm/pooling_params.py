"""vLLM's PoolingParams: the per-request options of an embedding request (`LLM.embed`, `/v1/embeddings`)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.sampling_params import _check_bool, _check_opt_int

POOLING_TASKS = ("embed", "encode")


@dataclass
class PoolingParams:
    """`dimensions`: keep the embedding's first this many values (Matryoshka models only, as in vLLM);
    `normalize`: L2-normalize the embedding (None: the model's pooler config, by default True);
    `truncate_prompt_tokens`: keep the prompt's last this many tokens (-1: as many as fit)."""

    dimensions: int | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None  # "embed" or "encode" (vLLM's pooling tasks; both give the pooled vector here)

    def __post_init__(self) -> None:
        self.dimensions = _check_opt_int("dimensions", self.dimensions)
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions}.")
        if self.normalize is not None:
            self.normalize = _check_bool("normalize", self.normalize)
        self.truncate_prompt_tokens = _check_opt_int("truncate_prompt_tokens", self.truncate_prompt_tokens)
        k = self.truncate_prompt_tokens
        if k is not None and k < 1 and k != -1:
            raise ValueError(f"truncate_prompt_tokens must be at least 1, or -1 (as many as fit), got {k}.")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {list(POOLING_TASKS)}, got {self.task!r}.")
