"""Custom logits processors, with vLLM's (V1) programming model, so that a processor written for vLLM runs here
once its imports name this module.

A processor is a class: ``LLM(model, logits_processors=[MyProcessor])`` or ``pagedllm serve --logits-processors
my_module:MyProcessor`` builds one instance per engine. Each step, for the rows that sample, the engine

1. calls ``update_state(batch_update)`` with what changed in its *persistent batch* since the last step:
   requests removed, added (with their SamplingParams, prompt token ids and a live reference to their output
   token ids, which grows as they generate) and moved, by row index (None when nothing changed), and
2. calls ``apply(logits)`` on a ``[batch_size, vocab]`` tensor whose row i is the request at index i.

A request reads its own settings from ``SamplingParams.extra_args`` (the server's ``vllm_xargs``), and
``validate_params`` can refuse a request's params when it arrives. ``AdapterLogitsProcessor`` wraps per-request
callables ``fn(output_ids, logits_row)`` or ``fn(prompt_ids, output_ids, logits_row)`` (vLLM V0's form).

Processors run after the model and before the built-in processing (``logit_bias``, penalties, temperature,
top-k/p, grammar masks); log-probs stay those of the model's raw logits, as vLLM's default (raw_logprobs). A
step with custom processors waits for the previous step's tokens on the host (the processors read the outputs so
far), as penalties do. Speculative decoding and pooling models refuse custom processors, as in vLLM.
"""
from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from pagedllm.sampling_params import SamplingParams

STR_SPEC_DEC_REJECTS_LOGITSPROCS = "Custom logits processors are not supported when speculative decoding is enabled."
STR_POOLING_REJECTS_LOGITSPROCS = "Pooling models do not support custom logits processors."


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = 0  # the request at `from` moves to `to`; `from` is left empty
    SWAP = 1  # the requests at the two indices trade places


RemovedRequest = int
AddedRequest = tuple[int, SamplingParams, "list[int] | None", list[int]]  # index, params, prompt ids, output ids
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """What changed in the persistent batch since the last step; apply removed, then added, then moved. An added
    or moved request may take an index another one held."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """A batch-level logits processor (vLLM's ``vllm.v1.sample.logits_processor.LogitsProcessor``)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:  # noqa: B027  (optional hook)
        """Raise ValueError for params (``extra_args``) this processor cannot take; called when a request arrives."""

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        """`vllm_config`: the engine's EngineConfig; `device`: where the logits are."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Transform the [batch_size, vocab] logits (in place or not) and return them."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when the processor never changes a row's argmax: then it is skipped for all-greedy batches."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called every step before `apply`, with the batch's changes (None: none)."""


def process_dict_updates(req_entries: dict[int, Any], batch_update: BatchUpdate | None,
                         new_state: Callable[[SamplingParams, list[int] | None, list[int]], Any]) -> bool:
    """Apply a BatchUpdate to per-row state kept as {row index: state} (vLLM's helper of the same name):
    `new_state(params, prompt_ids, output_ids)` gives an added request's state, None for a request the processor
    leaves alone. Returns whether anything changed."""
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= req_entries.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is None:
            changed |= req_entries.pop(index, None) is not None
        else:
            req_entries[index] = state
            changed = True
    for a, b, direction in batch_update.moved:
        at_a, at_b = req_entries.pop(a, None), req_entries.pop(b, None)
        if at_a is not None:
            req_entries[b] = at_a
        if direction == MoveDirectionality.SWAP and at_b is not None:
            req_entries[a] = at_b
        changed |= at_a is not None or at_b is not None
    return changed


RequestLogitsProcessor = Callable[..., torch.Tensor]


class AdapterLogitsProcessor(LogitsProcessor):
    """Runs per-request callables (vLLM V0's logits processors): subclass it and implement
    `new_req_logits_processor(params)` → the request's callable (or None) and `is_argmax_invariant`."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # row index -> (callable, prompt ids for a three-argument callable else None, output ids)
        self.req_info: dict[int, tuple[RequestLogitsProcessor, list[int] | None, list[int]]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The callable for a request with these params, or None when it needs none."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def new_state(params: SamplingParams, prompt_ids: list[int] | None, output_ids: list[int]):
            fn = self.new_req_logits_processor(params)
            if fn is None:
                return None
            return (fn, prompt_ids, output_ids) if _num_positional(fn) >= 3 else (fn, None, output_ids)

        process_dict_updates(self.req_info, batch_update, new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (fn, prompt_ids, output_ids) in self.req_info.items():
            if prompt_ids is not None:  # (a three-argument callable: new_state kept the prompt for it)
                logits[index] = fn(prompt_ids, output_ids, logits[index])
            else:
                logits[index] = fn(output_ids, logits[index])
        return logits


def _num_positional(fn: Callable) -> int:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def resolve_logits_processor_classes(specs: Sequence[str | type] | None) -> tuple[type, ...]:
    """Classes from what the user named: a class, or "package.module:Class" / "package.module.Class" (the CLI's
    --logits-processors). ValueError naming what could not be loaded or is not a LogitsProcessor subclass."""
    classes = []
    for spec in specs or ():
        cls = _load_class(spec) if isinstance(spec, str) else spec
        if not (inspect.isclass(cls) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"logits_processors: {spec!r} is not a subclass of "
                             f"pagedllm.logits_processor.LogitsProcessor (pass the class, or 'module:Class').")
        classes.append(cls)
    return tuple(classes)


def _load_class(spec: str) -> Any:
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"logits_processors: {spec!r} is not 'package.module:Class' or 'package.module.Class'.")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"logits_processors: cannot import module {module_name!r} of {spec!r}: {e}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"logits_processors: module {module_name!r} has no {attr!r}.") from None


@dataclass
class LogitsRow:
    """One sampling row of a step, as the processors see it."""

    seq_id: int
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the sequence's own list: it grows as the sequence generates


class LogitsProcessorBatch:
    """The engine's side: the processors' instances, and a persistent batch of the sequences that sample.

    Each sampling sequence keeps its index while it samples step after step; a sequence that does not sample in a
    step (finished, preempted, aborted) is removed, a new one takes the lowest free index, and the indices are kept
    dense by moving the highest ones into holes (vLLM's condensing). `apply` puts the step's logits rows in
    persistent order, runs the processors and returns the rows in the step's order."""

    def __init__(self, classes: Sequence[type], config: Any, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.processors: list[LogitsProcessor] = [cls(config, device, pin) for cls in classes]
        self._index_of: dict[int, int] = {}
        self._seq_at: list[int | None] = []

    def _update(self, rows: list[LogitsRow]) -> BatchUpdate | None:
        live = {row.seq_id for row in rows}
        removed = []
        for seq_id, index in list(self._index_of.items()):
            if seq_id not in live:
                removed.append(index)
                del self._index_of[seq_id]
                self._seq_at[index] = None
        added = []
        free = (i for i, s in enumerate(self._seq_at) if s is None)
        for row in rows:
            if row.seq_id in self._index_of:
                continue
            index = next(free, None)
            if index is None:
                index = len(self._seq_at)
                self._seq_at.append(None)
            self._seq_at[index] = row.seq_id
            self._index_of[row.seq_id] = index
            added.append((index, row.params, row.prompt_token_ids, row.output_token_ids))
        moved = []
        size = len(rows)
        for hole in range(size):
            if self._seq_at[hole] is not None:
                continue
            last = max(i for i, s in enumerate(self._seq_at) if s is not None)
            seq_id = self._seq_at[last]
            self._seq_at[hole], self._seq_at[last] = seq_id, None
            self._index_of[seq_id] = hole
            moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
        del self._seq_at[size:]
        if not (removed or added or moved):
            return None
        return BatchUpdate(size, removed, added, moved)

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor, rows: list[LogitsRow], all_greedy: bool) -> torch.Tensor:
        """`logits[i]` belongs to `rows[i]`; → the processed logits in the same order (a new tensor: processors
        write in place, and `logits` may be a CUDA graph's output buffer)."""
        update = self._update(rows)
        for proc in self.processors:
            proc.update_state(update)
        order = [0] * len(rows)  # persistent index -> the step's row
        for i, row in enumerate(rows):
            order[self._index_of[row.seq_id]] = i
        identity = order == list(range(len(rows)))
        index = None if identity else torch.tensor(order, device=logits.device)
        x = logits.clone() if identity else logits[index]
        for proc in self.processors:
            if not (all_greedy and proc.is_argmax_invariant()):
                x = proc.apply(x)
        if identity:
            return x
        back = torch.empty_like(x)
        back[index] = x
        return back
