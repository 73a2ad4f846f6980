"""The tensor-parallel group a model is built for (passed down explicitly, never global)."""
from __future__ import annotations

from dataclasses import dataclass, field
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


PP_LAYER_PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def pipeline_layer_counts(num_layers: int, pp_size: int, partition: str | None = None) -> list[int]:
    """How many decoder layers each pipeline stage holds (vLLM's split): `partition` ("4,4,3", the
    VLLM_PP_LAYER_PARTITION variable) gives them outright; otherwise equal shares, the remainder going one each to
    the stages just before the last (the last stage also runs the final norm and the LM head)."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size ({pp_size}) exceeds the model's {num_layers} decoder layers; "
                         f"each stage needs at least one: use at most {num_layers} stages.")
    if partition:
        try:
            counts = [int(x) for x in partition.split(",")]
        except ValueError:
            counts = []
        if len(counts) != pp_size or any(c < 1 for c in counts) or sum(counts) != num_layers:
            raise ValueError(f"{PP_LAYER_PARTITION_ENV}={partition!r}: give {pp_size} comma-separated layer counts, "
                             f"each >= 1, summing to the model's {num_layers} layers (e.g. "
                             f"{','.join(map(str, pipeline_layer_counts(num_layers, pp_size)))}).")
        return counts
    base, extra = divmod(num_layers, pp_size)
    counts = [base] * pp_size
    for i in range(2, extra + 2):
        counts[-i] += 1
    return counts


@dataclass(frozen=True)
class PipelineParallelGroup:
    """This rank's pipeline stage: which decoder layers it runs, and how activations pass between stages.

    Ranks are numbered stage-major (rank = stage * tp_size + tp_rank). A stage sends its hidden states and residual
    to the rank with the same tp_rank in the next stage; the last stage's tp_rank 0 sends the step's logits to rank 0
    (the driver, in the engine process), which samples. `group` spans every rank (point-to-point by global rank)."""

    rank: int  # the stage
    size: int  # the number of stages
    tp_size: int
    tp_rank: int
    start_layer: int
    end_layer: int
    group: Any = None
    # The last stage's sends of logits still in flight, with their tensors (kept alive until rank 0 received them).
    _sends_in_flight: list = field(default_factory=list, compare=False, repr=False)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def global_rank(self) -> int:
        return self.rank * self.tp_size + self.tp_rank

    def send_activations(self, tensors: list[torch.Tensor]) -> None:
        """To the next stage (the same tp_rank there)."""
        dst = self.global_rank + self.tp_size
        for t in tensors:
            self.group.send([t.contiguous()], dst, 0).wait()

    def recv_activations(self, shapes: list[tuple[int, ...]], dtype: torch.dtype,
                         device: torch.device) -> list[torch.Tensor]:
        """From the previous stage, in the order it sent them."""
        src = self.global_rank - self.tp_size
        out = []
        for shape in shapes:
            t = torch.empty(shape, dtype=dtype, device=device)
            self.group.recv([t], src, 0).wait()
            out.append(t)
        return out

    def send_to_driver(self, logits: torch.Tensor) -> None:
        """The last stage's [rows, vocab] logits to rank 0: (rows, vocab, dtype) first, then the tensor."""
        # Never waited for here: rank 0 receives a step's logits when the engine completes that step, which may come
        # after later steps went through this stage (or after a health check that needs this rank's reply).
        self._sends_in_flight[:] = [(w, t) for w, t in self._sends_in_flight if not w.is_completed()]
        rows, vocab = logits.shape
        header = torch.tensor([rows, vocab, _DTYPE_CODES.index(logits.dtype)], dtype=torch.int64, device=logits.device)
        self._sends_in_flight.extend((self.group.send([t], 0, 1), t) for t in (header, logits.contiguous()))

    def recv_from_last_stage(self, device: torch.device) -> torch.Tensor:
        """On rank 0: the logits the last stage's `send_to_driver` sent."""
        src = (self.size - 1) * self.tp_size
        header = torch.empty(3, dtype=torch.int64, device=device)
        self.group.recv([header], src, 1).wait()
        rows, vocab, code = header.tolist()
        logits = torch.empty((rows, vocab), dtype=_DTYPE_CODES[code], device=device)
        self.group.recv([logits], src, 1).wait()
        return logits


_DTYPE_CODES = (torch.float32, torch.bfloat16, torch.float16)


def make_pipeline_group(hf_num_layers: int, pp_size: int, tp_size: int, rank: int, group: Any = None,
                        partition: str | None = None) -> PipelineParallelGroup:
    """Global `rank`'s stage and its layer range [start, end)."""
    counts = pipeline_layer_counts(hf_num_layers, pp_size, partition)
    stage = rank // tp_size
    start = sum(counts[:stage])
    return PipelineParallelGroup(stage, pp_size, tp_size, rank % tp_size, start, start + counts[stage], group)
