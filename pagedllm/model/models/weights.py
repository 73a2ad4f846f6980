"""Shared weight-loading loop: checkpoint names → parameters, through each parameter's loader."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: dict[str, tuple[str, int]],
    skip: tuple[str, ...] = (),
    renames: dict[str, str] | None = None,
) -> None:
    """Copy checkpoint tensors into `model`, merging stacked projections; errors name what is wrong."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_names: set[str] = set()
    for name, tensor in weights:
        if any(name.endswith(s) for s in skip):
            continue
        for old, new in (renames or {}).items():
            name = name.replace(old, new)
        shard_id = 0
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in stacked_params:
            target, shard_id = stacked_params[parts[-2]]
            name = ".".join(parts[:-2] + [target, parts[-1]])
        param = params.get(name)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        if param.dtype == torch.float8_e4m3fn and tensor.dtype != param.dtype:
            # Allocated in e4m3 for an FP8 checkpoint (model/fp8_checkpoint.py), which stores it unquantized.
            param.data = torch.empty(param.shape, dtype=param.unquantized_dtype, device=param.device)
        loader = getattr(param, "weight_loader", default_weight_loader)
        loader(param, tensor.to(param.dtype), shard_id)
        loaded_names.add(name)
    tied = {"lm_head.weight"} if getattr(model, "tie_word_embeddings", False) else set()
    # `optional` parameters (an FP8 checkpoint's per-row scales) stay at their initial value when not in the checkpoint.
    missing = [n for n, p in params.items()
               if n not in loaded_names and n not in tied and not getattr(p, "optional", False)]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")


def init_dummy_weights(model: nn.Module, seed: int = 0, scale: float = 0.02) -> None:
    """Random weights for any config (load_format='dummy'); norms stay at 1 for stable outputs.

    Drawn on each parameter's own device (one generator per device), so an 8B model's dummy init
    on a GPU takes a second rather than minutes; the same seed gives the same weights per device.
    """
    gens: dict[torch.device, torch.Generator] = {}
    norm_weights = {f"{m}.weight" for m, mod in model.named_modules() if type(mod).__name__.endswith("Norm")}
    # Weights offloaded to host memory (--cpu-offload-gb) are drawn on the model's GPU: the same weights as without.
    gpu = next((p.device for p in model.parameters() if p.is_cuda), None)
    for name, param in model.named_parameters():
        if name in norm_weights or ("norm" in name and name.endswith("weight")):
            param.data.fill_(1.0)
            continue
        dev = gpu if gpu is not None and param.device.type == "cpu" else param.device
        gen = gens.setdefault(dev, torch.Generator(device=dev).manual_seed(seed))
        draw = torch.empty(param.shape, dtype=torch.float32, device=dev).normal_(0.0, scale, generator=gen)
        param.data.copy_(draw.to(param.dtype))
