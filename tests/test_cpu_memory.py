"""glibc heap helpers of the CPU path: freed memory kept for reuse, and handed back when the engine idles."""
from __future__ import annotations

import pytest
import torch

from pagedllm.worker import cpu_memory

pytestmark = pytest.mark.skipif(not cpu_memory.glibc_mallinfo_available(), reason="needs glibc")


def test_freed_activations_stay_resident_until_released():
    """With the reuse thresholds, 256 MiB of freed 1 MiB tensors stay in RSS; malloc_trim returns them."""
    assert cpu_memory.keep_freed_memory_for_reuse()
    in_use = cpu_memory.malloc_in_use_bytes()
    tensors = [torch.ones(256 * 1024) for _ in range(256)]  # 1 MiB each, below the mmap threshold
    assert cpu_memory.malloc_in_use_bytes() - in_use >= 250 * 2**20
    del tensors
    assert cpu_memory.malloc_in_use_bytes() - in_use < 16 * 2**20  # freed ...
    released = cpu_memory.release_free_memory()
    assert released is not None and released >= 200, released  # ... but resident until trimmed
