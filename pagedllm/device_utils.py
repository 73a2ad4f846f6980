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
