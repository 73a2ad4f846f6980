"""The KV pools of one worker: per layer a (key, value) pair of [num_blocks, block_size, kv_heads, head_dim],
stored head-major on CUDA and slot-major on the CPU (``kernels/kv_layout.py``). Under MLA (``use_mla``) the pair is
one tensor twice: each layer caches one latent row per token, read as keys and as values."""
from __future__ import annotations

import logging
import math
import mmap

import torch

from pagedllm.device_utils import async_tensor_h2d
from pagedllm.kernels import kv_layout, reference

logger = logging.getLogger("pagedllm")


class CacheEngine:
    """Allocates the device pool and the CPU swap pool; performs swaps and copy-on-write copies."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        layer_slots: list[int] | None = None,
        use_mla: bool = False,
    ) -> None:
        """`layer_slots[i]`: the pool tensor layer i's KV lives in (core/kv_cache_groups.py: a hybrid model's
        groups share tensors, each block id owned by one group); None: one tensor per layer. `use_mla`: each
        slot's key and value tensor are one tensor (MLA caches the latent [c_kv; k_pe] once, read as both)."""
        self.block_size = block_size
        self.device = device
        self.use_mla = use_mla
        self.layout = kv_layout.default_layout(device)
        if layer_slots is None:
            layer_slots = list(range(num_layers))
        if len(layer_slots) != num_layers or sorted(set(layer_slots)) != list(range(max(layer_slots, default=-1) + 1)):
            raise ValueError(f"layer_slots must give each of the {num_layers} layers a slot 0..n-1, using every slot")
        self.layer_slots = list(layer_slots)
        self.num_slots = max(layer_slots, default=-1) + 1
        shape = (num_gpu_blocks, block_size, num_kv_heads, head_dim)
        # Every distinct pool tensor once (swaps and copy-on-write copy each once); gpu_cache: per layer.
        self.slot_gpu_cache = [self._pools(shape, dtype, device) for _ in range(self.num_slots)]
        self.gpu_cache = [self.slot_gpu_cache[s] for s in self.layer_slots]
        # The swap pool is stored like the device pool, so a block swaps as one contiguous copy.
        cpu_shape = (num_cpu_blocks, block_size, num_kv_heads, head_dim)
        host, pin = torch.device("cpu"), device.type == "cuda"  # pinned: async swaps on a side stream
        self.slot_cpu_cache = [self._pools(cpu_shape, dtype, host, pin)
                               for _ in range(self.num_slots)] if num_cpu_blocks else []
        self.cpu_cache = [self.slot_cpu_cache[s] for s in self.layer_slots] if num_cpu_blocks else []
        # CUDA: swaps run on a side stream (pinned host pool, no host sync); compute waits on it on the device.
        self.swap_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _pools(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device,
               pin_memory: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's (key, value) pools: one tensor twice under MLA."""
        key = self._pool(shape, dtype, device, pin_memory)
        return (key, key) if self.use_mla else (key, self._pool(shape, dtype, device, pin_memory))

    def _pool(self, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device,
              pin_memory: bool = False) -> torch.Tensor:
        storage = _zeros(kv_layout.physical_shape(shape, self.layout), dtype, device, pin_memory)
        return kv_layout.logical_view(storage, self.layout)

    # -- sleep mode: the pools dropped and rebuilt (engine/sleep_mode.py) ------------------------------------
    _released_spec: tuple | None = None  # what `release` dropped: (device pool shapes, swap pool shapes, dtype)

    @property
    def released(self) -> bool:
        return self._released_spec is not None

    @property
    def num_blocks(self) -> tuple[int, int]:
        """(device pool blocks, swap pool blocks), released or not."""
        if self.released:
            gpu, cpu, _ = self._released_spec
            return (gpu[0][0] if gpu else 0), (cpu[0][0] if cpu else 0)
        return ((self.slot_gpu_cache[0][0].shape[0] if self.slot_gpu_cache else 0),
                (self.slot_cpu_cache[0][0].shape[0] if self.slot_cpu_cache else 0))

    def release(self) -> int:
        """Drop the device pool and the swap pool (their contents are lost); returns the bytes dropped.
        `reallocate` rebuilds them, zero-filled, with the same shapes, dtypes and layer → tensor sharing."""
        if self.released:
            return 0
        pools = self.slot_gpu_cache + self.slot_cpu_cache
        # (keys and values of a slot have one shape)
        self._released_spec = ([tuple(k.shape) for k, _ in self.slot_gpu_cache],
                               [tuple(k.shape) for k, _ in self.slot_cpu_cache],
                               self.slot_gpu_cache[0][0].dtype if self.slot_gpu_cache else None)
        nbytes = sum(t.numel() * t.element_size() for pair in pools for t in _distinct(pair))
        self.slot_gpu_cache, self.gpu_cache, self.slot_cpu_cache, self.cpu_cache = [], [], [], []
        return nbytes

    def reallocate(self) -> None:
        """Rebuild the pools `release` dropped, by the allocation `__init__` uses (new tensors: new addresses)."""
        if not self.released:
            return
        gpu_shapes, cpu_shapes, dtype = self._released_spec
        host, pin = torch.device("cpu"), self.device.type == "cuda"
        self.slot_gpu_cache = [self._pools(s, dtype, self.device) for s in gpu_shapes]
        self.gpu_cache = [self.slot_gpu_cache[s] for s in self.layer_slots]
        self.slot_cpu_cache = [self._pools(s, dtype, host, pin) for s in cpu_shapes]
        self.cpu_cache = [self.slot_cpu_cache[s] for s in self.layer_slots] if cpu_shapes else []
        self._released_spec = None

    @staticmethod
    def get_cache_block_size(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                             use_mla: bool = False) -> int:
        """Bytes one block takes across all layers (keys and values; under MLA one tensor serves as both)."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return (1 if use_mla else 2) * num_layers * block_size * num_kv_heads * head_dim * elem

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        self._swap(self.slot_gpu_cache, self.slot_cpu_cache, mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        self._swap(self.slot_cpu_cache, self.slot_gpu_cache, mapping)

    def _swap(self, src_cache, dst_cache, mapping: list[tuple[int, int]]) -> None:
        if not mapping:
            return
        if not dst_cache or not src_cache:
            raise RuntimeError("swap requested but the CPU swap pool is empty (swap_space=0)")
        if self.swap_stream is not None:
            self._swap_async(src_cache, dst_cache, mapping)
            return
        m = torch.tensor(mapping, dtype=torch.int64)
        for src_pair, dst_pair in zip(src_cache, dst_cache):
            for src, dst in zip(_distinct(src_pair), _distinct(dst_pair)):
                reference.swap_blocks(src, dst, m)

    def _swap_async(self, src_cache, dst_cache, mapping: list[tuple[int, int]]) -> None:
        """Async copies between the GPU pool and the pinned CPU pool on the swap stream, ordered after the work
        already queued on the compute stream and before the work queued after it: one Triton launch for every layer
        and block, reading or writing the pinned pool in place (triton_cache_ops.swap_blocks), else block by block
        (a host pool Triton cannot address)."""
        compute = torch.cuda.current_stream(self.device)
        self.swap_stream.wait_stream(compute)
        pairs = [p for pair in zip(src_cache, dst_cache) for p in zip(*map(_distinct, pair))]  # K with K, V with V
        with torch.cuda.stream(self.swap_stream):
            try:
                from pagedllm.kernels import triton_cache_ops  # needs triton: imported on use

                m = async_tensor_h2d(mapping, torch.int64, self.device)
                triton_cache_ops.swap_blocks([s for s, _ in pairs], [d for _, d in pairs], m)
            except ValueError:
                for src, dst in pairs:
                    src, dst = kv_layout.storage_of(src), kv_layout.storage_of(dst)
                    for s, d in mapping:
                        dst[d].copy_(src[s], non_blocking=True)
        compute.wait_stream(self.swap_stream)

    def warm_up(self) -> None:
        """CUDA: compile the block-copy kernel (copy-on-write, swaps, the KV offloading tier) now, not in the first
        step that moves a block. Copies block 0 onto itself, and through CPU block 0 when there is a CPU pool: no
        request owns either yet."""
        if self.device.type != "cuda" or not self.slot_gpu_cache:
            return
        self.copy([(0, 0)])
        if self.slot_cpu_cache:
            self.swap_out([(0, 0)])
            self.swap_in([(0, 0)])
        torch.cuda.synchronize(self.device)

    def copy(self, mapping: list[tuple[int, int]]) -> None:
        if not mapping or not self.slot_gpu_cache:  # a pure state-space model's blocks hold no KV
            return
        m = async_tensor_h2d(mapping, torch.int64, self.device)
        # (under MLA a layer's value tensor is its key tensor: each block is copied twice, the same bytes)
        if self.device.type == "cuda":
            from pagedllm.kernels import triton_cache_ops  # needs triton: imported on use

            triton_cache_ops.copy_blocks([k for k, _ in self.slot_gpu_cache], [v for _, v in self.slot_gpu_cache], m)
            return
        reference.copy_blocks([k for k, _ in self.slot_gpu_cache], [v for _, v in self.slot_gpu_cache], m)


def _distinct(pair: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A slot's (key, value) tensors, the key alone where it is also the value (MLA)."""
    return pair[:1] if pair[0] is pair[1] else pair


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin_memory: bool = False) -> torch.Tensor:
    """A zero-filled pool. Unpinned on the host it is an anonymous mapping, so the OS maps a page only when a block
    is first written: an idle pool (or swap space never used) costs no RAM."""
    if device.type != "cpu" or pin_memory:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Not numpy's calloc: numpy madvises large arrays for transparent huge pages, and where the kernel compacts
    # memory for each one (THP defrag "madvise", the usual default) a block's first write stalled its step (on a
    # 2-core Zen 4 VM: 0.2-0.3 GB/s first writes against ~2 GB/s with 4 KB pages; BENCHMARKS §72).
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
