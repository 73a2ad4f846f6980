"""KV cache operations in Triton: ``reshape_and_cache``, ``copy_blocks`` and ``swap_blocks`` (oracles in
``reference.py``)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.device_utils import async_tensor_h2d
from pagedllm.kernels import kv_layout, kv_quant


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,
    inv_k_scale, inv_v_scale,
    FP8_MAX: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    mask = (h[:, None] < HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + tok * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if FP8_MAX > 0:  # FP8 pool: scale, saturate (a plain cast would overflow to NaN), then cast on store
        k = tl.clamp(k.to(tl.float32) * inv_k_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) * inv_v_scale, -FP8_MAX, FP8_MAX)
    dst = blk * stride_cb + off * stride_co + h[:, None] * stride_ch + d[None, :]
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Write each token's K/V [T, H, D] into its slot of the [num_blocks, block_size, H, D] caches (slot- or
    head-major, ``kv_layout``); slots < 0 are skipped.

    FP8 caches store clamp(x / scale, ±max) (``kv_quant.quantize``); other caches ignore the scales.
    One launch for keys and values together; no host sync (the skip is decided on the device).
    """
    t, heads, dim = key.shape
    if value.shape != key.shape or key_cache.shape != value_cache.shape or key_cache.shape[2:] != (heads, dim):
        raise ValueError(
            f"shape mismatch: key {tuple(key.shape)}, value {tuple(value.shape)}, "
            f"caches {tuple(key_cache.shape)} / {tuple(value_cache.shape)} (expected [*, *, {heads}, {dim}])."
        )
    kv_layout.layout_of(key_cache)  # slot- or head-major; one set of strides serves both caches
    if key_cache.stride() != value_cache.stride():
        raise ValueError(f"key_cache and value_cache must share one layout; strides {key_cache.stride()} and "
                         f"{value_cache.stride()}.")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value must be contiguous in their last (head_dim) dimension.")
    if slot_mapping.shape[0] != t:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {t} tokens.")
    if t == 0:
        return
    _reshape_and_cache_kernel[(t,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        1.0 / k_scale, 1.0 / v_scale,
        FP8_MAX=kv_quant.fp8_max(key_cache.dtype), BLOCK_SIZE=key_cache.shape[1], HEADS=heads, HEAD_DIM=dim,
        HEADS_PAD=triton.next_power_of_2(heads), DIM_PAD=triton.next_power_of_2(dim),
        num_warps=4,
    )


def copy_blocks(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Copy-on-write: for each (src, dst) row of `block_mapping` [N, 2], copy block src → dst in every layer,
    all layers and all pairs in one launch (swap_blocks' kernel with each cache its own destination)."""
    if block_mapping.numel() == 0:
        return
    caches = [c for pair in zip(key_caches, value_caches) for c in pair]
    first = caches[0]
    for c in caches:
        if c.dtype != first.dtype or c.shape != first.shape or c.stride() != first.stride() or c.device != first.device:
            raise ValueError("copy_blocks needs caches of one shape, layout, dtype and device.")
    swap_blocks(caches, caches, block_mapping.to(device=first.device, dtype=torch.int64).contiguous())


@triton.jit
def _swap_blocks_kernel(
    src_base_ptr, dst_base_ptr, src_offsets_ptr, dst_offsets_ptr, mapping_ptr,
    NUMEL: tl.constexpr, CHUNK: tl.constexpr,
):
    pair = tl.program_id(0)
    cache = tl.program_id(1)
    src = tl.load(mapping_ptr + pair * 2).to(tl.int64)
    dst = tl.load(mapping_ptr + pair * 2 + 1).to(tl.int64)
    src_base = src_base_ptr + tl.load(src_offsets_ptr + cache)  # this layer's K or V pool on each side
    dst_base = dst_base_ptr + tl.load(dst_offsets_ptr + cache)
    for start in range(0, NUMEL, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < NUMEL
        x = tl.load(src_base + src * NUMEL + offs, mask=mask)
        tl.store(dst_base + dst * NUMEL + offs, x, mask=mask)


def swap_blocks(src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Swaps (and the KV offloading tier's copies) between the device pool and the pinned host pool: for each (src,
    dst) row of `block_mapping` [N, 2] (on the device), block src of every cache in `src_caches` → block dst of the
    matching cache in `dst_caches`, all layers and all pairs in one launch. One side lives in pinned host memory,
    which the kernel reads or writes in place (mapped into the device's address space under unified addressing),
    instead of one copy per block and layer. Each side's caches are addressed by their element offset from its
    first; ValueError if the caches differ in shape, layout or dtype, or Triton cannot address a side."""
    if block_mapping.numel() == 0:
        return
    if len(src_caches) != len(dst_caches) or not src_caches:
        raise ValueError("swap_blocks needs one destination cache per source cache")
    first_src, first_dst = src_caches[0], dst_caches[0]
    for c in (*src_caches, *dst_caches):
        if c.dtype != first_src.dtype or c.shape[1:] != first_src.shape[1:] or c.stride() != first_src.stride():
            raise ValueError("swap_blocks needs caches of one block shape, layout and dtype")
    kv_layout.layout_of(first_src)  # either layout stores a block as one dense run: copied as NUMEL elements
    elem = first_src.element_size()
    offsets = []
    for caches, first in ((src_caches, first_src), (dst_caches, first_dst)):
        deltas = [c.data_ptr() - first.data_ptr() for c in caches]
        if any(x % elem for x in deltas):
            raise ValueError("cache tensors are not aligned to their element size.")
        offsets.append(async_tensor_h2d([x // elem for x in deltas], torch.int64, block_mapping.device))
    numel = first_src[0].numel()
    _swap_blocks_kernel[(block_mapping.shape[0], len(src_caches))](
        first_src, first_dst, offsets[0], offsets[1], block_mapping,
        NUMEL=numel, CHUNK=min(4096, triton.next_power_of_2(numel)), num_warps=4,
    )
