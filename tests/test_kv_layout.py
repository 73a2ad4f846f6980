"""KV pool layouts (kernels/kv_layout.py): head-major storage behind the logical [blocks, slots, heads, dim]
view, the layout a CacheEngine picks per device, and swaps between pools of one layout."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import kv_layout, reference
from pagedllm.worker.cache_engine import CacheEngine


def test_head_major_storage_keeps_a_heads_block_contiguous():
    shape = (3, 16, 4, 8)
    storage = torch.arange(3 * 16 * 4 * 8, dtype=torch.float32).view(kv_layout.physical_shape(shape, kv_layout.HEAD_MAJOR))
    pool = kv_layout.logical_view(storage, kv_layout.HEAD_MAJOR)
    assert pool.shape == shape and kv_layout.layout_of(pool) == kv_layout.HEAD_MAJOR
    # block 1, KV head 2: slots 0..15 of head_dim 8 are one run of 128 consecutive elements
    run = pool[1, :, 2, :].reshape(-1)
    assert torch.equal(run, torch.arange(run[0].item(), run[0].item() + 128))
    assert kv_layout.storage_of(pool).data_ptr() == storage.data_ptr() and kv_layout.storage_of(pool).is_contiguous()
    assert kv_layout.layout_of(torch.zeros(shape)) == kv_layout.SLOT_MAJOR
    with pytest.raises(ValueError, match="slot-major or head-major"):
        kv_layout.layout_of(torch.zeros(16, 3, 4, 8).transpose(0, 1))
    with pytest.raises(ValueError, match="KV layout must be one of"):
        kv_layout.physical_shape(shape, "diagonal")


def test_pools_are_head_major_on_cuda_and_slot_major_on_the_cpu():
    assert kv_layout.default_layout(torch.device("cuda", 0)) == kv_layout.HEAD_MAJOR
    assert kv_layout.default_layout(torch.device("cpu")) == kv_layout.SLOT_MAJOR
    engine = CacheEngine(2, 2, 8, 16, 4, 3, torch.float32, torch.device("cpu"))
    assert engine.layout == kv_layout.SLOT_MAJOR
    assert all(k.is_contiguous() and v.is_contiguous() for k, v in engine.gpu_cache + engine.cpu_cache)


def test_reference_paths_read_and_write_a_head_major_pool_like_a_slot_major_one():
    g = torch.Generator().manual_seed(0)
    shape = (5, 4, 2, 8)
    slot_k, slot_v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    head_k, head_v = (kv_layout.to_layout(t, kv_layout.HEAD_MAJOR) for t in (slot_k, slot_v))
    assert kv_layout.layout_of(head_k) == kv_layout.HEAD_MAJOR and torch.equal(head_k, slot_k)
    key, value = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    slots = torch.tensor([2, -1, 13])
    reference.reshape_and_cache(key, value, slot_k, slot_v, slots)
    reference.reshape_and_cache(key, value, head_k, head_v, slots)
    assert torch.equal(slot_k, head_k) and torch.equal(slot_v, head_v)
    # swaps between two head-major pools (the CUDA pool and its swap pool share the layout)
    dst_k = kv_layout.logical_view(torch.zeros(kv_layout.physical_shape(shape, kv_layout.HEAD_MAJOR)),
                                   kv_layout.HEAD_MAJOR)
    reference.swap_blocks(head_k, dst_k, torch.tensor([[3, 0], [1, 4]]))
    assert torch.equal(dst_k[0], slot_k[3]) and torch.equal(dst_k[4], slot_k[1])


@pytest.mark.cuda
def test_cuda_pools_and_their_swap_pools_are_head_major_and_swap_whole_blocks():
    engine = CacheEngine(2, 2, 8, 16, 4, 3, torch.bfloat16, torch.device("cuda"))
    assert engine.layout == kv_layout.HEAD_MAJOR
    for k, v in engine.gpu_cache + engine.cpu_cache:
        assert kv_layout.layout_of(k) == kv_layout.layout_of(v) == kv_layout.HEAD_MAJOR
    k0 = engine.gpu_cache[1][0]
    k0[2].copy_(torch.randn(16, 2, 8, dtype=torch.bfloat16))
    want = k0[2].clone()
    engine.swap_out([(2, 1)])
    k0[2].zero_()
    engine.swap_in([(1, 3)])
    torch.cuda.synchronize()
    assert torch.equal(engine.cpu_cache[1][0][1], want.cpu()) and torch.equal(k0[3], want)
