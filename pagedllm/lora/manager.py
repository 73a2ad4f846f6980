"""The worker side of multi-LoRA: adapters resident on the device, their slots, and each step's token → slot map.

Every linear an adapter may touch (the model class's `lora_modules`) gets a forward hook and, per output slice
(q/k/v of `qkv_proj`, gate/up of `gate_up_proj`), static buffers for `max_loras` slots of rank `max_lora_rank`
(vLLM's layout, as Punica's): A [slices × slots × rank, in] and B [rows, slots × rank]. A step's adapters are
copied into slots (only when one is not already there), the step's token → slot map becomes a mask over the rank
columns, and the hook adds ((x Aᵀ) ⊙ mask) Bᵀ to each slice's outputs: a fixed number of GEMMs whatever the
adapters, and nothing that depends on the step's contents. So CUDA graphs capture the LoRA steps like any other;
tokens without an adapter get zeros added. The scheduler keeps at most `max_loras` distinct adapters in the running
set (core/scheduler.py), so every step fits the slots.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.device_utils import async_tensor_h2d
from pagedllm.lora.adapter import LoRAAdapter, LoRATargets, load_adapter
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


@dataclass
class _SlotBuffers:
    """One layer's adapter slots. Column c of x Aᵀ is slice c // (slots × rank), slot (c // rank) % slots."""

    a: torch.Tensor  # [slices × slots × rank, in]
    b: torch.Tensor  # [out, slices × slots × rank], block-diagonal: slice j's rows read only slice j's columns
    offsets: list[int]  # per slice: its first output row (and one more: the layer's output size)

    @property
    def num_slices(self) -> int:
        return len(self.offsets) - 1

    def slice_b(self, j: int, width: int) -> torch.Tensor:
        """Slice j's block of B: [its rows, slots × rank]."""
        return self.b[self.offsets[j]:self.offsets[j + 1], j * width:(j + 1) * width]


class LoRAModelManager:
    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device, max_num_tokens: int) -> None:
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.dtype, self.device = dtype, device
        # The layers adapters may target: the model class's `lora_modules` (lora/adapter.py: LoRATargets).
        self.targets = LoRATargets.of(model)
        layer_names = self.targets.layer_names
        self.modules = {name: m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in layer_names}
        if not self.modules:
            raise ValueError(f"{type(model).__name__} serves no LoRA adapters: it has no layer they can target "
                             f"({sorted(layer_names) or 'it declares none'}).")
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slot_ids = [0] * max_loras  # the adapter id in each slot (0: empty)
        width = max_loras * max_lora_rank
        self.buffers: dict[str, _SlotBuffers] = {}
        self._buffers_of: dict[int, _SlotBuffers] = {}  # id(module) → its buffers (the CPU direct forward's key)
        for name, module in self.modules.items():
            out_features, in_features = module.weight_shape()
            sizes = list(getattr(module, "shard_sizes", None) or [out_features])
            self.buffers[name] = _SlotBuffers(
                torch.zeros(len(sizes) * width, in_features, dtype=dtype, device=device),
                torch.zeros(out_features, len(sizes) * width, dtype=dtype, device=device),
                [sum(sizes[:j]) for j in range(len(sizes) + 1)])
            self._buffers_of[id(module)] = self.buffers[name]
            module.register_forward_hook(self._hook(self.buffers[name]))
        # Each token's mask over one slice's slot × rank columns, rewritten every step. Static, so a captured
        # graph reads the replayed step's mask; a step longer than every graph gets a buffer of its own.
        self._mask_buffer = torch.zeros(max_num_tokens, width, dtype=dtype, device=device)
        self._column_slot = torch.arange(max_loras, device=device).repeat_interleave(max_lora_rank)
        self._mask: torch.Tensor | None = None  # this step's mask, None when no token has an adapter
        # Eager steps on the CPU use only the slots from the step's lowest to its highest, without the mask when
        # every token has the same adapter; graphs always take every slot.
        self._slot_range, self._uniform = (0, max_loras), False
        self.always_apply = False  # set while CUDA graphs are in use: every step (and capture) runs the hooks
        self.num_slot_loads = 0

    @property
    def num_buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for buf in self.buffers.values() for t in (buf.a, buf.b))

    # -- adapters ------------------------------------------------------------------------------
    def add_lora(self, request: LoRARequest, in_use: set[int] = frozenset()) -> bool:
        """Load the adapter unless resident (False then); evicts the least recently used one not `in_use` when
        more than max_cpu_loras would be resident."""
        if request.lora_int_id in self.adapters:
            self.adapters.move_to_end(request.lora_int_id)
            return False
        adapter = load_adapter(request.lora_int_id, request.lora_name, request.lora_path, self.modules,
                               self.targets, self.max_lora_rank, self.dtype, self.device)
        while len(self.adapters) >= self.max_cpu_loras:
            victim = next((i for i in self.adapters if i not in in_use), None)
            if victim is None:
                break  # every resident adapter serves a running request: hold one more for now
            self.remove_lora(victim)
        self.adapters[request.lora_int_id] = adapter
        logger.info("LoRA adapter %r (id %d, rank %d, %d layers, %.1f MiB) loaded from %s", adapter.name,
                    adapter.lora_int_id, adapter.rank, len(adapter.layers), adapter.num_bytes / 2**20,
                    request.lora_path)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        if lora_int_id in self.slot_ids:  # its slot is refilled before another adapter uses it
            self.slot_ids[self.slot_ids.index(lora_int_id)] = 0
        return self.adapters.pop(lora_int_id, None) is not None

    def list_loras(self) -> list[int]:
        return list(self.adapters)

    def _activate(self, ids: list[int]) -> None:
        """Put every adapter of `ids` (at most max_loras) in a slot, refilling slots no id of the step holds."""
        missing = [i for i in ids if i not in self.adapters]
        if missing:
            raise RuntimeError(f"LoRA adapter id(s) {missing} are not loaded on this worker")
        if len(ids) > self.max_loras:
            raise RuntimeError(f"a step holds {len(ids)} LoRA adapters, more than max_loras={self.max_loras} "
                               f"(the scheduler keeps the running set within it)")
        for lid in ids:
            if lid in self.slot_ids:
                continue
            free = self.slot_ids.index(0) if 0 in self.slot_ids else next(
                s for s, held in enumerate(self.slot_ids) if held not in ids)
            self._fill_slot(free, self.adapters[lid])

    def _fill_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        rank = self.max_lora_rank
        width = self.max_loras * rank
        for name, buf in self.buffers.items():
            for j in range(buf.num_slices):
                buf.a[j * width + slot * rank: j * width + (slot + 1) * rank].zero_()
                buf.slice_b(j, width)[:, slot * rank:(slot + 1) * rank].zero_()
            w = adapter.layers.get(name)
            if w is None:
                continue
            for offset, _, r0, r1, b in w.slices:
                j = buf.offsets.index(offset)
                row = j * width + slot * rank
                buf.a[row:row + r1 - r0].copy_(w.a[r0:r1])
                buf.slice_b(j, width)[:, slot * rank:slot * rank + r1 - r0].copy_(b)
        self.slot_ids[slot] = adapter.lora_int_id
        self.num_slot_loads += 1

    # -- the step ------------------------------------------------------------------------------
    def set_mapping(self, lora_ids: list[int], num_tokens: list[int]) -> None:
        """Chunk i's `num_tokens[i]` tokens run with adapter `lora_ids[i]` (0: none), in batch order."""
        if not any(lora_ids) and not self.always_apply:
            self._mask = None
            return
        ids = sorted({i for i in lora_ids if i})
        self._activate(ids)
        slot_of = {lid: self.slot_ids.index(lid) for lid in ids}
        per_chunk = np.asarray([slot_of[i] if i else -1 for i in lora_ids], dtype=np.int64)
        slots = async_tensor_h2d(np.repeat(per_chunk, num_tokens), torch.int64, self.device)
        n = int(slots.shape[0])
        mask = self._mask_buffer[:n] if n <= self._mask_buffer.shape[0] else torch.empty(
            n, self._mask_buffer.shape[1], dtype=self.dtype, device=self.device)
        mask.copy_(slots.unsqueeze(1) == self._column_slot.unsqueeze(0))
        self._mask = mask
        if not self.always_apply:
            self._slot_range = (min(slot_of.values()), max(slot_of.values()) + 1)
            self._uniform = len(ids) == 1 and all(lora_ids)

    @property
    def step_has_adapters(self) -> bool:
        return self._mask is not None or self.always_apply

    def add_lora_delta(self, module: nn.Module, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += the step's adapter deltas of `module` for input `x` (the CPU direct forward, which calls the
        layers' GEMMs without their hooks)."""
        buf = self._buffers_of.get(id(module))
        if buf is not None and self.step_has_adapters:
            self._add(buf, x, out)

    def _hook(self, buf: _SlotBuffers):
        def add_lora_delta(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            if self.step_has_adapters:
                self._add(buf, args[0], out)
            return None

        return add_lora_delta

    def _add(self, buf: _SlotBuffers, x: torch.Tensor, out: torch.Tensor) -> None:
        width = self.max_loras * self.max_lora_rank
        n = out.shape[0]
        # Under capture (and in padded graph rows) the static buffer's rows stand in for the step's mask.
        mask = self._mask if self._mask is not None and self._mask.shape[0] == n else self._mask_buffer[:n]
        x = x.to(buf.a.dtype)
        if out.is_cuda and out.dtype == x.dtype:
            # Three kernels: x Aᵀ over every slice and slot, the mask, and one GEMM over the block-diagonal B
            # accumulated in place. A GPU step pays per kernel, and the zero blocks' FLOPs are nothing beside the
            # base GEMM's.
            t = x @ buf.a.t()  # [tokens, slices × slots × rank]
            t.view(n, buf.num_slices, width).mul_(mask.unsqueeze(1))
            out.addmm_(t, buf.b.t())
            return
        # On the CPU FLOPs cost more than calls (BENCHMARKS §65.2): slice by slice, over the slots in use only.
        c0, c1 = (s * self.max_lora_rank for s in self._slot_range)
        for j in range(buf.num_slices):
            t = x @ buf.a[j * width + c0:j * width + c1].t()
            if not self._uniform:
                t.mul_(mask[:, c0:c1])
            b = buf.slice_b(j, width)[:, c0:c1]
            out[:, buf.offsets[j]:buf.offsets[j + 1]].add_((t @ b.t()).to(out.dtype))
