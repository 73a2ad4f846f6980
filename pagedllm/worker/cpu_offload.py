"""vLLM's ``--cpu-offload-gb``: keep part of a GPU model's weights in pinned host memory and bring them in at
every forward, so a model larger than the GPU's memory still runs (slowly) and more of the GPU goes to the KV pool.

Whole decoder layers are offloaded, from the first, until at least the budget is reached (vLLM's rule). An
offloaded layer's parameters become views into one device *staging* buffer the size of the largest offloaded layer,
shared by all of them; a forward pre-hook copies the layer's weights from host memory into it. Layers run one after
another on one stream, so each copy lands after the previous layer's kernels have read the buffer. The copies are
ordinary stream work: CUDA graphs (decode, piecewise, whole-step) capture them and replay them. What the device
saves is the offloaded bytes less the staging buffer: offloading one layer saves nothing, two save one.

A layer's weights are its parameters, its buffers (MXFP4 experts' bytes; not rotary caches) and --quantization fp8's
weight attributes; one reached from elsewhere too (tied embeddings, a shared module) or non-contiguous stays on the
device, as does a speculative draft checkpoint (the budget is the target's). `Worker.load_weights` refuses an
offloaded model: new weights written into the staging buffer would be overwritten by the next forward's copies.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger("pagedllm")

_ALIGN = 256  # bytes: every view starts where any dtype's kernels may read it


@dataclass(frozen=True)
class CpuOffloadReport:
    layers: int  # decoder layers offloaded
    total_layers: int
    offloaded_bytes: int  # now in pinned host memory
    staging_bytes: int  # the device buffer they are copied into

    @property
    def saved_bytes(self) -> int:
        return self.offloaded_bytes - self.staging_bytes

    def line(self) -> str:
        return (f"CPU offload: {self.layers} of {self.total_layers} decoder layers ({self.offloaded_bytes / 2**30:.2f} "
                f"GiB) in pinned host memory, copied into a {self.staging_bytes / 2**30:.2f} GiB device buffer at every "
                f"forward: {self.saved_bytes / 2**30:.2f} GiB of GPU memory freed")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's repeated blocks: the ModuleList holding the most parameter bytes."""
    best, best_bytes = None, 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            size = sum(_nbytes(p) for p in module.parameters())
            if size > best_bytes:
                best, best_bytes = module, size
    if best is None:
        raise ValueError(f"cpu_offload_gb: {type(model).__name__} has no list of decoder layers to offload")
    return best


# --quantization fp8 keeps a linear layer's weight and scales in plain attributes, not parameters.
_WEIGHT_ATTRS = ("fp8_weight", "fp8_scale")


@dataclass(frozen=True)
class _Slot:
    """One weight tensor of a layer: a parameter (its data is swapped, the Parameter stays), or a buffer (MXFP4
    experts' bytes) or an fp8 weight attribute (rebound)."""
    module: nn.Module
    name: str

    def get(self) -> torch.Tensor:
        return getattr(self.module, self.name)

    def set(self, tensor: torch.Tensor) -> None:
        current = self.get()
        if isinstance(current, nn.Parameter):
            current.data = tensor
        else:
            setattr(self.module, self.name, tensor)


def _direct_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    from pagedllm.model.layers.rotary import RotaryEmbedding

    named = [(n, t) for n, t in module._parameters.items() if t is not None]
    if not isinstance(module, RotaryEmbedding):  # (its caches are small, and computed again, not loaded)
        named += [(n, t) for n, t in module._buffers.items() if t is not None]
    named += [(n, t) for n in _WEIGHT_ATTRS if isinstance(t := module.__dict__.get(n), torch.Tensor)]
    return named


def plan_offload(model: nn.Module, budget_bytes: int) -> tuple[int, list[tuple[nn.Module, list[tuple[_Slot, int]]]]]:
    """(how many decoder layers there are, [(offloaded layer, [(weight slot, its offset in the staging buffer)])]):
    the same answer for the model built on the meta device and once materialized."""
    layers = decoder_layers(model)
    uses: dict[int, int] = {}  # a tensor reached from two places (a tied weight, a shared module) stays on the device
    for _, module in model.named_modules(remove_duplicate=False):
        for _, t in _direct_tensors(module):
            uses[id(t)] = uses.get(id(t), 0) + 1
    plans = []
    offloaded = 0
    for layer in layers:
        if offloaded >= budget_bytes:
            break
        placed, end = [], 0
        for module in layer.modules():
            for name, t in _direct_tensors(module):
                if t.numel() and t.is_contiguous() and uses[id(t)] == 1:
                    placed.append((_Slot(module, name), end))
                    end += -(-_nbytes(t) // _ALIGN) * _ALIGN
        if placed:
            plans.append((layer, placed))
            offloaded += sum(_nbytes(slot.get()) for slot, _ in placed)
    return len(layers), plans


def host_parameters(model: nn.Module, budget_bytes: int) -> set[int]:
    """The ids of the parameters of a meta-built `model` that offloading will keep in host memory: they can be
    allocated there (meta_build.materialize's `on_host`), so loading never holds them on the GPU."""
    if budget_bytes <= 0:
        return set()
    return {id(slot.get()) for _, placed in plan_offload(model, budget_bytes)[1] for slot, _ in placed}


def offload_layers_to_cpu(model: nn.Module, budget_bytes: int, device: torch.device,
                          pin_memory: bool = True) -> CpuOffloadReport | None:
    """Put decoder layers' weights in pinned host memory until `budget_bytes` are offloaded (see the module
    docstring); those already there (`host_parameters`) stay; None when the budget is 0. (`pin_memory=False` with
    a CPU `device`: the same mechanics without a GPU, for tests.)"""
    if budget_bytes <= 0:
        return None
    total_layers, plans = plan_offload(model, budget_bytes)
    if not plans:
        return None
    staging = max(offset + _nbytes(slot.get()) for _, placed in plans for slot, offset in placed)
    buffer = torch.empty(staging, dtype=torch.uint8, device=device)
    offloaded = 0
    for layer, placed in plans:
        copies = []
        for slot, offset in placed:
            t = slot.get().data
            host = t
            if not (t.device.type == "cpu" and (t.is_pinned() or not pin_memory)):
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin_memory)
                host.copy_(t)
            view = buffer[offset:offset + _nbytes(t)].view(t.dtype).view(t.shape)
            slot.set(view)  # frees a device copy
            copies.append((host, view))
            offloaded += _nbytes(t)
        layer.register_forward_pre_hook(_copier(copies))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    report = CpuOffloadReport(len(plans), total_layers, offloaded, staging)
    logger.info(report.line())
    return report


def _copier(copies: list[tuple[torch.Tensor, torch.Tensor]]):
    def copy_in(module, args):
        for host, view in copies:
            view.copy_(host, non_blocking=True)
    return copy_in
