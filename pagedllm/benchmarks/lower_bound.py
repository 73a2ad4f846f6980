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
``kv_bytes_per_token = 2·L·Hk·D·bytes``. With FP8 (issue 21) the bytes follow the formats: ``kv_bytes`` 1 for an
FP8 KV cache, decoder-matmul weights 1 byte each with ``--quantization fp8`` (the lm_head stays bf16), and then
the linear layers' FLOPs run at the FP8 matmul peak ``P8`` measured the same way (attention stays at ``P``).
With a mixture of experts the FLOPs count each token's top-k experts (``N_act`` in place of ``N_mm``), and ``W``
counts every expert: a decode batch of B rows reaches nearly all E experts once B·k is a few times E.
With sliding-window layers (Mistral-7B-v0.1, Gemma 2/3, Phi-3) a query at context c reads min(c, W_l) keys of
layer l: prefill attention FLOPs and decode KV bytes count min(c, W_l) in place of c, per layer; where every layer
slides, a sequence holds at most W tokens of the pool when B is sized.
The two phases are added, as if prefill and decode never
shared a step: a mixed step that overlaps prefill FLOPs with the decode's weight reads can beat it in
principle, so efficiency = bound / measured time could exceed 100 % on prefill-heavy mixes (it has not).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace


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
    kv_dtype_bytes: int | None = None  # None: dtype_bytes (1 for an FP8 KV cache)
    matmul_weight_bytes: int | None = None  # decoder-matmul weights; None: dtype_bytes (1 for FP8 weights)
    # Mixture of experts: `moe_layers` of the layers route each token to `moe_top_k` of `moe_experts` gated MLPs of
    # width `moe_intermediate` (plus a shared one of `moe_shared_intermediate`) instead of the dense MLP.
    moe_layers: int = 0
    moe_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate: int = 0
    moe_shared_intermediate: int = 0
    # Each layer's sliding window (None: the whole context); empty: every layer attends to the whole context.
    layer_windows: tuple[int | None, ...] = ()

    @classmethod
    def from_hf_config(cls, cfg, dtype_bytes: int = 2, kv_dtype_bytes: int | None = None,
                       matmul_weight_bytes: int | None = None) -> "ModelShape":
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        model_type = getattr(cfg, "model_type", "llama")
        gated = model_type in ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma",
                               "gemma2", "gemma3_text", "phi3")
        moe = {}
        experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
        if experts and model_type in ("mixtral", "qwen2_moe", "qwen3_moe"):
            step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
            dense = set(getattr(cfg, "mlp_only_layers", None) or [])
            layers = sum(1 for i in range(cfg.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
            moe = dict(moe_layers=layers, moe_experts=int(experts), moe_top_k=int(cfg.num_experts_per_tok),
                       moe_intermediate=int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size),
                       moe_shared_intermediate=int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0))
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, heads, kv, head_dim,
                   cfg.vocab_size, 3 if gated else 2, dtype_bytes, kv_dtype_bytes, matmul_weight_bytes, **moe,
                   layer_windows=_layer_windows(cfg))

    @property
    def layer_matmul_params(self) -> int:
        """A dense layer's matmul weights (attention projections and the MLP)."""
        return self._attention_params + self.mlp_matrices * self.hidden * self.intermediate

    @property
    def _attention_params(self) -> int:
        h, d = self.hidden, self.head_dim
        return h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h

    def _moe_layer_params(self, experts: int) -> int:
        """An MoE layer's matmul weights with `experts` routed experts counted (router and shared expert too)."""
        h = self.hidden
        return self._attention_params + h * self.moe_experts + 3 * h * (
            experts * self.moe_intermediate + self.moe_shared_intermediate) + (h if self.moe_shared_intermediate else 0)

    @property
    def matmul_params(self) -> int:
        """N_mm: the decoder layers' matmul weights (no embedding, no lm_head); with MoE, every expert."""
        dense = (self.num_layers - self.moe_layers) * self.layer_matmul_params
        return dense + self.moe_layers * self._moe_layer_params(self.moe_experts)

    @property
    def active_matmul_params(self) -> int:
        """The matmul weights one token multiplies by: N_mm, with MoE only each token's top-k experts."""
        dense = (self.num_layers - self.moe_layers) * self.layer_matmul_params
        return dense + self.moe_layers * self._moe_layer_params(self.moe_top_k)

    @property
    def step_weight_bytes(self) -> int:
        """W: bytes of weights one forward reads (decoder matmuls + lm_head)."""
        mm_bytes = self.dtype_bytes if self.matmul_weight_bytes is None else self.matmul_weight_bytes
        return self.matmul_params * mm_bytes + self.hidden * self.vocab * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        kv_bytes = self.dtype_bytes if self.kv_dtype_bytes is None else self.kv_dtype_bytes
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * kv_bytes

    def attended_keys(self, first: int, last: int) -> float:
        """Σ over layers and over queries at context lengths first..last of the keys each reads, ÷ num_layers
        (so a model without windows gives Σ c): what KV reads and attention FLOPs scale with."""
        if last < first:
            return 0.0
        windows = self.layer_windows or (None,) * self.num_layers
        return sum(_keys_upto(last, w) - _keys_upto(first - 1, w) for w in windows) / len(windows)

    @property
    def shared_window(self) -> int | None:
        """The window every layer shares (then a sequence holds at most that many tokens of KV), or None."""
        found = set(self.layer_windows)
        return found.pop() if len(found) == 1 else None


def _keys_upto(n: int, window: int | None) -> float:
    """Σ_{c=1}^{n} min(c, window) (window None: Σ c)."""
    if window is None or n <= window:
        return n * (n + 1) / 2
    return window * (window + 1) / 2 + (n - window) * window


def _layer_windows(cfg) -> tuple[int | None, ...]:
    """The model class's per-layer windows for a HF config (empty where it has none, or is not registered)."""
    from pagedllm.model.models.registry import get_model_class

    try:
        windows = getattr(get_model_class(cfg), "sliding_windows", None)
    except ValueError:
        return ()
    found = tuple(windows(cfg)) if windows is not None else ()
    return found if any(w is not None for w in found) else ()


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
    decode_compute_s: float  # the decode FLOPs at their peaks (T_dec's second term)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    def as_dict(self) -> dict:
        return {**self.__dict__, "total_s": self.total_s}


def lower_bound(shape: ModelShape, prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
                pool_tokens: int, bandwidth: float, matmul_peak: float,
                linear_peak: float | None = None) -> LowerBound:
    """The bound above for one workload; `bandwidth` in bytes/s, `matmul_peak` in FLOP/s; `linear_peak` the
    decoder linears' peak when it differs (FP8 weights: P8)."""
    if len(prompt_lens) != len(output_lens) or not prompt_lens:
        raise ValueError("prompt_lens and output_lens must be non-empty and of equal length.")
    if bandwidth <= 0 or matmul_peak <= 0:
        raise ValueError(f"bandwidth and matmul_peak must be > 0, got {bandwidth} and {matmul_peak}.")
    lm = 2 * shape.hidden * shape.vocab
    attn = shape.num_layers * 4 * shape.num_heads * shape.head_dim
    p_lin = matmul_peak if linear_peak is None else linear_peak
    f_lin = sum(2 * shape.active_matmul_params * p for p in prompt_lens)
    f_rest = sum(attn * shape.attended_keys(1, p) + lm for p in prompt_lens)
    f_pre = f_lin + f_rest
    dec_tokens = sum(max(0, o - 1) for o in output_lens)
    mean_len = sum(p + o for p, o in zip(prompt_lens, output_lens)) / len(prompt_lens)
    if shape.shared_window is not None:  # blocks behind the window are freed
        mean_len = min(mean_len, shape.shared_window)
    batch = max(1, min(max_num_seqs, len(prompt_lens), int(pool_tokens // mean_len)))
    steps = max(math.ceil(dec_tokens / batch), max(o - 1 for o in output_lens))
    # Σ_{j=1}^{o-1} (p + j) = (o-1)·p + (o-1)·o/2 keys without windows
    kv_tokens = sum(shape.attended_keys(p + 1, p + o - 1) for p, o in zip(prompt_lens, output_lens) if o > 1)
    w = steps * shape.step_weight_bytes
    kv = kv_tokens * shape.kv_bytes_per_token
    f_dec = 2 * (shape.active_matmul_params + shape.hidden * shape.vocab) * dec_tokens
    t_dec_compute = 2 * shape.active_matmul_params * dec_tokens / p_lin + 2 * shape.hidden * shape.vocab * dec_tokens / matmul_peak
    t_dec = max((w + kv) / bandwidth, t_dec_compute)
    return LowerBound(f_pre, f_lin / p_lin + f_rest / matmul_peak, batch, steps, w, kv, f_dec, t_dec, bandwidth,
                      matmul_peak, t_dec_compute)


def with_step_count(lb: LowerBound, shape: ModelShape, steps: int) -> LowerBound:
    """`lb` with the decode phase reading the weights once per step of an actual schedule (`steps`: the run's
    steps that carry decode rows) instead of the ideal count; KV bytes and FLOPs do not depend on the schedule.
    Against it a run's efficiency leaves out the tail that first-come-first-served admission runs after the
    queue empties (the ideal count needs output lengths in advance, BENCHMARKS.md §36.6)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}.")
    w = steps * shape.step_weight_bytes
    t_dec = max((w + lb.decode_kv_bytes) / lb.bandwidth, lb.decode_compute_s)
    return replace(lb, decode_steps=steps, decode_weight_bytes=w, decode_s=t_dec)


def measure_matmul_peak(n: int = 8192, iters: int = 10, fp8: bool = False) -> float:
    """bf16 matmul FLOP/s on this GPU: the mean of `iters` n×n×n products on random data after warm-up; with
    `fp8`, e4m3 × e4m3 → bf16 products through ``fp8_linear.scaled_mm`` (row-wise scales, fast accumulation: what FP8
    weights run)."""
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if fp8:
        from pagedllm.kernels.fp8_linear import scaled_mm

        a, b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        sa = torch.ones(n, 1, device="cuda", dtype=torch.float32)
        sb = torch.ones(1, n, device="cuda", dtype=torch.float32)

        def product():
            scaled_mm(a, sa, b, sb)
    else:
        def product():
            a @ b
    return 2 * n**3 / (mean_cuda_ms(product, iters) / 1e3)


def mean_cuda_ms(fn, iters: int = 10, warmup: int = 3) -> float:
    """The mean device time of `fn()` in ms over `iters` back-to-back calls after `warmup` calls (CUDA events)."""
    import torch

    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def format_bound(lb: LowerBound, elapsed_s: float) -> str:
    return (f"lower bound {lb.total_s:.2f} s (prefill {lb.prefill_s:.2f} s at {lb.matmul_peak / 1e12:.0f} TFLOP/s, "
            f"decode {lb.decode_s:.2f} s: {lb.decode_steps} steps at batch {lb.decode_batch}, "
            f"{(lb.decode_weight_bytes + lb.decode_kv_bytes) / 1e9:.1f} GB at {lb.bandwidth / 1e12:.2f} TB/s); "
            f"measured {elapsed_s:.2f} s → efficiency {100 * lb.total_s / elapsed_s:.1f} %")
