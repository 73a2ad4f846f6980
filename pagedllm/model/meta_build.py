"""Models built on the meta device, then given memory on the real device in the dtype (or the empty shape) that a
checkpoint format needs, so loading never passes through the model's full-precision size."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return build()


def materialize(model: nn.Module, device: torch.device,
                dtype_of: Callable[[nn.Parameter], torch.dtype] | None = None,
                released: Callable[[nn.Module, str], bool] | None = None,
                on_host: Callable[[nn.Parameter], bool] | None = None) -> nn.Module:
    """Memory on `device` for every parameter of a meta-built `model`: in `dtype_of(p)` (default its own; a parameter
    given another dtype keeps the declared one as `unquantized_dtype`), or empty where `released(module, name)` (a
    format that holds that weight in other tensors), or in pinned host memory where `on_host(p)` (weights offloaded
    to the CPU: worker/cpu_offload.py). Rotary caches are computed again on `device`; any other buffer left on the
    meta device is an error."""
    from pagedllm.model.layers.rotary import RotaryEmbedding

    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) not in made:
                dtype = dtype_of(p) if dtype_of is not None else p.dtype
                shape = (0,) if released is not None and released(module, name) else p.shape
                if on_host is not None and on_host(p):
                    data = torch.empty(shape, dtype=dtype, pin_memory=True)
                else:
                    data = torch.empty(shape, dtype=dtype, device=device)
                q = nn.Parameter(data, requires_grad=False)
                q.__dict__.update(p.__dict__)  # weight_loader and the like
                if dtype != p.dtype:
                    q.unquantized_dtype = p.dtype  # if the checkpoint stores this weight unquantized after all
                made[id(p)] = q
            if p is not None:
                module._parameters[name] = made[id(p)]  # tied weights stay one parameter
        if isinstance(module, RotaryEmbedding):
            with torch.device(device):
                fresh = RotaryEmbedding(*module.init_args)
            module._buffers.update(fresh._buffers)
        elif any(b is not None and b.is_meta for b in module._buffers.values()):
            raise ValueError(f"{type(module).__name__} has buffers that this checkpoint format's load cannot compute.")
    return model
