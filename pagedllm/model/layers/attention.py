"""The attention layer: writes this step's K/V into the paged cache, then attends through it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from pagedllm.kernels import kv_quant, reference
from pagedllm.kernels.metadata import AttentionMetadata, window_and_cap

if TYPE_CHECKING:
    from pagedllm.kernels.triton_attention import DecodeWorkspace

NO_TILE_PATH = 1 << 30  # a min_tile_query_len no chunk reaches (the kernel takes a C int)


class AttentionBackend(Protocol):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        latent_dim: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`sliding_window` W: a query at position p attends to keys p - W < j <= p only (None: all earlier keys).
        `logits_soft_cap` c: each score s = q·k·scale becomes c·tanh(s / c) before the softmax (None: off).
        `sinks` [Hq] float32 (GPT-OSS): head h's softmax denominator gains exp(sinks[h]), a logit that weighs no
        value (None: off).
        `latent_dim` (MLA; passed only to backends whose ``takes_latent_dim`` is True): the cache is one latent pool
        [c_kv ; k_pe] passed as keys and values, of which only the output's first `latent_dim` values per head are
        used; a backend may use a specialised kernel for it and leave the rest of each head's output unwritten."""
        ...


class TorchAttentionBackend:
    """Plain-torch paged attention (kernels/reference.py): the CPU path."""

    name = "torch"
    takes_latent_dim = True  # and ignores it

    def forward(self, query, key, value, kv_cache, meta, scale, sliding_window=None, logits_soft_cap=None,
                latent_dim=None, sinks=None):
        key_cache, value_cache = kv_cache
        reference.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
        return reference.paged_attention(query, key, value, key_cache, value_cache, meta, scale,
                                         sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks)


class KVScales:
    """Per-layer FP8 KV scales for a backend: `layer_scales` maps a layer's key cache (its ``data_ptr()``) to
    that layer's calibrated (k_scale, v_scale); a cache not in it (or no mapping) uses (k_scale, v_scale).
    Keyed by the cache, the scales follow every path that attends through it (eager steps, graph replays,
    self-speculation sharing the target's caches). Plain pools ignore them."""

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0,
                 layer_scales: dict[int, tuple[float, float]] | None = None) -> None:
        self.k_scale, self.v_scale = k_scale, v_scale
        self.layer_scales = dict(layer_scales or {})

    def scales_for(self, key_cache: torch.Tensor) -> tuple[float, float]:
        """(k_scale, v_scale) of the layer owning `key_cache`."""
        if not self.layer_scales:
            return self.k_scale, self.v_scale
        return self.layer_scales.get(key_cache.data_ptr(), (self.k_scale, self.v_scale))


class NativeCpuAttentionBackend(KVScales):
    """The CPU path with native kernels (kernels/cpu_kernels.py): decodes and prompt chunks read K/V
    straight through their block tables, the whole step in one call per layer. A chunk longer than
    `max_native_query_len` goes to the torch reference instead: torch's SDPA, blocked like a GEMM, is
    faster on long fresh prompts (BENCHMARKS.md §1). The choice is per chunk, by its own length (the engine
    orders a step's chunks shortest first, so the native ones are a leading run): a token's attention
    does not depend on what else shares its step. An FP8 pool (--kv-cache-dtype fp8 / fp8_e5m2 on the CPU)
    sends every chunk to the kernel, which reads fp8 · scale (KVScales) as it reads bf16."""

    name = "cpu-native"
    takes_latent_dim = True  # and ignores it
    max_native_query_len = 512
    #: Model dtypes served: a bfloat16 model's q/k/v are widened to float32 (exactly) for the kernels, which
    #: read its bf16 pool as they read a float32 model's bf16 pool; the output is rounded back to bf16.
    model_dtypes = (torch.float32, torch.bfloat16)

    def __init__(self, kernels, min_tile_query_len: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                 layer_scales: dict[int, tuple[float, float]] | None = None, fp8_pool: bool = False,
                 batch_invariant: bool = False) -> None:
        """`min_tile_query_len`: chunks this long or longer take the kernel's tile path (default
        `cpu_kernels.TILE_MIN_QUERY_LEN`); speculative decoding raises it above its verification length.
        `fp8_pool`: the KV pool is FP8, so no chunk goes to torch's SDPA (it would read the pool unscaled).
        `batch_invariant` (pagedllm/batch_invariance.py): every chunk on the kernel's token path, so a token's
        bits do not depend on its chunk's length either."""
        from pagedllm.kernels.cpu_kernels import TILE_MIN_QUERY_LEN

        super().__init__(k_scale, v_scale, layer_scales)
        self.kernels = kernels
        self.min_tile_query_len = NO_TILE_PATH if batch_invariant else min_tile_query_len or TILE_MIN_QUERY_LEN
        if fp8_pool or batch_invariant:
            self.max_native_query_len = 1 << 62  # every chunk, whatever its length
        self.batch_invariant = batch_invariant
        self.fp8_pool = fp8_pool
        self._checked_meta: AttentionMetadata | None = None  # the step whose indices passed the check

    def forward(self, query, key, value, kv_cache, meta, scale, sliding_window=None, logits_soft_cap=None,
                latent_dim=None, sinks=None):
        key_cache, value_cache = kv_cache
        k_scale, v_scale = self.scales_for(key_cache)
        widen = query.dtype != torch.float32  # a bfloat16 model (model_dtypes)
        self.kernels.reshape_and_cache(key.float() if widen else key, value.float() if widen else value,
                                       key_cache, value_cache, meta.slot_mapping, k_scale, v_scale)
        out = torch.empty_like(query)
        # A bf16 model's prompt chunks keep torch's SDPA in bf16 (as fast as the kernel's float32 tile path there,
        # BENCHMARKS.md §52.9, and without widening whole chunks); its decodes and verifications take the kernel.
        limit = self.min_tile_query_len - 1 if widen and not self.fp8_pool else self.max_native_query_len
        if sliding_window is not None or logits_soft_cap is not None or sinks is not None:
            # torch's SDPA takes none of them: its fallback masks whole gathered contexts (a window) or builds the scores
            # in float32 (a cap), 4.8-12x slower than the kernel on a 2 048-token prompt (BENCHMARKS.md §68.2)
            limit = 1 << 62
        if meta.max_query_len <= limit:
            num_native, rows = meta.num_seqs, query.shape[0]
        else:  # the leading chunks up to the first long one
            lens = meta.query_lens_cpu
            num_native = next((i for i, n in enumerate(lens) if n > limit), len(lens))
            rows = sum(lens[:num_native])
        if num_native:
            native_out = torch.empty(rows, *query.shape[1:]) if widen else out[:rows]
            self.kernels.paged_attention(native_out, query[:rows].float() if widen else query[:rows], key_cache,
                                         value_cache, meta.block_tables[:num_native], meta.seq_lens[:num_native],
                                         meta.query_start_loc[: num_native + 1], scale,
                                         indices_checked=meta is self._checked_meta,
                                         min_tile_query_len=self.min_tile_query_len, k_scale=k_scale,
                                         v_scale=v_scale, sliding_window=sliding_window,
                                         logits_soft_cap=logits_soft_cap, sinks=sinks)
            self._checked_meta = meta  # every layer of a step shares its metadata: checked once
            if widen:
                out[:rows] = native_out
        if num_native < meta.num_seqs:
            if key_cache.dtype != key.dtype:  # a bf16 pool: attend to the K/V as stored, as the native kernel does
                key, value = key.to(key_cache.dtype).to(key.dtype), value.to(value_cache.dtype).to(value.dtype)
            reference.prefill_attention(query, key, value, key_cache, value_cache, meta, scale, out,
                                        first_seq=num_native, sliding_window=sliding_window,
                                        logits_soft_cap=logits_soft_cap, sinks=sinks)
        return out


class TritonAttentionBackend(KVScales):
    """Triton kernels (kernels/triton_*.py): the CUDA path. Same contract as TorchAttentionBackend.

    Owns one split-KV decode workspace per device, shared by every layer and every captured CUDA graph;
    it grows when a call needs more (the capture warm-up sizes it before each capture).

    FP8 pools store x / scale, with the scales of KVScales. `fp8_dot_dtype`: the FP8 kernels' dot dtype
    (None: the kernels' default, ``triton_attention.resolve_fp8_dot``). Plain pools ignore the three."""

    name = "triton"
    takes_latent_dim = True

    def __init__(self, k_scale: float = 1.0, v_scale: float = 1.0,
                 layer_scales: dict[int, tuple[float, float]] | None = None,
                 fp8_dot_dtype: str | None = None, batch_invariant: bool = False) -> None:
        """`batch_invariant` (pagedllm/batch_invariance.py): every step through the unified kernel, whose key
        loop and tiles are a token's own whatever the step holds (the decode kernel splits a context by the
        step's sequence count)."""
        super().__init__(k_scale, v_scale, layer_scales)
        self.workspaces: dict[torch.device, DecodeWorkspace] = {}
        self.fp8_dot_dtype = fp8_dot_dtype
        self.batch_invariant = batch_invariant

    def forward(self, query, key, value, kv_cache, meta, scale, out=None, sliding_window=None, logits_soft_cap=None,
                latent_dim=None, sinks=None):
        """`out`: write the result there (the piecewise graphs' static buffer) instead of a new tensor.
        `latent_dim` (MLA): decodes take the MLA decode kernel (``triton_mla_decode``); the unified path ignores it."""
        from pagedllm.kernels import triton_attention, triton_cache_ops  # needs triton: imported on use

        key_cache, value_cache = kv_cache
        k_scale, v_scale = self.scales_for(key_cache)
        triton_cache_ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping, k_scale, v_scale)
        workspace = self.workspaces.get(query.device)
        if workspace is None:
            workspace = self.workspaces[query.device] = triton_attention.DecodeWorkspace.allocate(query.device)
        fp8_dot = self.fp8_dot_dtype if kv_quant.is_fp8(key_cache.dtype) else None
        if meta.unified or self.batch_invariant:
            from pagedllm.kernels.triton_unified_attention import unified_attention

            return unified_attention(query, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, scale, torch.empty_like(query) if out is None else out,
                                     k_scale, v_scale, fp8_dot, sliding_window=sliding_window,
                                     logits_soft_cap=logits_soft_cap, sinks=sinks)
        return triton_attention.paged_attention(query, key_cache, value_cache, meta, scale, out=out, workspace=workspace,
                                                k_scale=k_scale, v_scale=v_scale, fp8_dot_dtype=fp8_dot,
                                                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                                latent_dim=latent_dim, sinks=sinks)


class Attention(nn.Module):
    """Multi-head / grouped-query attention over this rank's heads, reading a paged KV cache.

    `sliding_window` (Mistral, Gemma 2/3's local layers, Phi-3): each query sees only its last W keys, itself
    included; `logits_soft_cap` (Gemma 2): scores pass through c·tanh(s / c). Both are per layer and
    handed to the backend with every call (AttentionBackend.forward). `latent_dim` (MLA, DeepSeek-V2/V3): the
    cache rows are [c_kv (latent_dim) ; k_pe], one KV head, and the caller reads only each head's first
    `latent_dim` output values; handed to backends that take it (``takes_latent_dim``: the CPU ones ignore it, the
    piecewise-graph recorder hands it on at replay), others run the generic kernels, which compute the whole row."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float | None = None,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 latent_dim: int | None = None, sinks: bool = False) -> None:
        super().__init__()
        window_and_cap(sliding_window, logits_soft_cap)  # a clear error at construction, not at the first step
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale if scale is not None else head_dim**-0.5
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        if latent_dim is not None and (num_kv_heads != 1 or not 0 < latent_dim < head_dim):
            raise ValueError(f"latent_dim {latent_dim} needs one KV head (got {num_kv_heads}) and must lie in "
                             f"(0, head_dim {head_dim}).")
        self.latent_dim = latent_dim
        # GPT-OSS's attention sinks: one learned logit per query head of this rank, in every softmax's denominator
        self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if sinks else None
        # The KV cache group this layer's blocks are in (core/kv_cache_groups.py), set by the worker; 0 with one.
        self.kv_cache_group = 0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, Hq·D], k/v [T, Hk·D] → [T, Hq·D]."""
        if self.kv_cache_group:
            meta = meta.group_metadata[self.kv_cache_group]
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.latent_dim is not None and getattr(meta.backend, "takes_latent_dim", False):
            out = meta.backend.forward(q, k, v, kv_cache, meta, self.scale, sliding_window=self.sliding_window,
                                       logits_soft_cap=self.logits_soft_cap, latent_dim=self.latent_dim)
        elif self.sinks is not None:
            out = meta.backend.forward(q, k, v, kv_cache, meta, self.scale, sliding_window=self.sliding_window,
                                       logits_soft_cap=self.logits_soft_cap, sinks=self.sinks)
        elif self.sliding_window is None and self.logits_soft_cap is None:
            out = meta.backend.forward(q, k, v, kv_cache, meta, self.scale)
        else:
            out = meta.backend.forward(q, k, v, kv_cache, meta, self.scale, sliding_window=self.sliding_window,
                                       logits_soft_cap=self.logits_soft_cap)
        return out.reshape(t, self.num_heads * self.head_dim)
