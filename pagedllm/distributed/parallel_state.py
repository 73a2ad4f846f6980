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


@dataclass(frozen=True)
class AttentionHeadShard:
    """The query and KV heads one rank owns (contiguous ranges of the full model's heads)."""

    q_start: int
    num_q_heads: int
    kv_start: int
    num_kv_heads: int


def shard_attention_heads(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> AttentionHeadShard:
    """Split attention heads across ranks by whole GQA groups.

    With at least as many KV heads as ranks, each rank takes a contiguous run of KV heads with their
    query heads; the runs differ by at most one KV head when the count does not divide (9 heads /
    3 KV heads at tp=2 -> 6+3 query heads), so any tp up to the KV-head count works. With fewer KV
    heads than ranks, each KV head is replicated on tp/num_kv_heads ranks that split its query heads.
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})."
        )
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        base, extra = divmod(num_kv_heads, tp_size)
        num_kv = base + (1 if rank < extra else 0)
        kv_start = rank * base + min(rank, extra)
        return AttentionHeadShard(kv_start * group, num_kv * group, kv_start, num_kv)
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) exceeds num_key_value_heads ({num_kv_heads}) and is not a "
            "multiple of it, so the KV heads cannot be replicated evenly; use a tensor_parallel_size "
            f"<= {num_kv_heads} or a multiple of it."
        )
    ranks_per_kv = tp_size // num_kv_heads
    if group % ranks_per_kv:
        raise ValueError(
            f"the {group} query heads of each KV head cannot be split over {ranks_per_kv} ranks "
            f"(tensor_parallel_size {tp_size}, num_key_value_heads {num_kv_heads})."
        )
    num_q = group // ranks_per_kv
    kv = rank // ranks_per_kv
    return AttentionHeadShard(kv * group + (rank % ranks_per_kv) * num_q, num_q, kv, 1)
