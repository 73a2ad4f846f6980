"""Mixture-of-experts members of the Llama family: Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE (Granite 3.0 / 3.1's
1B-A400M and 3B-A800M: Granite's layers and multipliers with a routed MLP whose experts a checkpoint stores fused) and
OLMoE (AI2's OLMoE-1B-7B: Llama's pre-norm layers with OLMo 2's whole-projection q/k norms and optional q/k/v
clipping, top-k of a softmax over every expert).

Their attention is Llama's (Qwen2-MoE with q/k/v biases, Qwen3-MoE with per-head q/k norms); their feed-forward
blocks route each token to its top-k experts (layers/fused_moe.py), and Qwen2-MoE adds a shared expert scaled by a
sigmoid gate. Checkpoints store each expert's projections apart (``experts.{e}.w1`` / ``gate_proj`` …); they are
stacked into the layer's ``w13_weight`` / ``w2_weight`` at load time.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.fused_moe import EXPERT_PROJECTIONS, FusedMoE
from pagedllm.model.layers.linear import ReplicatedLinear
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.model.models.granite import GraniteForCausalLM
from pagedllm.model.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    llama_rotary_embedding,
)
from pagedllm.model.models.olmo2 import Olmo2Attention


class SparseMoeBlock(nn.Module):
    """Router (`gate`), routed experts, and optionally a shared expert whose output is scaled by
    sigmoid(shared_expert_gate(x)) (Qwen2-MoE)."""

    def __init__(self, config: Any, num_experts: int, intermediate_size: int, renormalize: bool,
                 tp: TensorParallelGroup, dtype: torch.dtype, shared_intermediate_size: int = 0) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate = ReplicatedLinear(hidden, num_experts, False, dtype)
        self.gate.keep_unquantized = True  # --quantization fp8 leaves routers (and the experts) in bf16, as vLLM
        self.experts = FusedMoE(num_experts, int(config.num_experts_per_tok), hidden, intermediate_size, renormalize,
                                tp, dtype)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(config, tp, dtype, intermediate_size=shared_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(hidden, 1, False, dtype)
            self.shared_expert_gate.keep_unquantized = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def _num_experts(config: Any) -> int:
    n = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not n:
        raise ValueError("an MoE config needs num_experts (or num_local_experts) > 0")
    return int(n)


class _MoeForCausalLM(LlamaForCausalLM):
    """Shared loading: expert matrices go to their FusedMoE; every expert's three projections must be present."""

    loads_fp8_checkpoints = False  # expert weights are not [out, in] linears
    renamed_blocks: dict[str, str] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        experts = ExpertWeightRouter(self, self.renamed_blocks)
        super().load_weights(experts.dense_weights(weights))
        experts.check_complete()


class ExpertWeightRouter:
    """Loading a model with FusedMoE layers: each checkpoint expert matrix (``...experts.E.{gate,up,down}_proj.weight``,
    or Mixtral's w1 / w3 / w2) goes to its layer's stacked parameters; `dense_weights` yields every other tensor for
    the model's own loader; `check_complete` then raises if an expert's projection never came."""

    def __init__(self, model: nn.Module, renamed_blocks: dict[str, str] | None = None) -> None:
        self.renamed_blocks = renamed_blocks or {}
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
        self.seen: dict[str, set[tuple[int, str]]] = {name: set() for name in self.layers}
        for name, moe in self.layers.items():  # filled expert by expert, checked by check_complete
            moe.w13_weight.optional = moe.w2_weight.optional = True
            self.seen[name].update(moe.projections_held_as_gguf())  # the checkpoint's copies are not read

    def dense_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            for old, new in self.renamed_blocks.items():
                name = name.replace(old, new)
            parts = name.split(".")
            if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit() \
                    and parts[-2] in EXPERT_PROJECTIONS and parts[-1] == "weight":
                owner = ".".join(parts[:-2])[: -len(parts[-3]) - 1]
                moe = self.layers.get(owner)
                if moe is None:
                    raise ValueError(f"checkpoint tensor {name!r} names experts that the model does not have at "
                                     f"{owner!r}")
                projection = EXPERT_PROJECTIONS[parts[-2]]
                moe.load_expert_weight(int(parts[-3]), projection, tensor.to(moe.w13_weight.dtype))
                self.seen[owner].add((int(parts[-3]), projection))
                continue
            yield name, tensor

    def check_complete(self) -> None:
        for name, moe in self.layers.items():
            want = len(moe.projections) * moe.num_experts
            if len(self.seen[name]) != want:
                raise ValueError(f"checkpoint is missing expert projections of {name}: {len(self.seen[name])} of "
                                 f"{want} ({', '.join(moe.projections)} of every expert)")


class MixtralForCausalLM(_MoeForCausalLM):
    """Mixtral: every layer's MLP is a sparse MoE block (``block_sparse_moe``), top-k renormalized."""

    renamed_blocks = {".block_sparse_moe.": ".mlp."}

    def make_mlp(self, config: Any, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype) -> nn.Module:
        return SparseMoeBlock(config, _num_experts(config), config.intermediate_size, True, tp, dtype)


class Qwen3MoeForCausalLM(_MoeForCausalLM):
    """Qwen3-MoE: Qwen3's attention; MoE blocks on every `decoder_sparse_step`-th layer not in `mlp_only_layers`."""

    qk_norm = True

    def make_mlp(self, config: Any, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype) -> nn.Module | None:
        step = int(getattr(config, "decoder_sparse_step", 1) or 1)
        if layer_index in (getattr(config, "mlp_only_layers", None) or []) or (layer_index + 1) % step:
            return None  # a dense MLP of intermediate_size
        return SparseMoeBlock(config, _num_experts(config), config.moe_intermediate_size,
                              bool(getattr(config, "norm_topk_prob", False)), tp, dtype,
                              int(getattr(config, "shared_expert_intermediate_size", 0) or 0))


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2-MoE: Qwen2's attention (q/k/v biases, no q/k norms) and a gated shared expert beside the routed ones."""

    qk_norm = False
    qkv_bias = True


class GraniteMoeForCausalLM(GraniteForCausalLM, _MoeForCausalLM):
    """Granite MoE: Granite's attention, multipliers and logit scaling; every layer's MLP a sparse MoE block
    (``block_sparse_moe``: softmax over the top-k router logits, i.e. top-k renormalized). Checkpoints store the
    router as ``router.layer`` and each layer's experts fused: ``input_linear`` [experts, 2 × inter, hidden] (gate
    rows, then up rows) and ``output_linear`` [experts, hidden, inter]; they are split into per-expert projections
    here and stacked as Mixtral's."""

    def make_mlp(self, config: Any, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype) -> nn.Module:
        return SparseMoeBlock(config, _num_experts(config), config.intermediate_size, True, tp, dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._per_expert(weights))

    def _per_expert(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        inter = int(self.config.intermediate_size)
        for name, tensor in weights:
            prefix, sep, rest = name.partition(".block_sparse_moe.")
            if not sep:
                yield name, tensor
            elif rest == "router.layer.weight":
                yield f"{prefix}.mlp.gate.weight", tensor
            elif rest in ("input_linear.weight", "output_linear.weight"):
                want = (2 * inter, self.config.hidden_size) if rest.startswith("input") else \
                    (self.config.hidden_size, inter)
                if tensor.dim() != 3 or tuple(tensor.shape[1:]) != want:
                    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; the config implies "
                                     f"[experts, {want[0]}, {want[1]}]")
                for e in range(tensor.shape[0]):
                    if rest.startswith("input"):
                        yield f"{prefix}.mlp.experts.{e}.gate_proj.weight", tensor[e, :inter]
                        yield f"{prefix}.mlp.experts.{e}.up_proj.weight", tensor[e, inter:]
                    else:
                        yield f"{prefix}.mlp.experts.{e}.down_proj.weight", tensor[e]
            else:
                raise ValueError(f"checkpoint tensor {name!r}: a Granite MoE block holds router.layer, input_linear "
                                 f"and output_linear only")


class OlmoeAttention(Olmo2Attention):
    """OLMo 2's attention (whole-projection q/k norms before RoPE, biases under ``attention_bias``) with OLMoE's
    ``clip_qkv``: q and k (after their norms) and v clamped to [-clip_qkv, clip_qkv], before RoPE (as transformers)."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, layer_index: int,
                 rotary_emb: RotaryEmbedding, clip_qkv: float) -> None:
        super().__init__(config, tp, dtype, layer_index, rotary_emb)
        self.clip_qkv = clip_qkv

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: Any, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.qk_norm(q, k)
        c = self.clip_qkv
        q, k = self.rotary_emb(positions, q.clamp(-c, c), k.clamp(-c, c))
        v = v.clamp(-c, c)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class OlmoeForCausalLM(_MoeForCausalLM):
    """OLMoE: Llama's pre-norm layers; OLMo 2's attention (q_norm over all q heads, k_norm over all KV heads); every
    MLP a sparse MoE block routing to the top `num_experts_per_tok` of a softmax over all experts, renormalized under
    ``norm_topk_prob``."""

    def build_model(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> LlamaModel:
        rotary = llama_rotary_embedding(config)
        clip = getattr(config, "clip_qkv", None)

        def make_layer(i: int) -> nn.Module:
            attn = Olmo2Attention(config, tp, dtype, i, rotary) if clip is None else \
                OlmoeAttention(config, tp, dtype, i, rotary, float(clip))
            return LlamaDecoderLayer(config, tp, dtype, mlp=self.make_mlp(config, i, tp, dtype), layer_index=i,
                                     self_attn=attn)

        return LlamaModel(config, tp, dtype, make_layer=make_layer)

    def make_mlp(self, config: Any, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype) -> nn.Module:
        return SparseMoeBlock(config, _num_experts(config), config.intermediate_size,
                              bool(getattr(config, "norm_topk_prob", False)), tp, dtype)
