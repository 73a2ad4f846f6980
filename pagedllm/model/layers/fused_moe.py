"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE): top-k routing, then each token's experts.

The experts' weights are stacked as vLLM stacks them: ``w13_weight`` [E, 2·I, H] (each expert's gate rows, then
its up rows) and ``w2_weight`` [E, H, I]. Under tensor parallelism every rank holds every expert's slice of the
intermediate dimension (vLLM's tensor-parallel MoE) and the output is all-reduced, as a RowParallelLinear's is.

The experts run on CUDA as one Triton grouped GEMM per projection (kernels/triton_fused_moe.py: static shapes, so
CUDA graphs capture it); elsewhere as a torch loop over the experts that received rows (``fused_experts_torch``,
also the kernel's reference in tests). With ``--quantization gguf`` on the CPU a projection's experts may instead be
held as GGUF blocks, one GGUFWeight per expert (``w13_gguf`` / ``w2_gguf``, set by
layers/quantized_linear.attach_gguf_experts), its float parameter then empty: the same loop runs each expert's rows
through the quantized linears' GEMM (activations quantized per row, as llama.cpp's ggml_mul_mat_id does).
"""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup, divide
from pagedllm.model.layers.activation import silu_and_mul
from pagedllm.model.layers.quantized_linear import gguf_matmul
from pagedllm.model.mxfp4 import MXFP4_BLOCK, Mxfp4Weight

if TYPE_CHECKING:
    from pagedllm.kernels.cpu_f32_gemm import F32Gemm
    from pagedllm.kernels.cpu_quant import GGUFWeight

# Checkpoint names of one expert's projections → (w13 half, or w2). Mixtral calls them w1 / w3 / w2.
EXPERT_PROJECTIONS = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down",
                      "down_proj": "down"}


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k] int64): the k likeliest experts of each row's softmax (taken in
    float32, as Hugging Face does), their probabilities rescaled to sum to 1 when `renormalize`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


#: Expert activations: "silu" (gated: silu(gate) · up, w13 holds [gate; up]), "relu2" (non-gated: relu(up)²,
#: w13 holds up only; Nemotron-H's experts) and "swigluoai" (GPT-OSS's gated: g = min(gate, 7), u = clamp(up, ±7),
#: (u + 1) · g · sigmoid(1.702 g), w13 holds [gate; up]; vLLM's name and constants).
EXPERT_ACTIVATIONS = ("silu", "relu2", "swigluoai")
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def expert_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """The experts' activation on w13's output rows (see EXPERT_ACTIVATIONS)."""
    if activation == "silu":
        return silu_and_mul(h)
    if activation == "relu2":
        return torch.relu(h).square()
    if activation == "swigluoai":
        gate, up = h.chunk(2, dim=-1)
        gate = gate.clamp(max=SWIGLUOAI_LIMIT)
        up = up.clamp(min=-SWIGLUOAI_LIMIT, max=SWIGLUOAI_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA))
    raise ValueError(f"expert activation must be one of {EXPERT_ACTIVATIONS}, got {activation!r}")


def expert_linear(x: torch.Tensor, w: torch.Tensor | Sequence[GGUFWeight] | Mxfp4Weight, expert: int,
                  panels: ExpertPanels | None = None) -> torch.Tensor:
    """x @ w[expert]ᵀ, w a stacked float projection, one GGUF weight per expert or MXFP4 experts (that expert
    dequantized for the product); with `panels`, the native float32 GEMM over that expert's packed panels (the same
    product)."""
    if panels is not None:
        return panels.gemm.linear(x, panels.panels[expert], panels.out_features, None)
    if isinstance(w, torch.Tensor):
        return torch.nn.functional.linear(x, w[expert])
    if isinstance(w, Mxfp4Weight):
        return torch.nn.functional.linear(x, w.dequantize_expert(expert, x.dtype))
    return gguf_matmul(w[expert], x, None)


@dataclass(frozen=True)
class ExpertPanels:
    """One projection's experts packed for the CPU's native float32 GEMM (kernels/cpu_f32_gemm.py): torch's
    F.linear re-packs an expert's matrix on every call, which ran GPT-OSS's experts at ~14 GFLOP/s on a Zen 4."""

    gemm: F32Gemm
    panels: list[torch.Tensor]
    out_features: int


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor | Sequence[GGUFWeight] | Mxfp4Weight,
                        w2: torch.Tensor | Sequence[GGUFWeight] | Mxfp4Weight, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                        w2_bias: torch.Tensor | None = None,
                        panels: tuple[ExpertPanels, ExpertPanels] | None = None) -> torch.Tensor:
    """Σ over each row's k experts of weight · w2_e(silu(gate_e x) · up_e x): each expert's GEMMs over the rows routed
    to it (Hugging Face's loop; the product by the weight in x's dtype). Either projection may be one GGUF weight per
    expert (``expert_linear``). `w13_bias` [E, 2I] / `w2_bias` [E, H] (GPT-OSS): each expert's biases, added after
    its projections. `panels`: both projections packed for the native float32 GEMM (FusedMoE.pack_for_cpu)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert, tokens in order within one
    counts = torch.bincount(flat, minlength=w13.shape[0] if not isinstance(w13, Sequence) else len(w13)).tolist()
    rows = order // topk_ids.shape[1]
    xs = x[rows]
    spans = [(expert, start - n, start) for expert, n, start in
             zip(range(len(counts)), counts, itertools.accumulate(counts)) if n]
    if not spans:
        return torch.zeros_like(x)
    p13, p2 = panels or (None, None)
    # Only the GEMMs run per expert; the gathers, biases, activation, weighting and sum run once over every pair (a
    # per-expert chain of a dozen small ops cost more than the GEMMs at decode batch sizes on the CPU).
    h = torch.cat([expert_linear(xs[lo:hi], w13, expert, p13) for expert, lo, hi in spans])
    experts = flat[order]
    if w13_bias is not None:
        h = h + w13_bias[experts]
    a = expert_activation(h, activation)
    y = torch.cat([expert_linear(a[lo:hi], w2, expert, p2) for expert, lo, hi in spans])
    if w2_bias is not None:
        y = y + w2_bias[experts]
    y = y * topk_weights.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, rows, y)


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer: forward(x [T, H], router_logits [T, E]) → [T, H].

    `custom_routing_function` (vLLM's name): router_logits → (weights [T, k] float32, expert ids [T, k] int64), in
    place of ``select_experts`` (DeepSeek's grouped and bias-corrected routers); `top_k` / `renormalize` then only
    describe the layer."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 tp: TensorParallelGroup, dtype: torch.dtype, reduce_results: bool = True,
                 custom_routing_function: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                 activation: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.custom_routing_function = custom_routing_function
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"expert activation must be one of {EXPERT_ACTIVATIONS}, got {activation!r}")
        self.activation = activation
        self.gated = activation in ("silu", "swigluoai")
        self.projections = ("gate", "up", "down") if self.gated else ("up", "down")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must lie in [1, {num_experts}] (the number of experts), got {top_k}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.tp, self.reduce_results = tp, reduce_results
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.shard = divide(intermediate_size, tp.size, "moe_intermediate_size")
        self.w13_weight = nn.Parameter(torch.empty(num_experts, (2 if self.gated else 1) * self.shard, hidden_size,
                                                   dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.shard, dtype=dtype),
                                      requires_grad=False)
        # float32 on the CPU: both projections packed per expert for the native GEMM (pack_for_cpu)
        self.cpu_panels: tuple[ExpertPanels, ExpertPanels] | None = None
        # `bias` (GPT-OSS): each expert's biases after its projections; w2's is added on one rank only (the output is
        # summed over the ranks)
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.zeros(num_experts, self.w13_weight.shape[1], dtype=dtype),
                                         requires_grad=False)
            self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        # --quantization gguf (CPU): a projection's experts as GGUF blocks, its float parameter then empty
        self.w13_gguf: list[GGUFWeight] | None = None
        self.w2_gguf: list[GGUFWeight] | None = None
        # --quantization mxfp4 (hold_mxfp4): both projections as MXFP4 bytes and scales, the float parameters empty
        for name in ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales"):
            self.register_buffer(name, None)

    def hold_mxfp4(self) -> None:
        """Hold both projections as MXFP4 (GPT-OSS's checkpoints; model/mxfp4.py), rows as the float weights':
        ``w13_blocks`` [E, 2·shard, H / 2] and ``w13_scales`` [E, 2·shard, H / 32], ``w2_blocks`` [E, H, shard / 2] and
        ``w2_scales`` [E, H, shard / 32], uint8, on the float weights' device; the float weights are released."""
        for dim, what in ((self.hidden_size, "hidden_size"), (self.shard, "each rank's share of intermediate_size")):
            if dim % MXFP4_BLOCK:
                raise ValueError(f"MXFP4 experts need {what} ({dim}) in multiples of {MXFP4_BLOCK}: use "
                                 "quantization='none' (dequantized experts) or another tensor_parallel_size")
        device = self.w13_weight.device
        rows13 = (2 if self.gated else 1) * self.shard
        for name, rows, k in (("w13", rows13, self.hidden_size), ("w2", self.hidden_size, self.shard)):
            setattr(self, f"{name}_blocks", torch.zeros(self.num_experts, rows, k // 2, dtype=torch.uint8, device=device))
            setattr(self, f"{name}_scales", torch.zeros(self.num_experts, rows, k // MXFP4_BLOCK, dtype=torch.uint8,
                                                        device=device))
            param = getattr(self, f"{name}_weight")
            param.data = torch.empty(0, dtype=param.dtype, device=device)

    def mxfp4_weights(self) -> tuple[Mxfp4Weight, Mxfp4Weight] | None:
        """(w13, w2) as MXFP4 where hold_mxfp4 made them so (built anew each call: sleep mode moves the buffers)."""
        if self.w13_blocks is None:
            return None
        return Mxfp4Weight(self.w13_blocks, self.w13_scales), Mxfp4Weight(self.w2_blocks, self.w2_scales)

    def serve_mxfp4_from_cpu_kernels(self) -> bool:
        """On the CPU: the MXFP4 experts (hold_mxfp4) become one GGML MXFP4 weight per expert and projection, run by
        the quantized linears' int8 kernels (kernels/cpu_quant.py; activations quantized per 32 as llama.cpp's),
        instead of dequantizing an expert per product. False where those kernels cannot be built (the MXFP4 bytes
        then stay)."""
        if self.w13_blocks is None or self.w13_blocks.device.type != "cpu":
            return False
        from pagedllm.kernels.cpu_quant import GGML_TYPES, GGUFWeight, load_quant_kernels
        from pagedllm.model.mxfp4 import to_ggml_blocks

        try:
            load_quant_kernels()
        except (RuntimeError, OSError):
            return False
        qtype = GGML_TYPES["MXFP4"]
        for name in ("w13", "w2"):
            blocks, scales = getattr(self, f"{name}_blocks"), getattr(self, f"{name}_scales")
            rows, k = blocks.shape[1], blocks.shape[2] * 2
            setattr(self, f"{name}_gguf", [GGUFWeight.from_gguf_blocks(to_ggml_blocks(blocks[e], scales[e]), qtype,
                                                                       rows, k) for e in range(self.num_experts)])
            setattr(self, f"{name}_blocks", None)
            setattr(self, f"{name}_scales", None)
        return True

    def pack_for_cpu(self, gemm: F32Gemm | None) -> bool:
        """Pack each float32 expert's projections into `gemm`'s panels (the dense weights stay: loaders, TP and
        GGUF paths read them; the experts' float32 bytes double on the CPU). False where nothing was packed."""
        self.cpu_panels = None
        if gemm is None or self.w13_weight.dtype != torch.float32 or self.w13_weight.device.type != "cpu" \
                or self.w13_gguf is not None or self.w2_gguf is not None or self.w13_weight.numel() == 0:
            return False
        gemm = gemm.for_every_row_count()  # an expert's rows: a handful in decode, hundreds in a prompt step
        self.cpu_panels = tuple(ExpertPanels(gemm, [gemm.pack(w[e].contiguous()) for e in range(self.num_experts)],
                                             w.shape[1])
                                for w in (self.w13_weight.detach(), self.w2_weight.detach()))
        return True

    def projections_held_as_gguf(self) -> set[tuple[int, str]]:
        """(expert, "gate" / "up" / "down") of every projection served from GGUF blocks."""
        held = [("gate", "up")] * (self.w13_gguf is not None) + [("down",)] * (self.w2_gguf is not None)
        return {(e, p) for projections in held for p in projections for e in range(self.num_experts)}

    def load_expert_weight(self, expert: int, projection: str, loaded: torch.Tensor) -> None:
        """Copy one expert's checkpoint matrix ([I, H] for gate / up, [H, I] for down) into this rank's slice."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}, the model has {self.num_experts} experts")
        if projection not in self.projections:
            raise ValueError(f"expert {expert}'s {projection} projection: these experts have {self.projections}")
        if (self.w2_gguf if projection == "down" else self.w13_gguf) is not None:
            return  # served from the GGUF file's blocks: the float copy is not kept
        lo, n = self.tp.rank * self.shard, self.shard
        if projection == "down":
            want = (self.w2_weight.shape[1], self.intermediate_size)
            dst, src = self.w2_weight.data[expert], loaded[:, lo:lo + n] if loaded.shape == want else None
        else:
            want = (self.intermediate_size, self.w13_weight.shape[2])
            half = self.shard if projection == "up" and self.gated else 0
            dst = self.w13_weight.data[expert, half:half + n]
            src = loaded[lo:lo + n] if loaded.shape == want else None
        if src is None:
            raise ValueError(f"expert {expert}'s {projection} projection: checkpoint shape {tuple(loaded.shape)}, "
                             f"expected {want}")
        dst.copy_(src)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.custom_routing_function is None:
            topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        else:
            topk_weights, topk_ids = self.custom_routing_function(router_logits)
        w2_bias = self.w2_bias if self.tp.rank == 0 else None
        w13, w2 = self.mxfp4_weights() or (self.w13_gguf or self.w13_weight, self.w2_gguf or self.w2_weight)
        if x.is_cuda:
            from pagedllm.kernels.triton_fused_moe import fused_experts  # needs triton: imported on use

            out = fused_experts(x, w13, w2, topk_weights, topk_ids, activation=self.activation,
                                w13_bias=self.w13_bias, w2_bias=w2_bias)
        else:
            out = fused_experts_torch(x, w13, w2, topk_weights, topk_ids, self.activation, self.w13_bias, w2_bias,
                                      self.cpu_panels)
        return self.tp.all_reduce(out) if self.reduce_results else out
