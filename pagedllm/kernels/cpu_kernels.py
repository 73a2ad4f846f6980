"""The CPU path's native kernels (kernels/cpu/cpu_ops.c): built on first use, called through ctypes.

Plain torch cannot read K/V through a block table without first copying every sequence's blocks
into a contiguous tensor, and its CPU SDPA then reads that copy again per query head: for a decode
step that is ~10x the bytes a kernel walking the block table needs (BENCHMARKS.md, "CPU attention").
So the CPU path, like the CUDA path, has a real PagedAttention kernel, and the same fused
elementwise ops as `kernels/triton_fused_ops.py` (RMSNorm with the residual add, Gemma's (1 + w)
RMSNorm, RoPE in place, SiLU·mul, GeGLU's gelu_tanh·mul), with the same signatures; `kernels/reference.py` and the layers' torch code stay the
oracles and the fallback.

The C source is compiled with the system C compiler (``$CC``, else ``cc``/``gcc``) for the ISA level of
kernels/cpu_isa.py (AVX-512, AVX2+FMA, or portable scalar code; ``PAGEDLLM_CPU_ISA`` forces a lower
one) into the pagedllm cache under a key of source, compiler, flags and ISA, so each machine builds each
level once (~1 s). ``PAGEDLLM_CPU_KERNELS=torch`` skips them; without a compiler pagedllm logs why and
uses torch.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pagedllm.cache_dir import pagedllm_cache_dir
from pagedllm.kernels import cpu_isa
from pagedllm.kernels.metadata import window_and_cap

logger = logging.getLogger("pagedllm")

KERNELS_ENV = "PAGEDLLM_CPU_KERNELS"
KERNELS_CHOICES = ("native", "torch")
SOURCE = Path(__file__).with_name("cpu") / "cpu_ops.c"
BUILD_FLAGS = ("-fopenmp", "-fPIC", "-shared", "-std=c11")  # on top of cpu_isa.c_compile_flags(isa)

_c_int64, _c_int, _c_float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p

# Chunks of at least this many query tokens take the attention kernel's tile path by default (BENCHMARKS.md §40).
TILE_MIN_QUERY_LEN = 32


class CpuKernels:
    """Typed wrappers over the built library; inputs are checked before any pointer is handed over."""

    def __init__(self, lib: ctypes.CDLL, path: Path, isa: str) -> None:
        self.path = path
        self.isa = isa
        self._attention = lib.paged_attention_f32
        self._attention.restype = _c_int
        self._attention.argtypes = [_ptr, _c_int64, _ptr, _c_int64, _ptr, _ptr, _ptr, _c_int64, _ptr, _ptr,
                                    _c_int, _c_int, _c_int, _c_int, _c_int, _c_float, _c_int, _c_int, _c_float, _c_float,
                                    _c_int, _c_float]
        self._attention_sinks = lib.paged_attention_sinks_f32  # the same, then the sinks pointer (NULL: none)
        self._attention_sinks.restype = _c_int
        self._attention_sinks.argtypes = self._attention.argtypes + [_ptr]
        self._cache = lib.reshape_and_cache_f32
        self._cache.restype = None
        self._cache.argtypes = [_ptr, _ptr, _c_int64, _ptr, _ptr, _ptr, _c_int64, _c_int64]
        self._cache_bf16 = lib.reshape_and_cache_bf16
        self._cache_bf16.restype = None
        self._cache_bf16.argtypes = self._cache.argtypes
        self._cache_fp8 = lib.reshape_and_cache_fp8
        self._cache_fp8.restype = None
        self._cache_fp8.argtypes = self._cache.argtypes + [_c_int, _c_float, _c_float]
        self._rms = lib.rms_norm_f32
        self._rms.restype = None
        self._rms.argtypes = [_ptr, _ptr, _ptr, _c_int64, _ptr, _c_int64, _ptr, _c_int64, _c_int64, _c_float, _c_int]
        self._rms_heads = lib.rms_norm_heads_f32
        self._rms_heads.restype = None
        self._rms_heads.argtypes = [_ptr, _c_int64, _c_int64, _ptr, _c_int64, _c_int64, _c_float, _c_int]
        self._rotary = lib.rotary_embedding_f32
        self._rotary.restype = None
        self._rotary.argtypes = [_ptr, _c_int64, _c_int, _ptr, _c_int64, _c_int, _ptr, _ptr, _ptr, _c_int64, _c_int,
                                 _c_int]
        self._silu = lib.silu_and_mul_f32
        self._silu.restype = None
        self._silu.argtypes = [_ptr, _ptr, _c_int64, _c_int64, _c_int64]
        self._gelu_tanh = lib.gelu_tanh_and_mul_f32
        self._gelu_tanh.restype = None
        self._gelu_tanh.argtypes = self._silu.argtypes
        self._bitmask = lib.apply_token_bitmask_f32
        self._bitmask.restype = None
        self._bitmask.argtypes = [_ptr, _c_int64, _ptr, _c_int64, _ptr, _c_int64, _c_int64]
        self._sample = lib.sample_rows_f32
        self._sample.restype = None
        self._sample.argtypes = [_ptr, _c_int64, _c_int64, _c_int64, _ptr, _ptr, _ptr, _ptr, _ptr]
        self._top_k_top_p = lib.top_k_top_p_f32
        self._top_k_top_p.restype = None
        self._top_k_top_p.argtypes = [_ptr, _c_int64, _c_int64, _c_int64, _ptr, _ptr, _ptr, _ptr]
        self._mamba_conv = lib.mamba_conv_decode_f32
        self._mamba_conv.restype = None
        self._mamba_conv.argtypes = [_ptr, _ptr, _ptr, _c_int64, _ptr, _ptr, _ptr, _c_int64, _c_int64, _c_int64,
                                     _c_int64]
        self._mamba_ssm = lib.mamba_ssm_decode_f32
        self._mamba_ssm.restype = None
        self._mamba_ssm.argtypes = [_ptr, _ptr, _ptr, _c_int64, _ptr, _c_int64, _ptr, _ptr, _ptr, _ptr, _c_int64,
                                    _c_int64, _c_int64, _c_int64, _c_int64, _c_int64]

        self._mamba1_scan = lib.mamba1_scan_f32
        self._mamba1_scan.restype = None
        self._mamba1_scan.argtypes = [_ptr, _ptr, _ptr, _ptr, _c_int64, _ptr, _c_int64, _ptr, _c_int64, _ptr, _ptr,
                                      _c_int64, _ptr, _c_int64, _ptr, _ptr, _c_int64, _c_int64, _c_int64]

    def c_functions(self) -> tuple:
        """(rms_norm, rotary, reshape_and_cache, paged_attention, silu_and_mul): the typed C entry points
        without this class's checks, for callers that checked their inputs once (model/cpu_direct_forward.py).
        rotary takes the rotary dim (head_dim for whole heads) after head_dim, last. rms_norm takes the eps, then
        ``unit_offset`` (1: Gemma's (1 + w) scale, 0: w) last. The cache write is the float32 pool's; ``cache_writer``
        gives the one for a pool's dtype, and paged_attention takes the pool's ``kv_format`` code, min_tile_query_len,
        k_scale, v_scale, then the window and soft cap as ``metadata.window_and_cap`` gives them, last."""
        return self._rms, self._rotary, self._cache, self._attention, self._silu

    def heads_norm_function(self):
        """The C per-head RMSNorm (Qwen3's and Gemma 3's q/k norms) without checks, in place: (x, row stride, heads,
        weight, num_tokens, head_dim, eps, unit_offset)."""
        return self._rms_heads

    def gelu_tanh_function(self):
        """The C GeGLU gate (gelu_tanh(gate)·up) without checks, called as silu_and_mul's: (out, x, x_stride,
        num_tokens, inter)."""
        return self._gelu_tanh

    def fp8_cache_function(self):
        """The fp8 pool's C cache write without checks: the float32 pool's arguments, then e5m2 (0: e4m3fn),
        k_scale, v_scale."""
        return self._cache_fp8

    def cache_writer(self, cache_dtype: torch.dtype, k_scale: float = 1.0, v_scale: float = 1.0):
        """The C cache write for a pool of `cache_dtype`, called as the float32 pool's is: (key, value,
        src_stride, key_cache, value_cache, slot_mapping, num_tokens, row). An fp8 pool's divides keys by
        `k_scale` and values by `v_scale` (plain pools ignore them)."""
        fmt = kv_format(cache_dtype)
        if fmt == KV_FORMATS[torch.bfloat16]:
            return self._cache_bf16
        if fmt == KV_FORMATS[torch.float32]:
            return self._cache
        e5m2, cache_fp8 = int(cache_dtype == torch.float8_e5m2), self._cache_fp8
        return lambda *args: cache_fp8(*args, e5m2, k_scale, v_scale)

    def paged_attention(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        scale: float,
        indices_checked: bool = False,
        min_tile_query_len: int = TILE_MIN_QUERY_LEN,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Attention for a flat batch whose K/V are already in the cache. out/query [T, Hq, D]; caches
        [num_blocks, block_size, Hk, D]; block_tables [S, ≥ blocks] int32; seq_lens [S] int32 (context
        after this step); query_start_loc [S + 1] int32 (sequence s owns query rows qsl[s]:qsl[s+1], the
        last at position seq_lens[s] - 1; decodes have one row). Causal within each chunk; writes `out`.
        `indices_checked`: these index tensors already passed `check_attention_indices` (the engine
        checks a step's once, not once per layer). A sequence whose chunk has `min_tile_query_len` or more
        query tokens takes the kernel's tile path (small GEMMs); shorter ones take the token path, whose
        arithmetic per token is a lone decode's (speculative verification relies on it). An fp8 pool's
        keys read as fp8 · `k_scale` and its values as fp8 · `v_scale`. `sliding_window` W: the token at position p
        attends to keys p - W < j <= p only (the blocks before a tile's window are not read); `logits_soft_cap` c:
        each scaled score s becomes c·tanh(s / c) before the softmax; None turns either off. `sinks` (GPT-OSS's
        attention sinks): float32 [Hq], query head h's softmax denominator gains exp(sinks[h]); None: off."""
        window, soft_cap = window_and_cap(sliding_window, logits_soft_cap)
        num_tokens, num_q_heads, head_dim = query.shape
        num_blocks, block_size, num_kv_heads, cache_dim = key_cache.shape
        num_seqs = query_start_loc.numel() - 1
        _check_rows(query, "query")
        _check_rows(out, "out")
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            _check_cache(t, name, key_cache.dtype)
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        if cache_dim != head_dim or num_q_heads % num_kv_heads or out.shape != query.shape:
            raise ValueError(f"shapes do not agree: query {tuple(query.shape)}, out {tuple(out.shape)}, "
                             f"cache {tuple(key_cache.shape)}")
        if sinks is not None:
            _check_sinks(sinks, num_q_heads)
        if not indices_checked:
            self.check_attention_indices(block_tables, seq_lens, query_start_loc, num_tokens, num_blocks, block_size)
        rc = self._attention_sinks(
            out.data_ptr(), out.stride(0), query.data_ptr(), query.stride(0),
            key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
            seq_lens.data_ptr(), query_start_loc.data_ptr(), num_seqs, num_q_heads, num_kv_heads, head_dim,
            block_size, scale, kv_format(key_cache.dtype), min_tile_query_len, k_scale, v_scale, window, soft_cap,
            None if sinks is None else sinks.data_ptr(),
        )
        if rc != 0:
            raise MemoryError("paged_attention_f32 could not allocate its scratch rows")

    @staticmethod
    def check_attention_indices(
        block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_tokens: int,
        num_blocks: int, block_size: int,
    ) -> None:
        """The C side follows these indices without bounds checks: refuse any that leave the pool."""
        for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
            if t.dtype != torch.int32 or t.stride(-1) != 1:
                raise ValueError(f"{name} must be int32 with contiguous rows, got {t.dtype}")
        num_seqs = query_start_loc.numel() - 1
        if num_seqs < 0 or block_tables.shape[0] < num_seqs or seq_lens.shape[0] < num_seqs:
            raise ValueError("block_tables and seq_lens need a row for every sequence of query_start_loc")
        if num_seqs == 0:
            return
        qsl = query_start_loc
        qlens, lens = qsl[1:] - qsl[:-1], seq_lens[:num_seqs]
        if int(qsl[0]) != 0 or int(qsl[-1]) != num_tokens or int(qlens.min()) < 0:
            raise ValueError(f"query_start_loc must rise from 0 to the {num_tokens} query rows")
        if int(lens.max()) > block_tables.shape[1] * block_size or bool((lens < qlens).any()) or int(lens.min()) < 1:
            raise ValueError(f"seq_lens must be in [1, {block_tables.shape[1] * block_size}] for these block "
                             "tables and at least each sequence's query length")
        tables = block_tables[:num_seqs]
        if int(tables.min()) < 0 or int(tables.max()) >= num_blocks:
            raise ValueError(f"block_tables hold ids outside the pool of {num_blocks} blocks")

    def reshape_and_cache(
        self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
    ) -> None:
        """key/value [T, Hk, D] (token rows may be strided) → their slots; slots < 0 are skipped. An fp8
        pool stores key / `k_scale` and value / `v_scale` (kernels/kv_quant.py's quantize)."""
        _check_rows(key, "key")
        _check_rows(value, "value")
        if key.stride(0) != value.stride(0):
            key, value = key.contiguous(), value.contiguous()
        for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
            _check_cache(t, name, key_cache.dtype)
            if not t.is_contiguous() or t.shape[2:] != key.shape[1:]:
                raise ValueError(f"{name} {tuple(t.shape)} does not hold rows of {tuple(key.shape[1:])}")
        if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous() or slot_mapping.numel() != key.shape[0]:
            raise ValueError("slot_mapping must be a contiguous int64 tensor with one slot per token")
        if key.shape[0] and int(slot_mapping.max()) >= key_cache.shape[0] * key_cache.shape[1]:
            raise ValueError(f"slot_mapping holds slots beyond the pool's {key_cache.shape[0] * key_cache.shape[1]}")
        row = key.shape[1] * key.shape[2]
        write = self.cache_writer(key_cache.dtype, k_scale, v_scale)
        write(key.data_ptr(), value.data_ptr(), key.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
              slot_mapping.data_ptr(), key.shape[0], row)

    # The fused ops, with kernels/triton_fused_ops.py's signatures and contracts.

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * (x * rsqrt(mean(x²) + eps))`` per row of x [T, N]; a new tensor."""
        return self._rms_norm(x, None, weight, eps, 0)[0]

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """s = x + residual; returns (rms_norm(s), s), both new tensors (the inputs are not written)."""
        return self._rms_norm(x, residual, weight, eps, 0)

    def gemma_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Gemma's RMSNorm: ``(1 + weight) * (x * rsqrt(mean(x²) + eps))`` per row of x [T, N], 1 + weight rounded
        to float32 first (as ``weight + 1.0``); a new tensor."""
        return self._rms_norm(x, None, weight, eps, 1)[0]

    def fused_add_gemma_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """s = x + residual; returns (gemma_rms_norm(s), s), both new tensors (the inputs are not written)."""
        return self._rms_norm(x, residual, weight, eps, 1)

    def _rms_norm(self, x, residual, weight, eps, unit_offset):
        _check_matrix(x, "x")
        t, n = x.shape
        _check_f32_cpu(weight, "weight")
        if not weight.is_contiguous() or weight.shape != (n,):
            raise ValueError(f"weight must be a contiguous [{n}] tensor, got {tuple(weight.shape)}")
        out = torch.empty((t, n), dtype=x.dtype)
        new_residual = None
        if residual is not None:
            _check_matrix(residual, "residual")
            if residual.shape != x.shape:
                raise ValueError(f"residual {tuple(residual.shape)} does not match x {tuple(x.shape)}")
            new_residual = torch.empty((t, n), dtype=x.dtype)
        self._rms(out.data_ptr(), 0 if residual is None else new_residual.data_ptr(), x.data_ptr(), x.stride(0),
                  0 if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
                  weight.data_ptr(), t, n, eps, unit_offset)
        return out, new_residual

    def rotary_embedding(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
        sin_cache: torch.Tensor, head_dim: int, rotary_dim: int | None = None,
    ) -> None:
        """Rotate-half RoPE in place on q [T, Hq·D] and k [T, Hk·D] (rows may be strided) at `positions`, on the
        first `rotary_dim` (default: head_dim; even) dims of each head with caches [max_position, rotary_dim]; the
        rest of each head is not touched (partial rotary, Phi-4-mini)."""
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        _check_matrix(q, "q")
        _check_matrix(k, "k")
        t = q.shape[0]
        if k.shape[0] != t or q.shape[1] % head_dim or k.shape[1] % head_dim or head_dim % 2:
            raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} are not rows of heads of {head_dim}")
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, head_dim = {head_dim}], got {rotary_dim}")
        if positions.dtype != torch.int64 or not positions.is_contiguous() or positions.numel() != t:
            raise ValueError("positions must be a contiguous int64 tensor with one position per token")
        for name, c in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
            _check_f32_cpu(c, name)
            if not c.is_contiguous() or c.dim() != 2 or c.shape[1] != rotary_dim:
                raise ValueError(f"{name} must be a contiguous [max_position, {rotary_dim}] tensor, got "
                                 f"{tuple(c.shape)}")
        rows = min(cos_cache.shape[0], sin_cache.shape[0])
        if t and (int(positions.max()) >= rows or int(positions.min()) < 0):
            raise ValueError(f"a position is beyond the rotary cache ({rows} positions)")
        self._rotary(q.data_ptr(), q.stride(0), q.shape[1] // head_dim, k.data_ptr(), k.stride(0),
                     k.shape[1] // head_dim, positions.data_ptr(), cos_cache.data_ptr(), sin_cache.data_ptr(),
                     t, head_dim, rotary_dim)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] = [gate | up] → silu(gate) * up [T, I]; a new tensor."""
        return self._gated(self._silu, x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] = [gate | up] → gelu(gate, approximate="tanh") * up [T, I] (GeGLU); a new tensor. Within a few
        float32 ulps of the exact function (cpu_ops.c says how), not bit-equal to torch's gelu."""
        return self._gated(self._gelu_tanh, x)

    @staticmethod
    def _gated(fn, x: torch.Tensor) -> torch.Tensor:
        _check_matrix(x, "x")
        t, two_i = x.shape
        if two_i % 2:
            raise ValueError(f"x must have an even number of columns ([gate | up]), got {two_i}")
        out = torch.empty((t, two_i // 2), dtype=x.dtype)
        fn(out.data_ptr(), x.data_ptr(), x.stride(0), t, two_i // 2)
        return out

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Structured outputs, in place: ``logits[r, t] = -inf`` for each r in ``rows`` wherever bit ``t % 32`` of
        word ``t // 32`` of ``bitmask[r]`` (packed int32, a row per logits row at least) is 0."""
        _check_matrix(logits, "logits")
        num, vocab = logits.shape
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2 or bitmask.stride(1) != 1:
            raise ValueError(f"bitmask must be a [rows, words] int32 CPU tensor with contiguous rows, got "
                             f"{bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")
        if bitmask.shape[0] < num or bitmask.shape[1] * 32 < vocab:
            raise ValueError(f"bitmask {tuple(bitmask.shape)} is too small for logits {tuple(logits.shape)}")
        if any(r < 0 or r >= num for r in rows):
            raise ValueError(f"rows must be in [0, {num}), got {rows}")
        ids = torch.tensor(rows, dtype=torch.int64)
        self._bitmask(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0), ids.data_ptr(),
                      len(rows), vocab)

    def mamba_decode(self, xbc: torch.Tensor, dt: torch.Tensor, conv_weight: torch.Tensor,
                     conv_bias: torch.Tensor | None, dt_bias: torch.Tensor, a_log: torch.Tensor, d: torch.Tensor,
                     conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor,
                     n_groups: int) -> torch.Tensor:
        """A Mamba-2 layer's decode step for every row (kernels/triton_mamba.py's two kernels, on the CPU): the conv
        state [slots, conv_dim, width] and the SSM state [slots, heads, head_dim, d_state] updated in place at `slots`
        (int64 [B]); xbc [B, conv_dim] and dt [B, heads] are this token's rows (row strides free) → y [B, heads ·
        head_dim] (the D skip in, before the gated norm). Everything float32."""
        batch, channels = xbc.shape
        width = conv_state.shape[2]
        _, heads, head_dim, d_state = ssm_state.shape
        params = (conv_weight, dt_bias, a_log, d) + ((conv_bias,) if conv_bias is not None else ())
        tensors = (xbc, dt, conv_state, ssm_state) + params
        if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
            raise ValueError("mamba_decode takes float32 CPU tensors")
        if not (conv_state.is_contiguous() and ssm_state.is_contiguous() and conv_weight.is_contiguous()
                and all(t.is_contiguous() for t in params) and xbc.stride(1) == 1 and dt.stride(1) == 1):
            raise ValueError("mamba_decode needs contiguous states and parameters and unit-stride rows")
        if (conv_state.shape[1] != channels or conv_weight.numel() != channels * (width + 1) or dt.shape != (batch, heads)
                or channels != heads * head_dim + 2 * n_groups * d_state or heads % n_groups):
            raise ValueError(f"mamba_decode: inconsistent shapes xbc {tuple(xbc.shape)}, dt {tuple(dt.shape)}, conv "
                             f"state {tuple(conv_state.shape)}, ssm state {tuple(ssm_state.shape)}, {n_groups} groups")
        slots = slots.to(torch.int64).contiguous()
        if slots.numel() != batch or (batch and (int(slots.min()) < 0 or int(slots.max()) >= ssm_state.shape[0]
                                                 or ssm_state.shape[0] != conv_state.shape[0])):
            raise ValueError(f"slots must be {batch} indices below {ssm_state.shape[0]}")
        conv = torch.empty(batch, channels, dtype=torch.float32)
        y = torch.empty(batch, heads * head_dim, dtype=torch.float32)
        if batch == 0:
            return y
        self._mamba_conv(conv_state.data_ptr(), slots.data_ptr(), xbc.data_ptr(), xbc.stride(0),
                         conv_weight.data_ptr(), conv_bias.data_ptr() if conv_bias is not None else None,
                         conv.data_ptr(), conv.stride(0), batch, channels, width)
        self._mamba_ssm(ssm_state.data_ptr(), slots.data_ptr(), conv.data_ptr(), conv.stride(0), dt.data_ptr(),
                        dt.stride(0), dt_bias.data_ptr(), a_log.data_ptr(), d.data_ptr(), y.data_ptr(), y.stride(0),
                        batch, heads, head_dim, d_state, n_groups)
        return y

    def mamba1_scan(self, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                    ssm_state: torch.Tensor, slots: list[int], lens: list[int],
                    snapshots: list[tuple[int, int, int]] = ()) -> torch.Tensor:
        """Mamba-1's selective scan (model/layers/mamba1.py's selective_scan_torch, same arguments) in one call: x /
        dt [T, D] (dt after softplus), a [D, N] (negative), b / c [T, N], ssm_state [slots, D, 1, N] float32,
        read and left at each sequence's last token in place; `snapshots` (sequence, offset, slot) → y = h·C [T, D]."""
        tokens, channels = x.shape
        d_state = a.shape[1]
        for name, t in (("x", x), ("dt", dt), ("a", a), ("b", b), ("c", c), ("ssm_state", ssm_state)):
            if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
                raise ValueError(f"mamba1_scan takes float32 CPU tensors with unit-stride rows ({name})")
        if (dt.shape != x.shape or a.shape != (channels, d_state) or b.shape != (tokens, d_state)
                or c.shape != (tokens, d_state) or ssm_state.shape[1:] != (channels, 1, d_state)
                or not ssm_state.is_contiguous() or not a.is_contiguous() or sum(lens) != tokens or d_state > 256):
            raise ValueError(f"mamba1_scan: inconsistent shapes x {tuple(x.shape)}, dt {tuple(dt.shape)}, a "
                             f"{tuple(a.shape)}, b {tuple(b.shape)}, c {tuple(c.shape)}, state {tuple(ssm_state.shape)} "
                             f"(contiguous, d_state <= 256), lens summing to {sum(lens)}")
        if any(not 0 <= s < ssm_state.shape[0] for s in slots) or len(slots) != len(lens):
            raise ValueError(f"slots must be {len(lens)} indices below {ssm_state.shape[0]}")
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        snap = None
        if snapshots:
            at = [-1] * tokens
            for seq, offset, slot in snapshots:
                at[starts[seq] + offset - 1] = slot
            snap = torch.tensor(at, dtype=torch.int64)
        y = torch.empty(tokens, channels, dtype=torch.float32)
        index = [torch.tensor(v, dtype=torch.int64) for v in (slots, starts, lens)]
        self._mamba1_scan(ssm_state.data_ptr(), index[0].data_ptr(), index[1].data_ptr(), index[2].data_ptr(),
                          len(lens), x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), a.data_ptr(),
                          b.data_ptr(), b.stride(0), c.data_ptr(), c.stride(0),
                          snap.data_ptr() if snap is not None else None, y.data_ptr(), y.stride(0), channels, d_state)
        return y

    def top_k_top_p(self, logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """A new float32 tensor: ``logits`` [rows, vocab] with -inf outside each row's top-k (``top_k[r]`` <= 0 or
        >= vocab: off; ties at the k-th value kept) and then outside the top-p nucleus of what top-k kept (``top_p[r]``
        >= 1: off; at least one token; ties at the last kept value kept), as logits_ops.apply_top_k_top_p's sort
        does, without sorting the vocabulary."""
        _check_matrix(logits, "logits")
        rows, vocab = logits.shape
        if len(top_k) != rows or len(top_p) != rows:
            raise ValueError(f"top_k and top_p need one value per row ({rows}), got {len(top_k)} and {len(top_p)}")
        if any(not 0.0 < q for q in top_p):
            raise ValueError(f"top_p values must be > 0, got {top_p}")
        ks = torch.tensor(top_k, dtype=torch.int64)
        ps = torch.tensor(top_p, dtype=torch.float32)
        out = torch.empty((rows, vocab), dtype=torch.float32)
        if rows:
            ws = torch.empty((rows, 2 * vocab), dtype=torch.float32)
            self._top_k_top_p(logits.data_ptr(), logits.stride(0), rows, vocab, ks.data_ptr(), ps.data_ptr(),
                              out.data_ptr(), ws.data_ptr())
        return out

    def sample_rows(self, logits: torch.Tensor, inv_temp: torch.Tensor,
                    u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row of the raw ``logits`` [rows, vocab] (float32, not modified) → (int64 tokens,
        float32 raw log-probabilities of them). ``u`` (float64 [rows]): < 0 takes the row's argmax (its first
        index), a uniform in [0, 1) samples from ``softmax(logits * inv_temp)`` by inverse CDF (float32
        ``inv_temp`` [rows])."""
        _check_matrix(logits, "logits")
        rows, vocab = logits.shape
        for t, name, dtype in ((inv_temp, "inv_temp", torch.float32), (u, "u", torch.float64)):
            if t.dtype != dtype or t.device.type != "cpu" or t.shape != (rows,) or not t.is_contiguous():
                raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor of shape ({rows},), got "
                                 f"{t.dtype} {tuple(t.shape)} on {t.device}")
        if vocab < 1 or vocab > 2**31 - 1:
            raise ValueError(f"vocab must be in [1, 2**31), got {vocab}")
        tokens = torch.empty(rows, dtype=torch.int64)
        logprobs = torch.empty(rows, dtype=torch.float32)
        ws = torch.empty((rows, -(-vocab // SAMPLE_BLOCK)), dtype=torch.float64)
        self._sample(logits.data_ptr(), logits.stride(0), rows, vocab, inv_temp.data_ptr(), u.data_ptr(),
                     tokens.data_ptr(), logprobs.data_ptr(), ws.data_ptr())
        return tokens, logprobs


#: Tokens per block of the native sampler's two-level inverse CDF (SAMPLE_BLOCK in cpu_ops.c).
SAMPLE_BLOCK = 256


def _check_matrix(t: torch.Tensor, name: str) -> None:
    """[rows, cols] float32 on the CPU with contiguous rows (the row stride is free)."""
    _check_f32_cpu(t, name)
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be a [rows, cols] tensor with contiguous rows, got shape "
                         f"{tuple(t.shape)} strides {t.stride()}")


def _check_f32_cpu(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")


def _check_sinks(sinks: torch.Tensor, num_q_heads: int) -> None:
    """One float32 logit per query head, contiguous on the CPU (the C side reads sinks[h] by pointer)."""
    _check_f32_cpu(sinks, "sinks")
    if sinks.shape != (num_q_heads,) or not sinks.is_contiguous():
        raise ValueError(f"sinks must be a contiguous [num_q_heads = {num_q_heads}] tensor, got shape "
                         f"{tuple(sinks.shape)} strides {sinks.stride()}")


#: Pool dtypes the native kernels read and write (--kv-cache-dtype auto on a float32 model, bfloat16, or fp8)
#: and the C side's code for each (cpu_ops.c's KV_F32 ... KV_FP8_E5M2).
KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3}
CACHE_DTYPES = tuple(KV_FORMATS)


def kv_format(dtype: torch.dtype) -> int:
    """The C kernels' code for a pool of `dtype`; a ValueError for a dtype they do not take."""
    _check_cache_dtype(dtype)
    return KV_FORMATS[dtype]


def _check_cache_dtype(dtype: torch.dtype) -> None:
    if dtype not in KV_FORMATS:
        raise ValueError(f"the native CPU kernels take float32, bfloat16, float8_e4m3fn or float8_e5m2 KV pools, "
                         f"got {dtype}")


def _check_cache(t: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    """A KV pool of `dtype` (one of CACHE_DTYPES; key and value pools alike) on the CPU."""
    _check_cache_dtype(t.dtype)
    if t.dtype != dtype or t.device.type != "cpu":
        raise ValueError(f"{name} must be a {dtype} CPU tensor like key_cache, got {t.dtype} on {t.device}")


def _check_rows(t: torch.Tensor, name: str) -> None:
    """[N, H, D] float32 with each token's H·D values contiguous (the token stride is free)."""
    _check_f32_cpu(t, name)
    if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        raise ValueError(f"{name} must be [tokens, heads, head_dim] with contiguous heads, got "
                         f"shape {tuple(t.shape)} strides {t.stride()}")


def kernels_choice() -> str:
    choice = os.environ.get(KERNELS_ENV, "native").strip().lower()
    if choice not in KERNELS_CHOICES:
        raise ValueError(f"{KERNELS_ENV}={choice!r} is not one of {KERNELS_CHOICES}")
    return choice


@functools.cache
def load_cpu_kernels(isa: str | None = None) -> CpuKernels | None:
    """The kernels built for `isa` (default: `cpu_isa.detect_cpu_isa()`, which honours PAGEDLLM_CPU_ISA),
    or None (turned off, or no compiler: the reason is logged once). Cached per argument: after changing
    PAGEDLLM_CPU_KERNELS / PAGEDLLM_CPU_ISA in-process call `load_cpu_kernels.cache_clear()`. ValueError
    for a level this CPU cannot run."""
    if kernels_choice() == "torch":
        return None
    detected = cpu_isa.detect_cpu_isa()
    if isa is None:
        isa = detected.name
    elif isa not in cpu_isa.ISA_LEVELS or cpu_isa.ISA_LEVELS.index(isa) > cpu_isa.ISA_LEVELS.index(detected.detected):
        allowed = cpu_isa.ISA_LEVELS[: cpu_isa.ISA_LEVELS.index(detected.detected) + 1]
        raise ValueError(f"cannot build CPU kernels for {isa!r} on this CPU: it runs {allowed}")
    try:
        path = build_library(SOURCE, isa)
        return CpuKernels(ctypes.CDLL(str(path)), path, isa)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("CPU kernels unavailable (%s); attention runs the plain-torch path", e)
        return None


def compile_command(cc: str, source: Path, isa: str, output: str, extra_flags: tuple[str, ...] = ()) -> list[str]:
    """The compiler command line for `source` at ISA level `isa` (plus `extra_flags`, e.g. a VNNI
    extension); libmvec is linked only where the vector code calls it (AVX2 and above on x86-64)."""
    libs = ["-lmvec", "-lm"] if cpu_isa.uses_libmvec(isa) else ["-lm"]
    return [cc, *cpu_isa.c_compile_flags(isa), *extra_flags, *BUILD_FLAGS, str(source), "-o", output, *libs]


def build_library(source: Path, isa: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile `source` for `isa` (plus `extra_flags`) into the cache unless an identical build is there; returns the .so path."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler found (set CC, or install gcc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256()
    for part in (source.read_bytes(), version.encode(),
                 " ".join(compile_command(cc, source, isa, "", extra_flags)).encode()):
        key.update(part)
    out_dir = pagedllm_cache_dir("kernels")
    target = out_dir / f"{source.stem}-{isa}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run(compile_command(cc, source, isa, tmp, extra_flags), capture_output=True, text=True, timeout=300,
                              check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source.name} for {isa}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders each land a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("Built CPU kernels for %s: %s", isa, target)
    return target
