"""Rotary position embeddings (HF's rotate-half convention) with default/linear/llama3/yarn/longrope scaling, on whole
heads or on the first ``rotary_dim`` dims of each head (``partial_rotary_factor``: Phi-4-mini)."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedllm.model.layers.activation import fused_ops_for


def _per_layer_type(params: dict) -> bool:
    """One dict of settings per attention type (Gemma 3: ``{"sliding_attention": {...}, "full_attention": {...}}``)."""
    return bool(params) and all(isinstance(v, dict) or v is None for v in params.values())


def rope_parameters(config: Any, layer_type: str | None = None) -> dict:
    """Theta and scaling from a HF config, old (`rope_theta`/`rope_scaling`) or new (`rope_parameters`) style.

    Where the config holds one dict per layer type (Gemma 3), `layer_type` picks one (default: "full_attention")."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    if _per_layer_type(params) or _per_layer_type(scaling):
        nested = params if _per_layer_type(params) else scaling
        key = layer_type or "full_attention"
        if nested.get(key) is None:
            raise ValueError(f"the config's rope_parameters have no settings for {key!r}; it has {sorted(nested)}")
        params, scaling = dict(nested[key]), {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type in ("su", "yarn") and "short_factor" in params:  # Phi-3's early names of longrope (transformers too)
        rope_type = "longrope"
    params["rope_type"] = rope_type
    max_pos = getattr(config, "max_position_embeddings", None)
    if rope_type in ("llama3", "yarn", "longrope") and max_pos is not None:
        # As transformers: the pretraining length, from the config's own field first (Phi-3 keeps it there).
        own = getattr(config, "original_max_position_embeddings", None)
        if own is not None:
            params["original_max_position_embeddings"] = own
        params.setdefault("original_max_position_embeddings", max_pos)
        params.setdefault("max_position_embeddings", max_pos)
    return params


def partial_rotary_factor(config: Any) -> float:
    """The fraction of each head that RoPE rotates (1.0: whole heads), from `rope_parameters` or the config's own
    `partial_rotary_factor` (transformers' two places for it). Only model families whose HF modeling applies it
    (Phi-3) should read it: transformers' Llama ignores it."""
    params = getattr(config, "rope_parameters", None) or {}
    value = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return 1.0 if value is None else float(value)


def attention_factor(params: dict) -> float:
    """The factor on cos and sin (YaRN's attention temperature; 1 for the other types)."""
    if params["rope_type"] == "longrope":
        return _longrope_attention_factor(params)
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    factor = _yarn_factor(params)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, float(params["mscale"])) / mscale(factor, float(params["mscale_all_dim"]))
    return mscale(factor)


def _yarn_factor(params: dict) -> float:
    if params.get("factor") is not None:
        return float(params["factor"])
    return float(params["max_position_embeddings"]) / float(params["original_max_position_embeddings"])


def _yarn_inv_freq(head_dim: int, base: float, params: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023) as transformers computes it: high-frequency dimensions keep their frequency,
    low-frequency ones are interpolated by `factor`, with a linear ramp between the correction range's bounds."""
    factor = _yarn_factor(params)
    beta_fast, beta_slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)
    original = float(params["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation



def _longrope_attention_factor(params: dict) -> float:
    """LongRoPE's factor on cos and sin (transformers' default: from max / original positions unless given)."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    original = float(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else float(params["max_position_embeddings"]) / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def longrope_uses_long_factors(params: dict) -> bool:
    """Whether LongRoPE rotates with its long factors: when the model serves past its pretraining length.

    transformers picks per sequence (short factors while a sequence fits the original length, then recomputes
    the whole cache with the long ones); a paged KV cache cannot be recomputed, so, as vLLM with a max_model_len
    beyond the original length (its default for these checkpoints), every position uses the long factors."""
    return float(params["max_position_embeddings"]) > float(params["original_max_position_embeddings"])


def _longrope_inv_freq(head_dim: int, base: float, params: dict, dim_name: str = "head_dim") -> torch.Tensor:
    """LongRoPE (Phi-3 128k): per-dimension factors divide the default frequencies."""
    key = "long_factor" if longrope_uses_long_factors(params) else "short_factor"
    factors = params.get(key)
    if factors is None or len(factors) != head_dim // 2:
        raise ValueError(f"longrope needs {key} with {dim_name} / 2 = {head_dim // 2} entries, got "
                         f"{None if factors is None else len(factors)}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float64) * base**exponents)


def _inv_freq(dim: int, params: dict, dim_name: str = "head_dim") -> torch.Tensor:
    """The inverse frequencies of `dim` rotated dims: head_dim, or the rotary dim under a partial factor (as
    transformers: the exponents and every scaling run over the rotated dims, not the whole head); `dim_name` names
    that width in errors."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, base, params)
    if rope_type == "llama3":
        factor = float(params["factor"])
        low = float(params.get("low_freq_factor", 1.0))
        high = float(params.get("high_freq_factor", 4.0))
        old_ctx = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if rope_type == "longrope":
        return _longrope_inv_freq(dim, base, params, dim_name)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported; supported: default, linear, llama3, yarn, "
                     f"longrope")


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given each token's absolute position.

    `rotary_dim` (default: head_dim): RoPE rotates the first rotary_dim dims of each head (rotate-half within them)
    and passes the rest through, as transformers' Phi-3 with a partial_rotary_factor; the caches hold rotary_dim
    columns, the frequencies are computed over rotary_dim."""

    def __init__(self, head_dim: int, max_position: int, params: dict, dtype: torch.dtype,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"the rotary dim must be even and in (0, head_dim = {head_dim}], got {rotary_dim}")
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.init_args = (head_dim, max_position, params, dtype, rotary_dim)  # to compute the caches again elsewhere
        inv_freq = _inv_freq(rotary_dim, params, "head_dim" if rotary_dim == head_dim else "rotary_dim").float()
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = attention_factor(params)
        self.register_buffer("cos_cache", (emb.cos() * scale).to(dtype), persistent=False)
        self.register_buffer("sin_cache", (emb.sin() * scale).to(dtype), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def _apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return x * cos + self._rotate_half(x) * sin
        rot, rest = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat((rot * cos + self._rotate_half(rot) * sin, rest), dim=-1)

    def _rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D] → rotated copies, computed in the caches' precision (fp32 here)."""
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return self._apply_rope(q, cos, sin), self._apply_rope(k, cos, sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq·D], k [T, Hk·D] in the model's dtype (e.g. column slices of a fused qkv output) → rotated
        q, k of the same shapes and dtype.

        On CUDA (kernels/triton_fused_ops.py) and on the CPU in float32 (kernels/cpu_kernels.py) one fused
        kernel rotates q and k in place (the first rotary_dim dims of each head), in fp32 with one final rounding
        to their dtype, and returns them; elsewhere ``forward_native`` returns new tensors.
        """
        ops = None
        if (q.dim() == 2 and k.dim() == 2 and q.stride(-1) == 1 and k.stride(-1) == 1
                and self.cos_cache.dtype == torch.float32):
            ops = fused_ops_for(q)
        if ops is not None:
            ops.rotary_embedding(positions, q, k, self.cos_cache, self.sin_cache, self.head_dim,
                                 rotary_dim=self.rotary_dim)
            return q, k
        return self.forward_native(positions, q, k)

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """The torch path of ``forward`` (CPU, and the kernel's oracle): float32 round trip; new tensors."""
        t, dtype = q.shape[0], q.dtype
        q, k = self._rotate(positions, q.reshape(t, -1, self.head_dim).float(), k.reshape(t, -1, self.head_dim).float())
        return q.to(dtype).reshape(t, -1), k.to(dtype).reshape(t, -1)


def interleaved_to_half_rows(rows: torch.Tensor, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """A q or k projection's rows ([heads · head_dim, ...]: a weight, a bias, a LoRA B) for a model whose RoPE rotates
    interleaved pairs (dims 2i, 2i + 1 of each head: GPT-J's rotate_every_two, Cohere, GLM), reordered so that this
    module's rotate-half RoPE (pairs i, i + rotary_dim / 2) rotates the same pairs at the same frequencies. Scores are
    unchanged: q and k are permuted alike within each head, v is not; dims past rotary_dim keep their places."""
    if rows.shape[0] % head_dim or not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(f"cannot reorder {rows.shape[0]} rows as heads of {head_dim} with {rotary_dim} rotated dims")
    order = torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2),
                       torch.arange(rotary_dim, head_dim)])
    heads = rows.reshape(rows.shape[0] // head_dim, head_dim, *rows.shape[1:])
    return heads[:, order].reshape(rows.shape)
