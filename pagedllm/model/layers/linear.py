"""Linear layers written for Megatron-style tensor parallelism (size 1 = plain linears).

Column-parallel layers split the output features across ranks; row-parallel layers split the
input features and all-reduce their partial sums. Each parameter carries a `weight_loader` that
takes the full checkpoint tensor and keeps only this rank's shard, so no rank holds the full model.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch
from torch import nn
import torch.nn.functional as F

from pagedllm.distributed.parallel_state import TensorParallelGroup, divide, shard_attention_heads
from pagedllm.kernels import cpu_linear

if TYPE_CHECKING:
    from pagedllm.kernels.cpu_f32_gemm import F32Gemm
    from pagedllm.kernels.cpu_quant import GGUFWeight


class PackableGemm:
    """A layer whose `weight` [out, in] may also be held packed for oneDNN (CPU path, see
    kernels/cpu_linear.py). The packed copy is made after loading and on every reload; the dense
    `weight` stays the one that loaders write and that tied embeddings read.

    float32 weights on the CPU are also packed into the panels of kernels/cpu_f32_gemm.py (the GEMM of
    decode-sized row counts). The dense copy is then released where nothing else reads it (not tied to an
    embedding), so the layer still holds two copies: `restore_dense_weight` rebuilds it from the panels,
    exactly, before weights are reloaded."""

    packed_weight: torch.Tensor | None = None
    f32_panels: torch.Tensor | None = None  # float32 on the CPU: cpu_f32_gemm's panels
    f32_gemm: "F32Gemm | None" = None  # the build that packed them
    dense_shape: tuple[int, int] | None = None  # [out, in] while the dense copy is released
    fp8_weight: torch.Tensor | None = None  # --quantization fp8: [out, in] e4m3 and its [1, out] scales
    fp8_scale: torch.Tensor | None = None
    gguf_weight: "GGUFWeight | None" = None  # --quantization gguf: the GGUF blocks (layers/quantized_linear.py)
    invariant_gemm: bool = False  # CUDA under VLLM_BATCH_INVARIANT=1: kernels/triton_invariant_matmul.py

    def pack_weight_for_cpu(self, f32_gemm: "F32Gemm | None" = None, release_dense: bool = False) -> None:
        """oneDNN's copy; with `f32_gemm` and a float32 weight also its panels, and with `release_dense`
        the dense copy is dropped (its shape kept)."""
        self.restore_dense_weight()
        self.packed_weight = cpu_linear.pack_linear_weight(self.weight)
        self.f32_panels = self.f32_gemm = None
        if f32_gemm is None or self.weight.dtype != torch.float32:
            return
        self.f32_panels, self.f32_gemm = f32_gemm.pack(self.weight.detach().contiguous()), f32_gemm
        if release_dense:
            self.dense_shape = (self.weight.shape[0], self.weight.shape[1])
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def restore_dense_weight(self) -> None:
        """Rebuild a released dense weight from the panels (bit for bit)."""
        if self.dense_shape is None:
            return
        self.weight.data = self.f32_gemm.unpack(self.f32_panels, *self.dense_shape)
        self.dense_shape = None

    def weight_shape(self) -> tuple[int, int]:
        """[out, in], also while the dense copy is released (packed panels, GGUF quants)."""
        if self.gguf_weight is not None:
            return self.gguf_weight.out_features, self.gguf_weight.in_features
        return self.dense_shape or (self.weight.shape[0], self.weight.shape[1])

    def quantize_weight_fp8(self) -> bool:
        """Quantize `weight` to e4m3 (per output channel); the bf16 copy is dropped. False if the shape
        does not suit _scaled_mm (the layer then stays bf16)."""
        from pagedllm.kernels import fp8_linear

        if self.fp8_weight is not None:  # already FP8 (an FP8 checkpoint's layer)
            return True
        if not fp8_linear.can_quantize(self.weight):
            return False
        self.fp8_weight, self.fp8_scale = fp8_linear.quantize_weight(self.weight)
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
        return True

    # -- FP8 checkpoints (model/fp8_checkpoint.py) ------------------------------------------------
    checkpoint_scale_shards: set[int] | None = None  # which stacked sub-matrices received scales

    @property
    def num_weight_shards(self) -> int:
        """Checkpoint tensors stacked into this layer's weight (q/k/v: 3, gate/up: 2, otherwise 1)."""
        return 1

    def expect_checkpoint_scales(self) -> None:
        """Before an FP8 checkpoint loads: a float32 per-row `weight_scale` [this rank's rows] that its scales load
        into, optional (layers the checkpoint leaves unquantized get none)."""
        scale = nn.Parameter(torch.ones(self.weight_shape()[0], dtype=torch.float32, device=self.weight.device),
                             requires_grad=False)
        scale.weight_loader = self.load_checkpoint_scale
        scale.optional = True
        self.weight_scale = scale
        self.checkpoint_scale_shards = set()

    def load_checkpoint_scale(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        """Rows are not split across ranks here (row-parallel and replicated layers)."""
        if loaded.shape != param.shape:
            raise ValueError(f"expected {param.shape[0]} per-row scales, checkpoint has {tuple(loaded.shape)}")
        param.data.copy_(loaded)
        self.checkpoint_scale_shards.add(shard_id)

    def finish_checkpoint_scales(self, keep_fp8: bool) -> str:
        """After loading: "fp8" (the e4m3 values kept, bit for bit, with the per-row scales), "dequantized" (the
        scales multiplied into the weight), or "plain" (the checkpoint stored this layer unquantized)."""
        from pagedllm.kernels import fp8_linear

        scale = self.weight_scale.data
        loaded, self.checkpoint_scale_shards = self.checkpoint_scale_shards, None
        del self.weight_scale
        if not loaded:
            return "plain"
        if len(loaded) != self.num_weight_shards:
            raise ValueError(f"the checkpoint stores {len(loaded)} of the {self.num_weight_shards} projections "
                             f"fused into one layer ({type(self).__name__}) in FP8 and the others unquantized: "
                             f"all or none must be FP8.")
        if keep_fp8 and fp8_linear.can_quantize(self.weight):
            self.fp8_weight = self.weight.data.to(torch.float8_e4m3fn)  # exact: the values came from e4m3
            self.fp8_scale = scale[None, :].contiguous()
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
            return "fp8"
        self.weight.data = (self.weight.data.float() * scale[:, None]).to(self.weight.dtype)
        return "dequantized"

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.gguf_weight is not None:
            from pagedllm.model.layers.quantized_linear import gguf_matmul

            return gguf_matmul(self.gguf_weight, x, bias)
        if self.fp8_weight is not None:
            from pagedllm.kernels import fp8_linear

            return fp8_linear.fp8_linear(x, self.fp8_weight, self.fp8_scale, bias, x.dtype)
        if self.invariant_gemm:
            from pagedllm.kernels.triton_invariant_matmul import invariant_linear

            return invariant_linear(x, self.weight, bias)
        if self.f32_panels is not None and x.numel() <= self.f32_gemm.max_rows * x.shape[-1]:
            return self.f32_gemm.linear(x, self.f32_panels, self.weight_shape()[0], bias)
        if self.packed_weight is not None:
            return cpu_linear.cpu_linear_forward(x, self.weight, self.packed_weight, bias)
        return F.linear(x, self.weight, bias)


def quantize_weights_fp8(model: nn.Module) -> int:
    """--quantization fp8: every PackableGemm layer whose shape suits _scaled_mm, except the LM head (kept
    in bf16 as in vLLM; it may share its weight with the embeddings) and layers marked `keep_unquantized` (MoE
    routers, whose top-k choice FP8 rounding would flip); returns how many."""
    return sum(layer.quantize_weight_fp8() for name, layer in model.named_modules()
               if isinstance(layer, PackableGemm) and not name.endswith("lm_head")
               and not getattr(layer, "keep_unquantized", False))


def restore_dense_weights(model: nn.Module) -> None:
    """Before reloading: every layer's released dense weight rebuilt from its panels."""
    for m in model.modules():
        if isinstance(m, PackableGemm):
            m.restore_dense_weight()


def pack_weights_for_cpu(model: nn.Module, f32_gemm: "F32Gemm | None" = None) -> int:
    """Pack every PackableGemm layer's weight for oneDNN (and float32 ones into `f32_gemm`'s panels, their
    dense copy released unless another module shares it); returns how many were packed."""
    from pagedllm.model.layers.embedding import VocabParallelEmbedding

    restore_dense_weights(model)  # a repack: sharing is judged on the real weights
    uses = Counter(p.data_ptr() for _, p in model.named_parameters(remove_duplicate=False))
    layers = [m for m in model.modules() if isinstance(m, PackableGemm) and m.gguf_weight is None]
    for layer in layers:
        shared = isinstance(layer, VocabParallelEmbedding) or uses[layer.weight.data_ptr()] > 1
        layer.pack_weight_for_cpu(f32_gemm, release_dense=not shared)
    from pagedllm.model.layers.fused_moe import FusedMoE  # (imports this module)

    experts = sum(m.pack_for_cpu(f32_gemm) for m in model.modules() if isinstance(m, FusedMoE))
    return len(layers) + experts


class ColumnParallelLinear(nn.Module, PackableGemm):
    """y = x Wᵀ + b with W split by rows (output features) across ranks."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        shard_sizes: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.output_sizes = output_sizes
        # Per sub-matrix, rows this rank keeps (may differ from size/tp: uneven or replicated KV heads).
        self.shard_sizes = shard_sizes or [divide(s, tp.size, "output features") for s in output_sizes]
        out = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.bias = None

    def shard_range(self, shard_id: int) -> tuple[int, int, int]:
        """(offset in this rank's param, start row in the full sub-matrix, rows)."""
        offset = sum(self.shard_sizes[:shard_id])
        rows = self.shard_sizes[shard_id]
        return offset, self.tp.rank * rows, rows

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        offset, start, rows = self.shard_range(shard_id)
        full_rows = self.output_sizes[shard_id]
        if loaded.shape[0] != full_rows:
            raise ValueError(f"expected {full_rows} rows for shard {shard_id}, checkpoint has {loaded.shape[0]}")
        param.data[offset : offset + rows].copy_(loaded[start : start + rows])

    @property
    def num_weight_shards(self) -> int:
        return len(self.output_sizes)

    def load_checkpoint_scale(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        """Per-row scales of one stacked sub-matrix, sharded as its weight rows are."""
        offset, start, rows = self.shard_range(shard_id)
        if loaded.shape != (self.output_sizes[shard_id],):
            raise ValueError(f"expected {self.output_sizes[shard_id]} per-row scales for shard {shard_id}, "
                             f"checkpoint has {tuple(loaded.shape)}")
        param.data[offset : offset + rows].copy_(loaded[start : start + rows])
        self.checkpoint_scale_shards.add(shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads; KV heads are replicated when fewer than ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
    ) -> None:
        self.heads = shard_attention_heads(num_heads, num_kv_heads, tp.size, tp.rank)
        self.num_heads = self.heads.num_q_heads
        self.num_kv_heads = self.heads.num_kv_heads
        self.head_dim = head_dim
        full = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        shards = [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]
        super().__init__(hidden_size, full, bias, tp, dtype, shard_sizes=shards)

    def shard_range(self, shard_id: int) -> tuple[int, int, int]:
        offset = sum(self.shard_sizes[:shard_id])
        rows = self.shard_sizes[shard_id]
        first_head = self.heads.q_start if shard_id == 0 else self.heads.kv_start
        return offset, first_head * self.head_dim, rows

    @property
    def output_features(self) -> tuple[int, int]:
        """(start, size) of this rank's attention output features: the row-parallel o_proj's input."""
        return self.heads.q_start * self.head_dim, self.num_heads * self.head_dim


class RowParallelLinear(nn.Module, PackableGemm):
    """y = x Wᵀ + b with W split by columns (input features); partial sums all-reduced."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        input_shard: tuple[int, int] | None = None,
    ) -> None:
        """`input_shard` = (start, size) of this rank's input features when not an even split."""
        super().__init__()
        self.tp = tp
        if input_shard is None:
            per_rank = divide(input_size, tp.size, "input features")
            input_shard = (tp.rank * per_rank, per_rank)
        self.input_start, self.input_per_rank = input_shard
        self.weight = nn.Parameter(torch.empty(output_size, self.input_per_rank, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self._bias_loader
        else:
            self.bias = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        start = self.input_start
        param.data.copy_(loaded[:, start : start + self.input_per_rank])

    @staticmethod
    def _bias_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.matmul(x, None))
        if self.bias is not None:
            y = y + self.bias  # added once, after the reduction
        return y


class ReplicatedLinear(nn.Module, PackableGemm):
    """y = x Wᵀ + b with the full matrix on every rank (small projections such as OPT's project_in)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)
