"""Vocabulary-parallel embedding and LM head (each rank holds a slice of the vocabulary)."""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.linear import PackableGemm


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        if loaded.shape[0] < self.end:
            raise ValueError(f"embedding has {loaded.shape[0]} rows, config says vocab_size={self.vocab_size}")
        param.data[: self.end - self.start].copy_(loaded[self.start : self.end])

    gguf_weight = None  # --quantization gguf: the table's GGUF blocks (layers/quantized_linear.py)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.gguf_weight is not None:
            from pagedllm.model.layers.quantized_linear import gguf_embedding

            return gguf_embedding(self.gguf_weight, input_ids)
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids < self.start) | (input_ids >= self.end)
        local = (input_ids - self.start).masked_fill(mask, 0)
        out = F.embedding(local, self.weight).masked_fill(mask.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, PackableGemm):
    """Logits = hidden · Wᵀ over this rank's vocabulary slice, gathered to full width."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup, dtype: torch.dtype, bias: bool = False
    ) -> None:
        super().__init__(vocab_size, hidden_size, tp, dtype)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.per_rank, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.bias = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(hidden, self.bias)
        logits = self.tp.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]


class LearnedPositionalEmbedding(nn.Module):
    """A learned position table, replicated on every rank; OPT shifts positions by `offset` (2)."""

    def __init__(self, num_positions: int, hidden_size: int, dtype: torch.dtype, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(num_positions + offset, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset if self.offset else positions, self.weight)
