"""Sleep mode, level 1 on a GPU: a model's device tensors moved to host memory and back.

Every tensor a module holds on the device (parameters, buffers, plain tensor attributes such as an FP8
layer's ``fp8_weight``) is moved storage by storage: each distinct device storage is copied once into
one (pinned) host buffer and every tensor over it becomes a view of that buffer with its own offset,
shape and strides, so tied weights and views stay aliases of one another. Restoring copies each buffer
into a new device storage and points the same views (and the same ``nn.Parameter`` objects) at it.
The addresses change: whatever captured the old ones (CUDA graphs) must be captured again.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class _TensorRef:
    owner: nn.Module
    kind: str  # "param" | "buffer" | "attr"
    name: str
    storage: int  # index into OffloadedModel.host
    offset: int  # in elements of `dtype`
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class OffloadedModel:
    """The host copies of a model's device storages and where each tensor sat in them."""

    device: torch.device
    host: list[torch.Tensor] = field(default_factory=list)  # uint8, one per device storage
    refs: list[_TensorRef] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(h.numel() for h in self.host)


def _device_tensors(model: nn.Module, device: torch.device):
    """(module, kind, name, tensor) for every strided tensor on `device` the modules hold; a Parameter shared by
    several modules (tied weights) once. (Opaque tensors, such as oneDNN's packed CPU weights, have no storage to
    move; on a GPU there are none.)"""
    seen: set[int] = set()
    for module in model.modules():
        for kind, items in (("param", module._parameters.items()), ("buffer", module._buffers.items()),
                            ("attr", ((n, v) for n, v in vars(module).items() if isinstance(v, torch.Tensor)))):
            for name, t in list(items):
                if t is None or t.layout != torch.strided or not _on(t, device) or id(t) in seen:
                    continue
                seen.add(id(t))
                yield module, kind, name, t


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether `t` is on `device` ("cuda" matches any index, as the worker names its device)."""
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _assign(ref: _TensorRef, tensor: torch.Tensor) -> None:
    if ref.kind == "param":
        ref.owner._parameters[ref.name].data = tensor  # the same Parameter object: optimizers, ties, hooks hold it
    elif ref.kind == "buffer":
        ref.owner._buffers[ref.name] = tensor
    else:
        ref.owner.__dict__[ref.name] = tensor


def _view(storage: torch.Tensor, ref: _TensorRef) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype, device=storage.device).set_(
        storage.untyped_storage(), ref.offset, ref.shape, ref.stride)


def offload_model(model: nn.Module, device: torch.device, pin_memory: bool | None = None) -> OffloadedModel:
    """Move every tensor of `model` on `device` to host memory (pinned on CUDA); the device memory is free once
    nothing else holds those tensors (the caller drops graphs and empties the allocator's cache)."""
    if pin_memory is None:
        pin_memory = device.type == "cuda"
    out = OffloadedModel(device)
    index: dict[int, int] = {}  # device storage address → host buffer
    for module, kind, name, t in _device_tensors(model, device):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in index:
            index[key] = len(out.host)
            src = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
            host = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=pin_memory)
            host.copy_(src, non_blocking=pin_memory)
            out.host.append(host)
        out.refs.append(_TensorRef(module, kind, name, index[key], t.storage_offset(), tuple(t.shape),
                                   tuple(t.stride()), t.dtype))
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the copies are done before the device storages are released
    for ref in out.refs:
        _assign(ref, _view(out.host[ref.storage], ref))
    return out


def restore_model(offloaded: OffloadedModel) -> None:
    """Move the tensors `offload_model` moved back to their device (new storages, the same views)."""
    device = offloaded.device
    storages = []
    for host in offloaded.host:
        dev = torch.empty(host.numel(), dtype=torch.uint8, device=device)
        dev.copy_(host, non_blocking=host.is_pinned())
        storages.append(dev)
    for ref in offloaded.refs:
        _assign(ref, _view(storages[ref.storage], ref))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    offloaded.host.clear()
    offloaded.refs.clear()
