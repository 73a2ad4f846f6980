"""Host → device copies that never make the host wait for the device's queued work."""
from __future__ import annotations

from collections.abc import Sequence

import torch


def async_tensor_h2d(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype, device)` without a stream sync: on CUDA the values go through
    pinned memory and a non-blocking copy, so a host that runs ahead of the GPU (CUDA graphs,
    asynchronous scheduling) stays ahead. On other devices it is a plain `torch.tensor`."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


#: vLLM's threshold for its larger offline defaults (H100, H200, MI300-class cards).
LARGE_GPU_BYTES = 70 * 2**30


def is_large_gpu(index: int = 0) -> bool:
    """Whether CUDA device ``index`` has >= 70 GiB and is not an A100 (vLLM: large defaults regress there)."""
    if not torch.cuda.is_available():
        return False
    props = torch.cuda.get_device_properties(index)
    return props.total_memory >= LARGE_GPU_BYTES and "a100" not in props.name.lower()
