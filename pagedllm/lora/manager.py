"""The worker side of multi-LoRA: adapters resident on the device, and each step's token → adapter mapping.

Every linear an adapter may touch gets a forward hook. The model runner tells the manager each step's token →
adapter mapping (`set_mapping`). The hook adds the low-rank products of every adapter in the step with a fixed
number of GEMMs, whatever the number of adapters: the adapters' A matrices side by side give x Aᵀ for all of them
at once ([tokens, sum of ranks]), each token keeps only its own adapter's columns (a mask), and per output slice
one B over that slice's columns adds them back. The base GEMM is shared by every request (Punica's idea,
in plain torch); tokens without an adapter get nothing added.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

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
        # This step: (adapter ids present, each token's position in them or None when one adapter has every token).
        self._step: tuple[tuple[int, ...], torch.Tensor | None] | None = None
        self._stack_cache: dict[tuple[str, tuple[int, ...]], _Stacked | None] = {}
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
        self._stack_cache.clear()
        logger.info("LoRA adapter %r (id %d, rank %d, %d layers, %.1f MiB) loaded from %s", adapter.name,
                    adapter.lora_int_id, adapter.rank, len(adapter.layers), adapter.num_bytes / 2**20,
                    request.lora_path)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        self._stack_cache.clear()
        return self.adapters.pop(lora_int_id, None) is not None

    def list_loras(self) -> list[int]:
        return list(self.adapters)

    # -- the step ------------------------------------------------------------------------------
    def set_mapping(self, lora_ids: list[int], num_tokens: list[int]) -> None:
        """Chunk i's `num_tokens[i]` tokens run with adapter `lora_ids[i]` (0: none), in batch order."""
        self._step = None
        if not any(lora_ids):
            return
        per_token = np.repeat(np.asarray(lora_ids, dtype=np.int64), num_tokens)
        ids = tuple(int(i) for i in np.unique(per_token) if i != 0)
        missing = [i for i in ids if i not in self.adapters]
        if missing:
            raise RuntimeError(f"LoRA adapter id(s) {missing} are not loaded on this worker")
        uniform = len(ids) == 1 and bool((per_token == ids[0]).all())
        pos = None
        if not uniform:  # each token's adapter as a position in `ids`; -1: none
            where = np.searchsorted(np.asarray(ids, dtype=np.int64), per_token)  # ids are sorted
            pos = torch.from_numpy(np.where(per_token == 0, -1, where)).to(self.device)
        self._step = (ids, pos)

    def _stacked(self, name: str, ids: tuple[int, ...]) -> _Stacked | None:
        """The step's adapters of one layer side by side, slice by slice: A's rows ordered [slice 0: adapter 0,
        adapter 1, …][slice 1: …], so each output slice's B reads only its own columns (built once per set of
        adapters)."""
        key = (name, ids)
        hit = self._stack_cache.get(key)
        if hit is not None or key in self._stack_cache:
            return hit
        if len(self._stack_cache) > 4096:
            self._stack_cache.clear()
        per_slice: dict[tuple[int, int], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for k, lid in enumerate(ids):
            w = self.adapters[lid].layers.get(name)
            if w is None:
                continue
            for offset, rows, r0, r1, b in w.slices:
                per_slice.setdefault((offset, rows), []).append((k, w.a[r0:r1], b))
        stacked = None
        if per_slice:
            a_parts, owners, slices, c = [], [], [], 0
            for (offset, rows), parts in sorted(per_slice.items()):
                c0 = c
                for k, a, _ in parts:
                    a_parts.append(a)
                    owners += [k] * a.shape[0]
                    c += a.shape[0]
                slices.append((offset, rows, c0, c, torch.cat([b for *_, b in parts], dim=1)))
            stacked = _Stacked(torch.cat(a_parts), slices, torch.tensor(owners, device=self.device))
        self._stack_cache[key] = stacked
        return stacked

    def _hook(self, name: str):
        def add_lora_delta(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if self._step is None:
                return None
            ids, pos = self._step
            st = self._stacked(name, ids)
            if st is None:
                return None
            t = args[0].to(st.a.dtype) @ st.a.t()  # [tokens, ranks of every adapter]
            if pos is not None:  # keep each token's own adapter's columns
                t.mul_(pos.unsqueeze(1) == st.owner.unsqueeze(0))
            for offset, rows, c0, c1, b in st.slices:
                out[:, offset:offset + rows].add_((t[:, c0:c1] @ b.t()).to(out.dtype))
            return None

        return add_lora_delta


@dataclass
class _Stacked:
    a: torch.Tensor  # [R, in]: the adapters' A rows, slice-major
    slices: list[tuple[int, int, int, int, torch.Tensor]]  # (output offset, rows, columns c0..c1, B [rows, c1 - c0])
    owner: torch.Tensor  # [R]: which adapter (position in the step's ids) each column belongs to
