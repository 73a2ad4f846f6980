"""GPT-OSS (OpenAI's gpt-oss-20b / gpt-oss-120b): Llama-shaped pre-norm layers whose attention has biases, a learned
sink logit per head in every softmax (layers/attention.py, ``sinks``) and alternates a 128-token sliding window with
full attention (``layer_types``); YaRN RoPE; every feed-forward block is a top-k MoE of experts with biases and the
clamped "swigluoai" activation (layers/fused_moe.py), routed by a softmax over the top-k router logits.

Checkpoints: ``mlp.router`` (weight and bias), ``mlp.experts.gate_up_proj`` [E, H, 2I] with gate and up columns
interleaved, ``gate_up_proj_bias`` [E, 2I] (interleaved too), ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H], and
``self_attn.sinks`` [heads]. The released checkpoints store the two expert projections as MXFP4
(``*_blocks`` / ``*_scales``, quantization_config quant_method "mxfp4"): on CUDA served as such by default
(``quantization="mxfp4"``: FusedMoE.hold_mxfp4, decoded in the fused-MoE kernel's tiles), elsewhere or with
``quantization="none"`` dequantized here at load (model/mxfp4.py).

llama.cpp's GGUF files (model/gguf_gpt_oss.py) name the experts as the other GGUF MoE files do: one matrix per expert
and projection (``mlp.experts.{e}.gate_proj.weight`` …, unless quantization='gguf' holds them as the file's blocks),
and the biases per projection, gate and up apart (``mlp.experts.gate_proj.bias`` [E, I] …, or ``gate_up_proj.bias``
[E, 2I], gate then up).
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.attention import Attention
from pagedllm.model.layers.fused_moe import FusedMoE
from pagedllm.model.layers.linear import ReplicatedLinear
from pagedllm.model.layers.rotary import RotaryEmbedding
from pagedllm.model.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    layer_sliding_window,
    llama_rotary_embedding,
)
from pagedllm.model.mxfp4 import MXFP4_BLOCK, dequantize_mxfp4

EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
# llama.cpp's forms (converted GGUF files): one expert's matrix, a projection's biases
_GGUF_EXPERT_MATRIX = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_GGUF_EXPERT_BIAS = re.compile(r"^(.*\.mlp\.experts)\.(gate|up|gate_up|down)_proj\.bias$")


class GptOssAttention(LlamaAttention):
    """Llama's attention (q/k/v/o biases from the config's attention_bias) with a sink logit per head."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, layer_index: int,
                 rotary_emb: RotaryEmbedding) -> None:
        super().__init__(config, tp, dtype, layer_index=layer_index, rotary_emb=rotary_emb)
        self.attn = Attention(self.qkv_proj.num_heads, self.head_dim, self.qkv_proj.num_kv_heads,
                              sliding_window=layer_sliding_window(config, layer_index), sinks=True)


class GptOssMoE(nn.Module):
    """The router (a biased linear) and the experts; each token's weights are the softmax of its top-k logits."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        num_experts, self.top_k = int(config.num_local_experts), int(config.num_experts_per_tok)
        self.router = ReplicatedLinear(config.hidden_size, num_experts, True, dtype)
        self.router.keep_unquantized = True
        self.experts = FusedMoE(num_experts, self.top_k, config.hidden_size, config.intermediate_size, False, tp,
                                dtype, custom_routing_function=self.route, activation="swigluoai", bias=True)

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]): the top-k logits' softmax, as transformers' router."""
        values, ids = torch.topk(router_logits, self.top_k, dim=-1)
        return torch.softmax(values.float(), dim=-1), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssForCausalLM(LlamaForCausalLM):
    loads_fp8_checkpoints = False  # expert weights are not [out, in] linears
    lora_modules: dict[str, str] = {}  # its linears are Llama's, its experts are not: no adapters

    def build_model(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> LlamaModel:
        if getattr(config, "swiglu_limit", 7.0) != 7.0 or getattr(config, "swiglu_alpha", 1.702) != 1.702:
            raise ValueError(f"GPT-OSS experts with swiglu_limit={config.swiglu_limit}, "
                             f"swiglu_alpha={config.swiglu_alpha}: only gpt-oss's 7.0 and 1.702 are supported")
        rotary = llama_rotary_embedding(config)

        def make_layer(i: int) -> nn.Module:
            return LlamaDecoderLayer(config, tp, dtype, mlp=GptOssMoE(config, tp, dtype), layer_index=i,
                                     self_attn=GptOssAttention(config, tp, dtype, i, rotary))

        return LlamaModel(config, tp, dtype, make_layer=make_layer)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        experts = {name: m for name, m in self.named_modules() if isinstance(m, FusedMoE)}
        for moe in experts.values():
            moe.w13_weight.optional = moe.w2_weight.optional = True
            moe.w13_bias.optional = moe.w2_bias.optional = True
        seen: dict[str, set[str]] = {name: set() for name in experts}
        gguf_parts: dict[str, set[tuple[str, int]]] = {name: set() for name in experts}
        super().load_weights(self._dense_weights(weights, experts, seen, gguf_parts))
        for name, got in seen.items():
            got = got | self._gguf_projections_loaded(experts[name], gguf_parts[name])
            if got != set(EXPERT_TENSORS):
                raise ValueError(f"checkpoint is missing {sorted(set(EXPERT_TENSORS) - got)} of {name}")

    def _dense_weights(self, weights: Iterable[tuple[str, torch.Tensor]], experts: dict[str, FusedMoE],
                       seen: dict[str, set[str]], gguf_parts: dict[str, set[tuple[str, int]]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """Expert tensors (MXFP4 pairs dequantized) into their FusedMoE, sinks renamed and sliced to this rank's
        heads; every other tensor yielded for the Llama loader. `gguf_parts` collects the GGUF forms' (projection,
        expert) matrices and ("bias", gate / up / down) biases loaded."""
        pending: dict[str, torch.Tensor] = {}  # an MXFP4 projection's blocks or scales until the other comes
        rank = next(iter(experts.values())).tp.rank  # (every layer has experts)
        for name, tensor in weights:
            if (m := _GGUF_EXPERT_MATRIX.match(name)) and m[1] in experts:
                experts[m[1]].load_expert_weight(int(m[2]), m[3], tensor)
                gguf_parts[m[1]].add((m[3], int(m[2])))
                continue
            if (m := _GGUF_EXPERT_BIAS.match(name)) and m[1] in experts:
                self._load_gguf_expert_bias(experts[m[1]], m[2], tensor)
                gguf_parts[m[1]].update(("bias", p) for p in (("gate", "up") if m[2] == "gate_up" else (m[2],)))
                continue
            if name.endswith(".self_attn.sinks"):
                attn = self.get_submodule(name[: -len(".sinks")]).attn
                lo = attn.num_heads * rank
                yield name[: -len(".sinks")] + ".attn.sinks", tensor[lo: lo + attn.num_heads]
                continue
            owner, _, leaf = name.rpartition(".")
            if owner not in experts:
                yield name, tensor
                continue
            if leaf.endswith(("_blocks", "_scales")):
                base = leaf.rsplit("_", 1)[0]
                other = f"{owner}.{base}_{'scales' if leaf.endswith('_blocks') else 'blocks'}"
                if other not in pending:
                    pending[name] = tensor
                    continue
                blocks, scales = (tensor, pending.pop(other)) if leaf.endswith("_blocks") else (pending.pop(other),
                                                                                                 tensor)
                self._check_expert_shape(experts[owner], base, (blocks.shape[0], *blocks.shape[1:-2],
                                                                blocks.shape[-2] * blocks.shape[-1] * 2), rows=True)
                if experts[owner].w13_blocks is not None:  # served as MXFP4: the bytes as they are
                    self._load_mxfp4_rows(experts[owner], base, blocks, scales)
                else:
                    for e in range(blocks.shape[0]):  # one expert at a time: the float copy of a layer is GBs
                        self._load_expert_rows(experts[owner], base, e, dequantize_mxfp4(blocks[e], scales[e],
                                                                                         torch.float32))
                seen[owner].add(base)
                continue
            moe = experts[owner]
            self._check_expert_shape(moe, leaf, tuple(tensor.shape), rows=False)
            if moe.w13_blocks is not None and not leaf.endswith("_bias"):
                raise ValueError(f"{name}: a dense expert tensor, but this engine holds the experts as MXFP4 "
                                 "(quantization='mxfp4'); load it with quantization='none'")
            if leaf.endswith("_bias"):
                self._load_expert_bias(moe, leaf, tensor)
            else:  # the dense checkpoints' [E, in, out]
                for e in range(tensor.shape[0]):
                    self._load_expert_rows(moe, leaf, e, tensor[e].transpose(0, 1))
            seen[owner].add(leaf)
        if pending:
            raise ValueError(f"MXFP4 tensors without their pair (blocks and scales): {sorted(pending)}")

    @staticmethod
    def _gguf_projections_loaded(moe: FusedMoE, parts: set[tuple[str, int]]) -> set[str]:
        """Which of EXPERT_TENSORS the GGUF forms in `parts` (or GGUF blocks held by quantization='gguf') gave."""
        every = range(moe.num_experts)
        out = set()
        if moe.w13_gguf is not None or all(("gate", e) in parts and ("up", e) in parts for e in every):
            out.add("gate_up_proj")
        if moe.w2_gguf is not None or all(("down", e) in parts for e in every):
            out.add("down_proj")
        if {("bias", "gate"), ("bias", "up")} <= parts:
            out.add("gate_up_proj_bias")
        if ("bias", "down") in parts:
            out.add("down_proj_bias")
        return out

    @staticmethod
    def _load_gguf_expert_bias(moe: FusedMoE, proj: str, tensor: torch.Tensor) -> None:
        """A GGUF file's expert biases of `proj` (gate / up [E, I], gate_up [E, 2I] gate then up, down [E, H])."""
        lo, n, inter = moe.tp.rank * moe.shard, moe.shard, moe.intermediate_size
        want = (moe.num_experts, {"gate": inter, "up": inter, "gate_up": 2 * inter, "down": moe.hidden_size}[proj])
        if tuple(tensor.shape) != want:
            raise ValueError(f"GPT-OSS {proj} expert biases: shape {tuple(tensor.shape)}, expected {want}")
        with torch.no_grad():
            if proj == "down":
                moe.w2_bias.copy_(tensor)
            if proj in ("gate", "gate_up"):
                moe.w13_bias[:, :n].copy_(tensor[:, lo:lo + n])
            if proj in ("up", "gate_up"):
                start = inter if proj == "gate_up" else 0
                moe.w13_bias[:, n:].copy_(tensor[:, start + lo:start + lo + n])

    @staticmethod
    def _check_expert_shape(moe: FusedMoE, leaf: str, shape: tuple[int, ...], rows: bool) -> None:
        """`shape` of one of EXPERT_TENSORS as the dense checkpoints store it, or (`rows`) as rows [E, out, in]."""
        e, h, inter = moe.num_experts, moe.hidden_size, moe.intermediate_size
        want = {"gate_up_proj": (e, h, 2 * inter), "gate_up_proj_bias": (e, 2 * inter),
                "down_proj": (e, inter, h), "down_proj_bias": (e, h)}
        if leaf not in want:
            raise ValueError(f"unknown GPT-OSS expert tensor {leaf!r}; expected one of {EXPERT_TENSORS}")
        expected = want[leaf] if not rows else (want[leaf][0], want[leaf][2], want[leaf][1])
        if tuple(shape) != expected:
            raise ValueError(f"GPT-OSS expert tensor {leaf}: shape {tuple(shape)}, expected {expected}"
                             + (" (as rows [experts, out, in])" if rows else ""))

    @staticmethod
    def _load_expert_rows(moe: FusedMoE, leaf: str, expert: int, rows: torch.Tensor) -> None:
        """Expert `expert`'s projection as rows [out, in] (gate_up: gate / up rows interleaved) into this rank's
        [gate; up] / down slices."""
        lo, n = moe.tp.rank * moe.shard, moe.shard
        with torch.no_grad():
            if leaf == "gate_up_proj":
                moe.w13_weight[expert, :n].copy_(rows[0::2][lo:lo + n])
                moe.w13_weight[expert, n:].copy_(rows[1::2][lo:lo + n])
            else:
                moe.w2_weight[expert].copy_(rows[:, lo:lo + n])

    @staticmethod
    def _load_mxfp4_rows(moe: FusedMoE, leaf: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """A projection's MXFP4 blocks [E, out, G, 16] and scales [E, out, G] into this rank's [gate; up] / down
        bytes (a rank's share of down's inputs is whole 32-value groups: FusedMoE.hold_mxfp4 checks it)."""
        lo, n = moe.tp.rank * moe.shard, moe.shard
        packed = blocks.reshape(*blocks.shape[:2], -1)  # [E, out, in / 2]
        with torch.no_grad():
            if leaf == "gate_up_proj":
                for half, rows in ((slice(0, n), slice(0, None, 2)), (slice(n, None), slice(1, None, 2))):
                    moe.w13_blocks[:, half].copy_(packed[:, rows][:, lo:lo + n])
                    moe.w13_scales[:, half].copy_(scales[:, rows][:, lo:lo + n])
            else:
                g0, g = lo // MXFP4_BLOCK, n // MXFP4_BLOCK
                moe.w2_blocks.copy_(packed[:, :, lo // 2:(lo + n) // 2])
                moe.w2_scales.copy_(scales[:, :, g0:g0 + g])

    @staticmethod
    def _load_expert_bias(moe: FusedMoE, leaf: str, tensor: torch.Tensor) -> None:
        lo, n = moe.tp.rank * moe.shard, moe.shard
        with torch.no_grad():
            if leaf == "gate_up_proj_bias":  # gate / up interleaved
                moe.w13_bias[:, :n].copy_(tensor[:, 0::2][:, lo:lo + n])
                moe.w13_bias[:, n:].copy_(tensor[:, 1::2][:, lo:lo + n])
            else:
                moe.w2_bias.copy_(tensor)
