"""The worker side of multi-LoRA: adapters resident on the device, and each step's token → adapter mapping.

Every linear an adapter may touch gets a forward hook. A step's tokens are grouped by adapter (the model runner
calls `set_mapping` with its chunks); for each adapter in the batch the hook adds (x Aᵀ) Bᵀ to that adapter's
rows of the layer's output — one gather, one small GEMM per adapted layer and adapter, the base GEMM shared by
every request (Punica's idea, in plain torch). Tokens of requests without an adapter are left untouched.
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagedllm.lora.adapter import LoRAAdapter, load_adapter
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)

#: Our module names an adapter may target (the fused projections of the Llama family).
_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoRAModelManager:
    def __init__(self, model: nn.Module, max_lora_rank: int, max_cpu_loras: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.max_lora_rank, self.max_cpu_loras = max_lora_rank, max_cpu_loras
        self.dtype, self.device = dtype, device
        self.modules = {name: m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in _TARGETS}
        if not self.modules:
            raise ValueError(f"{type(model).__name__} has no layer LoRA adapters can target ({list(_TARGETS)}); "
                             f"LoRA is served for the Llama family (Llama, Mistral, Qwen2, Qwen3).")
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        # This step: (adapter, token rows or None for every row) per adapter present.
        self._active: list[tuple[LoRAAdapter, torch.Tensor | None]] = []
        for name, module in self.modules.items():
            module.register_forward_hook(self._hook(name))

    # -- adapters ------------------------------------------------------------------------------
    def add_lora(self, request: LoRARequest, in_use: set[int] = frozenset()) -> bool:
        """Load the adapter unless resident (False then); evicts the least recently used one not `in_use` when
        more than max_cpu_loras would be resident."""
        if request.lora_int_id in self.adapters:
            self.adapters.move_to_end(request.lora_int_id)
            return False
        adapter = load_adapter(request.lora_int_id, request.lora_name, request.lora_path, self.modules,
                               self.max_lora_rank, self.dtype, self.device)
        while len(self.adapters) >= self.max_cpu_loras:
            victim = next((i for i in self.adapters if i not in in_use), None)
            if victim is None:
                break  # every resident adapter serves a running request: hold one more for now
            del self.adapters[victim]
        self.adapters[request.lora_int_id] = adapter
        logger.info("LoRA adapter %r (id %d, rank %d, %d layers, %.1f MiB) loaded from %s", adapter.name,
                    adapter.lora_int_id, adapter.rank, len(adapter.layers), adapter.num_bytes / 2**20,
                    request.lora_path)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.adapters.pop(lora_int_id, None) is not None

    def list_loras(self) -> list[int]:
        return list(self.adapters)

    # -- the step ------------------------------------------------------------------------------
    def set_mapping(self, lora_ids: list[int], num_tokens: list[int]) -> None:
        """Chunk i's `num_tokens[i]` tokens run with adapter `lora_ids[i]` (0: none), in batch order."""
        self._active = []
        if not any(lora_ids):
            return
        per_token = np.repeat(np.asarray(lora_ids, dtype=np.int64), num_tokens)
        for lid in np.unique(per_token):
            if lid == 0:
                continue
            adapter = self.adapters.get(int(lid))
            if adapter is None:
                raise RuntimeError(f"LoRA adapter id {int(lid)} is not loaded on this worker")
            rows = np.flatnonzero(per_token == lid)
            idx = None if len(rows) == len(per_token) else torch.from_numpy(rows).to(self.device)
            self._active.append((adapter, idx))

    def _hook(self, name: str):
        def add_lora_delta(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            for adapter, idx in self._active:
                weights = adapter.layers.get(name)
                if weights is None:
                    continue
                x = args[0] if idx is None else args[0].index_select(0, idx)
                t = x.to(weights.a.dtype) @ weights.a.t()  # [rows, sum of ranks]
                for offset, n_out, r0, r1, b in weights.slices:
                    delta = (t[:, r0:r1] @ b.t()).to(out.dtype)
                    cols = out[:, offset:offset + n_out]
                    if idx is None:
                        cols.add_(delta)
                    else:
                        cols.index_add_(0, idx, delta)
            return None

        return add_lora_delta
