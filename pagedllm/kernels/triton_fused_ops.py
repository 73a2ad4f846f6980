"""Fused elementwise kernels in Triton for the CUDA path: RMSNorm (optionally with the residual add), rotary
embedding (in place) and SwiGLU's ``silu(gate) * up``. One launch each, no host syncs (CUDA-graph capturable).

Each reproduces the roundings of the plain-torch code it replaces (``model/layers/norm.py``, ``rotary.py``,
``activation.py``), which stays the CPU path and the oracle:

* every op torch performs in the tensor's dtype (bf16/fp16) is done in fp32 and rounded to that dtype at the
  same point torch rounds (``(a.f32 + b.f32).to(dtype)``, ``(a.f32 * b.f32).to(dtype)``);
* kernels are compiled with ``enable_fp_fusion=False`` so that ``a * b + c`` is two rounded fp32 ops, as in
  torch's separate elementwise kernels, not one FMA;
* transcendental functions use libdevice (``expf``, ``rsqrtf``) with FTZ off, the functions PyTorch's CUDA
  kernels call, and ``silu``'s division is IEEE round-to-nearest (``div_rn``), as in torch;
* RMSNorm's mean is ``sum(x²) * (1/N)`` like torch's CUDA ``mean``; only the summation order differs, so a
  row's normaliser can be an ulp off torch's.

Under Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) libdevice is unavailable: numpy's exp / 1/sqrt
stand in, so there results may differ from torch's CPU kernels by an ulp.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # libdevice cannot run under the interpreter; the kernels pick tl.exp / tl.math.rsqrt there instead
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - very old Triton
    libdevice = None


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _rsqrt(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.rsqrt(x)
    else:
        return tl.math.rsqrt(x)


# ----------------------------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    N, inv_n, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PRECISE: tl.constexpr, GEMMA: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)  # torch: x + residual in the input dtype
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) * inv_n  # torch CUDA mean = sum * (1/N)
    rstd = _rsqrt(mean_sq + eps, PRECISE)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:  # Gemma: (x · rstd) · (1 + w) in fp32, one rounding at the end
        tl.store(out_ptr + row * stride_o + cols, ((xf * rstd) * (1.0 + w)).to(dtype), mask=mask)
    else:
        y = (xf * rstd).to(dtype)  # .to(orig)
        tl.store(out_ptr + row * stride_o + cols, (w * y.to(tl.float32)).to(dtype), mask=mask)


# ------------------------------------------------------------------------------------------------- RoPE


@triton.jit
def _rotate_heads(base_ptr, stride_h, h0, H, cos1, sin1, cos2, sin2, d, dmask,
                  HALF: tl.constexpr, HEAD_BLOCK: tl.constexpr):
    h = h0 + tl.arange(0, HEAD_BLOCK)
    mask = (h[:, None] < H) & dmask[None, :]
    p1 = base_ptr + h[:, None] * stride_h + d[None, :]
    p2 = p1 + HALF
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    # torch: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; three rounded ops per element, no FMA
    o1 = x1 * cos1[None, :] - x2 * sin1[None, :]
    o2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    tl.store(p1, o1.to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, o2.to(base_ptr.dtype.element_ty), mask=mask)


# HALF is half the rotary dim: head_dim / 2, or less under partial rotary (the rest of each head is not touched).
@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    HQ, HK,
    NUM_Q_BLOCKS: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    HEAD_BLOCK_Q: tl.constexpr, HEAD_BLOCK_K: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    dmask = d < HALF
    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_sin
    cos1 = tl.load(cos_row + d, mask=dmask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row + d, mask=dmask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + HALF + d, mask=dmask, other=0.0).to(tl.float32)
    if hb < NUM_Q_BLOCKS:
        _rotate_heads(q_ptr + tok * stride_qt, stride_qh, hb * HEAD_BLOCK_Q, HQ,
                      cos1, sin1, cos2, sin2, d, dmask, HALF, HEAD_BLOCK_Q)
    else:
        _rotate_heads(k_ptr + tok * stride_kt, stride_kh, (hb - NUM_Q_BLOCKS) * HEAD_BLOCK_K, HK,
                      cos1, sin1, cos2, sin2, d, dmask, HALF, HEAD_BLOCK_K)


# ------------------------------------------------------------------------------------------------ SwiGLU


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    # torch CUDA silu: x / (1 + expf(-x)) in fp32, rounded to the dtype; then the dtype product
    act = tl.math.div_rn(gate, 1.0 + _exp(-gate, PRECISE)).to(dtype)
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * up).to(dtype), mask=mask)


@triton.jit
def _one_plus_tanh(x, PRECISE: tl.constexpr):
    if PRECISE:  # as torch: libdevice's tanhf, then the add
        return 1.0 + libdevice.tanh(x)
    else:  # the interpreter: 2 / (1 + e^{-2x}), the same value without 1 + tanh's cancellation at x << 0
        return 2.0 / (1.0 + tl.exp(-2.0 * x))


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr, PRECISE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    # torch CUDA gelu(approximate="tanh") in fp32: 0.5·x·(1 + tanh(√2·(2/√π)·0.5·(x + 0.044715·x³))), rounded to the
    # dtype; then the dtype product
    inner = 0.7978845608028654 * (gate + 0.044715 * (gate * gate * gate))
    act = (0.5 * gate * _one_plus_tanh(inner, PRECISE)).to(dtype)
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * up).to(dtype), mask=mask)


# ---------------------------------------------------------------------------------------------- wrappers


def _interpreted() -> bool:
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover
        return False
    return isinstance(_rms_norm_kernel, InterpretedFunction)


_INTERPRETED = _interpreted()
_PRECISE = not _INTERPRETED and libdevice is not None
# Separate fp32 roundings (no FMA contraction) and libdevice without flush-to-zero, like PyTorch's kernels.
_OPTS = {} if _INTERPRETED else {"enable_fp_fusion": False, "enable_reflect_ftz": False}


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D [tokens, hidden], got shape {tuple(x.shape)}.")
    return x if x.stride(-1) == 1 else x.contiguous()


def _rms_norm(x, residual, weight, eps, gemma: bool = False):
    x = _rows(x, "x")
    t, n = x.shape
    if weight.shape != (n,) or weight.dtype != x.dtype:
        raise ValueError(f"weight must be [{n}] of {x.dtype}, got {tuple(weight.shape)} of {weight.dtype}.")
    weight = weight.contiguous()
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if residual is not None:
        residual = _rows(residual, "residual")
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}.")
        res_out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    else:
        residual = res_out = out  # unused
    if t:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(t,)](
            x, residual, weight, out, res_out,
            x.stride(0), residual.stride(0), out.stride(0), res_out.stride(0),
            n, 1.0 / n, eps,
            HAS_RESIDUAL=res_out is not out, BLOCK=block, PRECISE=_PRECISE, GEMMA=gemma,
            num_warps=max(1, min(16, block // 256)), **_OPTS,
        )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x²) + eps))`` per row of x [T, N], as ``RMSNorm.forward`` rounds it."""
    return _rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (in x's dtype); returns (rms_norm(s), s), both new tensors (the inputs are not written)."""
    return _rms_norm(x, residual, weight, eps)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm per row of x [T, N]: ``(x * rsqrt(mean(x²) + eps)) * (1 + weight)`` in fp32, rounded once
    to x's dtype, as ``GemmaRMSNorm.forward_native``."""
    return _rms_norm(x, None, weight, eps, gemma=True)[0]


def fused_add_gemma_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (in x's dtype); returns (gemma_rms_norm(s), s), both new tensors."""
    return _rms_norm(x, residual, weight, eps, gemma=True)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_dim: int,
    rotary_dim: int | None = None,
) -> None:
    """Rotate-half RoPE applied in place to q [T, Hq·D] and k [T, Hk·D] (or [T, H, D]) at `positions` [T].

    q and k may be column slices of a fused qkv output (any row stride; last-dim stride 1). cos/sin caches are
    [max_pos, R] (each half of a row holding the same angles, HF's ``cat([freqs, freqs])``), R = `rotary_dim`
    (default: head_dim): the first R dims of each head are rotated, the other D - R are left as they are (partial
    rotary, Phi-4-mini).
    """
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}.")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim = {head_dim}], got {rotary_dim}.")
    t = q.shape[0]
    heads = []
    for name, x in (("q", q), ("k", k)):
        if x.shape[0] != t or x.stride(-1) != 1:
            raise ValueError(f"{name} must have {t} rows and a unit last-dim stride (shape {tuple(x.shape)}).")
        if x.dim() == 2:
            if x.shape[1] % head_dim:
                raise ValueError(f"{name} width {x.shape[1]} is not a multiple of head_dim {head_dim}.")
            heads.append((x.shape[1] // head_dim, head_dim))
        elif x.dim() == 3 and x.shape[2] == head_dim:
            heads.append((x.shape[1], x.stride(1)))
        else:
            raise ValueError(f"{name} must be [T, H*{head_dim}] or [T, H, {head_dim}], got {tuple(x.shape)}.")
    if q.dtype != k.dtype:
        raise ValueError(f"q ({q.dtype}) and k ({k.dtype}) must share a dtype.")
    if positions.shape != (t,):
        raise ValueError(f"positions must be [{t}], got {tuple(positions.shape)}.")
    for name, c in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if c.dim() != 2 or c.shape[1] != rotary_dim or c.stride(-1) != 1:
            raise ValueError(f"{name} must be [max_pos, {rotary_dim}] with unit last-dim stride, got {tuple(c.shape)}.")
    if t == 0:
        return
    (hq, stride_qh), (hk, stride_kh) = heads
    # The kernel rotates [0, HALF) against [HALF, 2·HALF) of each head (head starts `stride_h` apart): with
    # HALF = rotary_dim / 2 the dims past rotary_dim are never loaded or stored.
    half = rotary_dim // 2
    half_pad = triton.next_power_of_2(half)
    cap = max(1, 2048 // half_pad)  # ≤ 2048 elements per half-tile
    hb_q = min(triton.next_power_of_2(hq), cap)
    hb_k = min(triton.next_power_of_2(hk), cap)
    nq = triton.cdiv(hq, hb_q)
    nk = triton.cdiv(hk, hb_k)
    _rotary_kernel[(t, nq + nk)](
        positions, q, k, cos_cache, sin_cache,
        q.stride(0), stride_qh, k.stride(0), stride_kh, cos_cache.stride(0), sin_cache.stride(0),
        hq, hk,
        NUM_Q_BLOCKS=nq, HALF=half, HALF_PAD=half_pad, HEAD_BLOCK_Q=hb_q, HEAD_BLOCK_K=hb_k,
        num_warps=4, **_OPTS,
    )


def _gated(x: torch.Tensor, kernel) -> torch.Tensor:
    """x [T, 2I] = [gate | up] → act(gate) * up [T, I] through one of the gated-activation kernels."""
    x = _rows(x, "x")
    t, two_i = x.shape
    if two_i % 2:
        raise ValueError(f"x's last dim must be even, got {two_i}.")
    inter = two_i // 2
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)
    if t and inter:
        block = min(1024, triton.next_power_of_2(inter))
        kernel[(t, triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), inter,
            BLOCK=block, PRECISE=_PRECISE, num_warps=4, **_OPTS,
        )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] → silu(gate) * up [T, I], rounded like ``F.silu(gate) * up``."""
    return _gated(x, _silu_and_mul_kernel)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] → gelu(gate, approximate="tanh") * up [T, I] (GeGLU), rounded like the torch ops."""
    return _gated(x, _gelu_tanh_and_mul_kernel)
