"""The tensor-parallel group a model is built for (passed down explicitly, never global)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TensorParallelGroup:
    """Rank and size of this process in its tensor-parallel group; size 1 = no parallelism."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim` (on every rank)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator}).")
    return numerator // denominator
