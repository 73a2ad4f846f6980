"""A lower bound on an offline run's time, from the workload, the model shape and two ceilings measured
on the same GPU in the same run (device-to-device copy bandwidth ``BW``, bf16 matmul peak ``P``).

Request i has ``p_i`` prompt tokens and ``o_i`` output tokens. The first output token comes with the
prefill; the other ``o_i - 1`` are decode tokens.

Prefill (compute-bound)::

    F_pre  = Σ_i [ 2·N_mm·p_i  +  L·4·Hq·D·p_i·(p_i+1)/2  +  2·H·V ]      (linear layers, causal attention
                                                                            QKᵀ and PV, one lm_head row)
    T_pre  = F_pre / P

Decode (memory-bound: weights once per step at the largest batch, every token's KV read)::

    B      = min(max_num_seqs, num_requests, pool_tokens // mean(p_i + o_i))
    steps  = max( ceil(Σ_i (o_i − 1) / B),  max_i (o_i − 1) )     (a request's decode tokens are sequential:
                                                                  the longest one alone needs o_i − 1 steps)
    KV     = Σ_i Σ_{j=1}^{o_i−1} (p_i + j) · kv_bytes_per_token
    T_dec  = max( (steps·W + KV) / BW ,  2·(N_mm + H·V)·Σ_i (o_i − 1) / P )

    bound  = T_pre + T_dec

with ``N_mm`` = matmul weights of the decoder layers ``L·(H·(Hq+2·Hk)·D + Hq·D·H + m·H·I)`` (m = 3 for
gated MLPs, 2 otherwise), ``W = (N_mm + H·V)·bytes`` the weight bytes one step reads (the lm_head too),
``kv_bytes_per_token = 2·L·Hk·D·bytes``. The two phases are added, as if prefill and decode never
shared a step: a mixed step that overlaps prefill FLOPs with the decode's weight reads can beat it in
principle, so efficiency = bound / measured time could exceed 100 % on prefill-heavy mixes (it has not).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    mlp_matrices: int = 3
    dtype_bytes: int = 2

    @classmethod
    def from_hf_config(cls, cfg, dtype_bytes: int = 2) -> "ModelShape":
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        gated = getattr(cfg, "model_type", "llama") in ("llama", "mistral", "qwen2")
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, heads, kv, head_dim,
                   cfg.vocab_size, 3 if gated else 2, dtype_bytes)

    @property
    def layer_matmul_params(self) -> int:
        h, d = self.hidden, self.head_dim
        return h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h + \
            self.mlp_matrices * h * self.intermediate

    @property
    def matmul_params(self) -> int:
        """N_mm: the decoder layers' matmul weights (no embedding, no lm_head)."""
        return self.num_layers * self.layer_matmul_params

    @property
    def step_weight_bytes(self) -> int:
        """W: bytes of weights one forward reads (decoder matmuls + lm_head)."""
        return (self.matmul_params + self.hidden * self.vocab) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class LowerBound:
    prefill_flops: float
    prefill_s: float
    decode_batch: int
    decode_steps: int
    decode_weight_bytes: float
    decode_kv_bytes: float
    decode_flops: float
    decode_s: float
    bandwidth: float
    matmul_peak: float

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    def as_dict(self) -> dict:
        return {**self.__dict__, "total_s": self.total_s}


def lower_bound(shape: ModelShape, prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
                pool_tokens: int, bandwidth: float, matmul_peak: float) -> LowerBound:
    """The bound above for one workload; `bandwidth` in bytes/s, `matmul_peak` in FLOP/s."""
    if len(prompt_lens) != len(output_lens) or not prompt_lens:
        raise ValueError("prompt_lens and output_lens must be non-empty and of equal length.")
    if bandwidth <= 0 or matmul_peak <= 0:
        raise ValueError(f"bandwidth and matmul_peak must be > 0, got {bandwidth} and {matmul_peak}.")
    lm = 2 * shape.hidden * shape.vocab
    attn = shape.num_layers * 4 * shape.num_heads * shape.head_dim
    f_pre = sum(2 * shape.matmul_params * p + attn * p * (p + 1) / 2 + lm for p in prompt_lens)
    dec_tokens = sum(max(0, o - 1) for o in output_lens)
    mean_len = sum(p + o for p, o in zip(prompt_lens, output_lens)) / len(prompt_lens)
    batch = max(1, min(max_num_seqs, len(prompt_lens), int(pool_tokens // mean_len)))
    steps = max(math.ceil(dec_tokens / batch), max(o - 1 for o in output_lens))
    # Σ_{j=1}^{o-1} (p + j) = (o-1)·p + (o-1)·o/2
    kv_tokens = sum((o - 1) * p + (o - 1) * o / 2 for p, o in zip(prompt_lens, output_lens) if o > 1)
    w = steps * shape.step_weight_bytes
    kv = kv_tokens * shape.kv_bytes_per_token
    f_dec = 2 * (shape.matmul_params + shape.hidden * shape.vocab) * dec_tokens
    t_dec = max((w + kv) / bandwidth, f_dec / matmul_peak)
    return LowerBound(f_pre, f_pre / matmul_peak, batch, steps, w, kv, f_dec, t_dec, bandwidth, matmul_peak)


def measure_matmul_peak(n: int = 8192, iters: int = 10) -> float:
    """bf16 matmul FLOP/s on this GPU: the mean of `iters` n×n×n products on random data after warm-up."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (start.elapsed_time(end) / 1e3)


def format_bound(lb: LowerBound, elapsed_s: float) -> str:
    return (f"lower bound {lb.total_s:.2f} s (prefill {lb.prefill_s:.2f} s at {lb.matmul_peak / 1e12:.0f} TFLOP/s, "
            f"decode {lb.decode_s:.2f} s: {lb.decode_steps} steps at batch {lb.decode_batch}, "
            f"{(lb.decode_weight_bytes + lb.decode_kv_bytes) / 1e9:.1f} GB at {lb.bandwidth / 1e12:.2f} TB/s); "
            f"measured {elapsed_s:.2f} s → efficiency {100 * lb.total_s / elapsed_s:.1f} %")
