"""DeepSeek-V2 and DeepSeek-V3 (HF ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``): multi-head latent attention
(MLA) and DeepSeek's MoE (shared experts beside routed ones; grouped, bias-corrected routing on V3).

MLA projects each token to a compressed KV latent c_kv (``kv_lora_rank``) and one rotary key k_pe shared by every
head (``qk_rope_head_dim``); ``kv_b_proj`` expands the latent into each head's k_nope and v. As vLLM's MLA backends,
the paged cache holds only the latent: per token and layer one KV "head" [c_kv; k_pe] (576 wide on V2/V3), read by
every query head (MQA). kv_b_proj is absorbed instead of run: its k_nope rows W_UK turn each head's q_nope into
q_latent = q_nope · W_UK, so q_latent · c_kv = q_nope · k_nope and the query [q_latent; q_pe] attends over
[c_kv; k_pe] at the original softmax scale; the values are the same cached rows, the output's c_kv part
(Σ p · c_kv) goes through the v rows W_UV into each head's v_head_dim, and its k_pe part is dropped. The cache
stores one tensor per layer, read as keys and as values (``use_mla``: worker/cache_engine.py), so a token costs
kv_lora_rank + qk_rope_head_dim values per layer, whatever the head count. Prompts attend the same way (more FLOPs
than expanding K/V for them, one path for every step).

RoPE rotates interleaved pairs on DeepSeek (V2 always, V3 under ``rope_interleave``); the rotary parts of q and k are
de-interleaved before the engine's rotate-half RoPE, which rotates the same pairs at the same frequencies (q·k is
unchanged by permuting q's and k's dims alike).
"""
from __future__ import annotations

import math
from typing import Any, Iterable

import torch
from torch import nn
import torch.nn.functional as F

from pagedllm.distributed.parallel_state import TensorParallelGroup, divide
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.attention import Attention
from pagedllm.model.layers.fused_moe import FusedMoE
from pagedllm.model.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.layers.rotary import RotaryEmbedding, rope_parameters
from pagedllm.model.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from pagedllm.model.models.moe import _MoeForCausalLM

KVCache = tuple[torch.Tensor, torch.Tensor]
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' (and DeepSeek's) default eps, not rms_norm_eps


def mla_cache_head_dim(config: Any) -> int:
    """The width of the one cached row per token and layer: the latent c_kv and the rotary key, kv_lora_rank +
    qk_rope_head_dim."""
    return int(config.kv_lora_rank) + int(config.qk_rope_head_dim)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 · mscale · ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(config: Any) -> float:
    """qk_head_dim**-0.5, times yarn_mscale(factor, mscale_all_dim)² under a scaled RoPE with ``mscale_all_dim``
    (as transformers' yarn_apply_mscale and DeepSeek's reference)."""
    scale = (int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)) ** -0.5
    params = rope_parameters(config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale *= m * m
    return scale


class MLAKVBProj(nn.Module):
    """``kv_b_proj`` absorbed, never run as a linear: this rank's heads' rows [H · (qk_nope + v), kv_lora_rank], read
    per head as W_UK_T [H, qk_nope, kv_lora_rank] and W_UV [H, kv_lora_rank, v_head_dim] (vLLM's names). Not a
    PackableGemm, so it stays dense (no CPU packing, no FP8 quantization) for the batched matmuls that use it."""

    def __init__(self, kv_lora_rank: int, num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
                 tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.qk_nope_head_dim = num_heads, qk_nope_head_dim
        rows = num_heads * (qk_nope_head_dim + v_head_dim)
        self.weight = nn.Parameter(torch.empty(rows, kv_lora_rank, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        """This rank's heads' rows of the checkpoint's kv_b_proj [all heads · (qk_nope + v), kv_lora_rank]."""
        rows, cols = param.shape
        if tuple(loaded.shape) != (rows * self.tp.size, cols):
            raise ValueError(f"kv_b_proj: expected {(rows * self.tp.size, cols)}, checkpoint has "
                             f"{tuple(loaded.shape)}")
        param.data.copy_(loaded[self.tp.rank * rows:(self.tp.rank + 1) * rows])

    def _per_head(self) -> torch.Tensor:
        return self.weight.view(self.num_heads, -1, self.weight.shape[1])

    @property
    def W_UK_T(self) -> torch.Tensor:
        """[H, qk_nope, kv_lora_rank]: q_nope [H, T, qk_nope] @ W_UK_T → q_latent."""
        return self._per_head()[:, :self.qk_nope_head_dim]

    @property
    def W_UV(self) -> torch.Tensor:
        """[H, kv_lora_rank, v_head_dim]: the attention output's latent [H, T, kv_lora_rank] @ W_UV → v."""
        return self._per_head()[:, self.qk_nope_head_dim:].transpose(1, 2)


class DeepseekV2MLAAttention(nn.Module):
    """MLA over the cached latent with kv_b_proj absorbed (module doc). Under tensor parallelism each rank holds
    num_heads / tp heads of q_proj (or q_b_proj), kv_b_proj and o_proj; q_a_proj and kv_a_proj_with_mqa (the
    latents) are replicated, and so is the latent cache."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, rotary_emb: RotaryEmbedding,
                 rope_interleave: bool) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.num_heads = divide(heads, tp.size, "num_attention_heads")
        self.qk_nope_head_dim = int(config.qk_nope_head_dim)
        self.qk_rope_head_dim = int(config.qk_rope_head_dim)
        self.v_head_dim = int(config.v_head_dim)
        self.kv_lora_rank = int(config.kv_lora_rank)
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(config, "attention_bias", False))
        q_lora_rank = getattr(config, "q_lora_rank", None)
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, [heads * qk_head_dim], False, tp, dtype)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, int(q_lora_rank), bias, dtype)
            self.q_a_layernorm = RMSNorm(int(q_lora_rank), LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(int(q_lora_rank), [heads * qk_head_dim], False, tp, dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias, dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = MLAKVBProj(self.kv_lora_rank, self.num_heads, self.qk_nope_head_dim, self.v_head_dim, tp,
                                    dtype)
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias, tp, dtype)
        self.rotary_emb = rotary_emb
        self.rope_interleave = rope_interleave
        self.head_dim = mla_cache_head_dim(config)
        self.attn = Attention(self.num_heads, self.head_dim, 1, scale=mla_softmax_scale(config),
                              latent_dim=self.kv_lora_rank)

    def _rope_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[T, n, rope] (a strided view) → contiguous [T, n·rope], each head's interleaved pairs de-interleaved into
        rotate-half order when the checkpoint's RoPE is interleaved."""
        t = x.shape[0]
        if self.rope_interleave:
            x = x.unflatten(-1, (-1, 2)).transpose(-1, -2)
        return x.reshape(t, -1).contiguous()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        t, h, rope = x.shape[0], self.num_heads, self.qk_rope_head_dim
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, h, -1).split([self.qk_nope_head_dim, rope], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, rope], dim=-1)
        kv_c_normed = self.kv_a_layernorm(kv_c.contiguous())
        q_pe, k_pe = self.rotary_emb(positions, self._rope_rows(q_pe), self._rope_rows(k_pe.unsqueeze(1)))
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.kv_b_proj.W_UK_T).transpose(0, 1)
        q = torch.cat([q_latent, q_pe.view(t, h, rope)], dim=-1).view(t, h * self.head_dim)
        kv_c_pe = torch.cat([kv_c_normed, k_pe.view(t, rope)], dim=-1)  # the cached row, keys and values alike
        out = self.attn(q, kv_c_pe, kv_c_pe, kv_cache, meta).view(t, h, self.head_dim)[..., :self.kv_lora_rank]
        out = torch.bmm(out.transpose(0, 1), self.kv_b_proj.W_UV).transpose(0, 1)
        return self.o_proj(out.reshape(t, h * self.v_head_dim))


def _group_mask(scores: torch.Tensor, num_groups: int, topk_group: int, group_score: str) -> torch.Tensor:
    """[T, E] bool: the experts of each row's `topk_group` best groups, a group scored by its best expert ("max",
    V2's group_limited_greedy) or by the sum of its best two ("top2", V3)."""
    grouped = scores.view(scores.shape[0], num_groups, -1)
    per_group = grouped.max(dim=-1).values if group_score == "max" else grouped.topk(2, dim=-1)[0].sum(dim=-1)
    chosen = torch.topk(per_group, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(per_group, dtype=torch.bool).scatter_(1, chosen, True)
    return mask.unsqueeze(-1).expand_as(grouped).reshape(scores.shape)


class DeepseekV2TopkRouter(nn.Module):
    """The router (checkpoint ``mlp.gate``): logits in float32 from a float32 `weight` (transformers keeps it so),
    then top-k selection as transformers 5.25 does it.

    V2 (``sigmoid`` False): softmax scores; "greedy" top-k, or "group_limited_greedy" (top-k among the experts of
    the `topk_group` groups with the best single expert); weights = the scores · routed_scaling_factor.
    V3 (``sigmoid`` True, "noaux_tc"): sigmoid scores; experts chosen by score + `e_score_correction_bias` among the
    `topk_group` groups with the best sum of two biased scores; weights = the unbiased scores, over their sum if
    norm_topk_prob, · routed_scaling_factor."""

    def __init__(self, config: Any, num_experts: int, sigmoid: bool) -> None:
        super().__init__()
        self.top_k = int(config.num_experts_per_tok)
        self.sigmoid = sigmoid
        self.routed_scaling_factor = float(getattr(config, "routed_scaling_factor", 1.0) or 1.0)
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", False)) and sigmoid
        self.grouped = sigmoid or getattr(config, "topk_method", None) == "group_limited_greedy"
        self.num_groups = int(config.n_group) if self.grouped else 1
        self.topk_group = int(config.topk_group) if self.grouped else 1
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False) if sigmoid else None
        self.e_score_correction_bias = bias  # V3's: shifts which experts are chosen, not their weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits [T, E], float32."""
        return F.linear(x.float(), self.weight)

    def select_experts(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k] int64): FusedMoE's custom_routing_function."""
        if not self.sigmoid:
            scores = router_logits.softmax(dim=-1, dtype=torch.float32)
            if self.grouped:
                mask = _group_mask(scores, self.num_groups, self.topk_group, "max")
                scores = scores.masked_fill(~mask, 0.0)
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        else:
            scores = router_logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            mask = _group_mask(choice, self.num_groups, self.topk_group, "top2")
            ids = torch.topk(choice.masked_fill(~mask, float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
            if self.norm_topk_prob:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class DeepseekV2MoE(nn.Module):
    """Routed experts (``experts``, weighted by ``gate``) plus ``shared_experts``: one plain SwiGLU MLP of width
    moe_intermediate_size · n_shared_experts that every token passes through."""

    def __init__(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype, sigmoid: bool) -> None:
        super().__init__()
        num_experts = int(config.n_routed_experts)
        inter = int(config.moe_intermediate_size)
        self.gate = DeepseekV2TopkRouter(config, num_experts, sigmoid)
        self.experts = FusedMoE(num_experts, self.gate.top_k, config.hidden_size, inter, self.gate.norm_topk_prob, tp,
                                dtype, custom_routing_function=self.gate.select_experts)
        shared = int(getattr(config, "n_shared_experts", 0) or 0)
        self.shared_experts = None
        if shared:
            self.shared_experts = LlamaMLP(config, tp, dtype, bool(getattr(config, "mlp_bias", False)),
                                           intermediate_size=inter * shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        return out if self.shared_experts is None else out + self.shared_experts(x)


def _check_routing(config: Any, v3: bool) -> None:
    """ValueErrors for routing settings transformers' DeepSeek modeling (matched here) does not run as DeepSeek's
    reference does, or cannot run."""
    family = "DeepSeek-V3" if v3 else "DeepSeek-V2"
    scoring = getattr(config, "scoring_func", None)
    want = "sigmoid" if v3 else "softmax"
    if scoring is not None and scoring != want:
        raise ValueError(f"{family} routes with scoring_func={want!r}; the config has {scoring!r} (unsupported)")
    method = getattr(config, "topk_method", None) or "greedy"
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"DeepSeek-V2 topk_method={method!r} is not supported; supported: 'greedy', "
                         f"'group_limited_greedy'")
    if not v3 and getattr(config, "norm_topk_prob", False):
        raise ValueError("DeepSeek-V2 with norm_topk_prob=True is not supported: transformers' DeepSeek-V2 ignores it "
                         "and DeepSeek's reference renormalizes, so there is no one answer to match")
    freq = int(getattr(config, "moe_layer_freq", 1) or 1)
    if freq != 1:
        raise ValueError(f"moe_layer_freq={freq} is not supported (1 only: transformers puts an MoE block on every "
                         f"layer from first_k_dense_replace on, DeepSeek's reference on every moe_layer_freq-th)")
    experts, top_k = int(config.n_routed_experts), int(config.num_experts_per_tok)
    if v3 or method == "group_limited_greedy":
        groups, topk_group = getattr(config, "n_group", None), getattr(config, "topk_group", None)
        if not groups or not topk_group or experts % groups or not 1 <= topk_group <= groups:
            raise ValueError(f"{family} grouped routing needs n_group dividing n_routed_experts ({experts}) and "
                             f"1 <= topk_group <= n_group; got n_group={groups}, topk_group={topk_group}")
        per_group = experts // groups
        if v3 and per_group < 2:
            raise ValueError(f"DeepSeek-V3 scores each expert group by its best two experts: n_routed_experts / "
                             f"n_group must be >= 2, got {per_group}")
        if top_k > topk_group * per_group:
            raise ValueError(f"num_experts_per_tok={top_k} exceeds the {topk_group * per_group} experts of the "
                             f"topk_group={topk_group} groups a token may use")


def check_deepseek_config(config: Any, tp: TensorParallelGroup, v3: bool) -> None:
    """Clear errors for configs this implementation does not run."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads != heads:
        raise ValueError(f"MLA gives every attention head its own k_nope and v: num_key_value_heads must equal "
                         f"num_attention_heads ({heads}), got {kv_heads}")
    if heads % tp.size:
        raise ValueError(f"tensor_parallel_size ({tp.size}) must divide num_attention_heads ({heads})")
    if int(config.qk_rope_head_dim) % 2:
        raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs), got {config.qk_rope_head_dim}")
    if getattr(config, "n_routed_experts", None):
        _check_routing(config, v3)


class DeepseekV2ForCausalLM(_MoeForCausalLM):
    """DeepSeek-V2 / V2-Lite (and V2.5, Coder-V2): MLA layers; a dense SwiGLU MLP on the first
    `first_k_dense_replace` layers, DeepseekV2MoE after. Multi-token-prediction layers a V3 checkpoint stores past
    num_hidden_layers are skipped at load (as vLLM when not speculating with them)."""

    stacked_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    lora_modules: dict[str, str] = {}  # LoRA not supported: MLA's projections are not Llama's
    direct_forward_supported = False  # the CPU direct forward is written for Llama's attention
    v3 = False
    use_mla = True  # the KV pool: one latent row per token and layer, the key tensor read as values too

    @staticmethod
    def kv_cache_head_size(config: Any) -> int:
        """The worker's KV pool width (registry.kv_cache_head_size): the latent row, kv_lora_rank +
        qk_rope_head_dim (transformers' ``head_dim`` is qk_rope_head_dim here)."""
        return mla_cache_head_dim(config)

    def build_model(self, config: Any, tp: TensorParallelGroup, dtype: torch.dtype) -> LlamaModel:
        check_deepseek_config(config, tp, self.v3)
        rotary = RotaryEmbedding(int(config.qk_rope_head_dim), getattr(config, "max_position_embeddings", 8192),
                                 rope_parameters(config), torch.float32)
        interleave = bool(getattr(config, "rope_interleave", True)) if self.v3 else True
        bias = bool(getattr(config, "mlp_bias", False))

        def make_layer(i: int) -> nn.Module:
            attn = DeepseekV2MLAAttention(config, tp, dtype, rotary, interleave)
            mlp = self.make_mlp(config, i, tp, dtype)
            if mlp is None:
                mlp = LlamaMLP(config, tp, dtype, bias)
            return LlamaDecoderLayer(config, tp, dtype, mlp=mlp, layer_index=i, self_attn=attn)

        return LlamaModel(config, tp, dtype, make_layer=make_layer)

    def make_mlp(self, config: Any, layer_index: int, tp: TensorParallelGroup, dtype: torch.dtype) -> nn.Module | None:
        if not getattr(config, "n_routed_experts", None) or layer_index < int(config.first_k_dense_replace or 0):
            return None
        return DeepseekV2MoE(config, tp, dtype, sigmoid=self.v3)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        num_layers = int(self.config.num_hidden_layers)

        def decoder_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                parts = name.split(".")
                if len(parts) > 2 and parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers:
                    continue  # a multi-token-prediction layer (num_nextn_predict_layers)
                yield name, tensor

        super().load_weights(_dequantize_kv_b_proj(decoder_weights()))


def _dequantize_kv_b_proj(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
    """An FP8 checkpoint's kv_b_proj kept e4m3 with per-row scales (its weight, then its weight_scale:
    model/fp8_checkpoint.py) dequantized to one float32 weight: it is absorbed, never run as a linear (MLAKVBProj)."""
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(".kv_b_proj"):
            yield name, tensor
        elif leaf == "weight" and tensor.dtype == torch.float8_e4m3fn:
            pending[prefix] = tensor
        elif leaf == "weight_scale":
            weight = pending.pop(prefix, None)
            if weight is None:
                raise ValueError(f"{name} comes without an e4m3 {prefix}.weight before it")
            yield f"{prefix}.weight", weight.float() * tensor.float().reshape(-1, 1)
        else:
            yield name, tensor
    if pending:
        raise ValueError(f"e4m3 weights without their weight_scale: {sorted(pending)}")


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 / R1 (and Kimi K2-style configs): V2's layers with V3's sigmoid, bias-corrected grouped router
    ("noaux_tc") and optional non-interleaved RoPE (``rope_interleave`` False)."""

    v3 = True
