"""Iteration-level scheduler (paper §2.3, §4.5): FCFS, chunked prefill, all-or-nothing preemption.

Every step forms one flat batch: one token for each decoding sequence, then prompt chunks, under
a token budget (`max_num_batched_tokens`) and a sequence cap (`max_num_seqs`). When the block
pool runs dry, the most recently arrived running group is preempted — swapped to the CPU pool or
dropped to be recomputed — until the earlier ones fit.

Under ``scheduler_config.policy == "priority"`` (vLLM's ``--scheduling-policy priority``) "earlier" means
lower ``priority``, then earlier arrival: that order admits waiting groups, serves running ones and picks
the victim (the last in it). A waiting group of high priority does not preempt running ones; it is
admitted first as soon as there is room.

The KV manager is the paged `BlockManager` or, for the paper's Orca baselines, a
`ContiguousBlockManager` (`cache_config.kv_cache_manager`); the loop is the same for all of them.

With ``scheduler_config.batching == "request"`` (the paper's FasterTransformer baseline, §6.1) new
requests are admitted only when no request is running, swapped or preempted: the earliest-arrived
waiting requests that fit, up to ``max_num_seqs`` sequences, form one batch (each one's whole prompt
is given KV memory at once, whatever this step's token budget), and no other request joins until
every request of that batch has finished. Prompts are still computed in chunks under the token
budget. The recommended FasterTransformer-style configuration is ``batching="request"`` with
``kv_cache_manager="orca-max"`` (FasterTransformer reserves the maximum length per sequence);
``batching="request"`` with ``"paged"`` isolates the effect of request-level batching alone.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.baselines import ContiguousBlockManager
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.interfaces import AllocStatus, KVCacheManager
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class ScheduledSequence:
    group: SequenceGroup
    seq: Sequence
    num_new_tokens: int  # tokens [seq.num_computed_tokens, +num_new_tokens) run this step

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so the step samples for it."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.get_len_with_pending()


@dataclass
class SchedulerOutputs:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) on the device
    num_batched_tokens: int = 0
    num_preempted: int = 0
    # Groups dropped because they can never fit in the pool, even alone.
    ignored_groups: list[SequenceGroup] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.scheduled and not self.blocks_to_swap_out and not self.blocks_to_swap_in


class Scheduler:
    """Decides, each step, which sequences run and how many tokens each."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        if cache_config.num_gpu_blocks is None:
            raise ValueError("cache_config.num_gpu_blocks must be set before building the Scheduler")
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.block_manager = make_kv_cache_manager(scheduler_config, cache_config)
        self.waiting: deque[SequenceGroup] = deque()
        # The order groups are served in: arrival under FCFS, (priority, arrival) under the priority policy.
        self._order = _priority_order if scheduler_config.policy == "priority" else _arrival_order
        # Request-level batching: ids of the current batch's requests that have not finished.
        self._batch: set[str] = set()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        # Groups preempted while a sampled token of theirs was still on the device (asynchronous scheduling):
        # that token, appended after the preemption, may finish them in the waiting or swapped queue.
        self._preempted_in_flight: list[SequenceGroup] = []
        self.num_preemptions = 0
        self.num_recompute_preemptions = 0
        self.num_swap_preemptions = 0

    # -- queue management -------------------------------------------------------------------
    @property
    def max_num_batched_tokens(self) -> int:
        return self.config.max_num_batched_tokens or self.config.max_model_len

    def add_seq_group(self, group: SequenceGroup) -> None:
        self._enqueue(self.waiting, group)

    def _enqueue(self, queue: deque[SequenceGroup], group: SequenceGroup, ahead: bool = False) -> None:
        """Queue `group`. FCFS: at the back, or with `ahead` at the front (a preempted group arrived before
        every waiting one). Priority policy: at its place in the queue's (priority, arrival) order, after the
        groups that tie with it."""
        if self._order is not _arrival_order:
            queue.insert(bisect.bisect_right(queue, self._order(group), key=self._order), group)
        elif ahead:
            queue.appendleft(group)
        else:
            queue.append(group)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def abort_seq_group(self, request_id: str) -> SequenceGroup | None:
        """Remove the request wherever it is and free its blocks at once."""
        for queue in (self.waiting, self.running, self.swapped):
            for group in queue:
                if group.request_id == request_id:
                    queue.remove(group)
                    self._batch.discard(request_id)
                    for seq in group.seqs:
                        if not seq.is_finished():
                            seq.status = SequenceStatus.FINISHED_ABORTED
                        self.block_manager.free(seq)
                    return group
        return None

    def free_seq(self, seq: Sequence) -> None:
        self.block_manager.free(seq)

    def free_finished_seq_groups(self) -> list[SequenceGroup]:
        """Drop finished groups from the running set, and groups that a token still in flight when they were
        preempted has finished since; returns them. (Called once the in-flight step's tokens are appended.)"""
        finished = [g for g in self.running if g.is_finished()]
        if finished:
            self.running = [g for g in self.running if not g.is_finished()]
        if self._preempted_in_flight:
            for group in self._preempted_in_flight:
                # Still queued (not re-admitted into running, not aborted) and finished by that token.
                queue = next((q for q in (self.waiting, self.swapped) if any(g is group for g in q)), None)
                if queue is not None and group.is_finished():
                    queue.remove(group)
                    finished.append(group)
            self._preempted_in_flight.clear()
        for group in finished:
            self._batch.discard(group.request_id)
        return finished

    # -- the step decision ------------------------------------------------------------------
    def schedule(self, max_num_seqs: int | None = None, busy: frozenset[int] = frozenset()) -> SchedulerOutputs:
        """This step's work. `max_num_seqs` (at most the configured one) caps this batch; `busy`: ids of running
        groups whose previous step is still in flight (pipeline stages: several batches at once) stay idle and are
        never preempted."""
        out = SchedulerOutputs()
        seqs = self.config.max_num_seqs if max_num_seqs is None else min(max_num_seqs, self.config.max_num_seqs)
        budget = _Budget(self.max_num_batched_tokens, seqs, prefills=self._prefill_slots())
        self._schedule_running(out, budget, busy)
        if out.num_preempted == 0:
            self._schedule_swapped(out, budget)
        # Paper §4.5: while any preempted group sits in swap, admit no new requests.
        if not self.swapped:
            if self.config.batching == "request":
                self._schedule_waiting_request_level(out, budget)
            else:
                self._schedule_waiting(out, budget)
        out.num_batched_tokens = budget.tokens_used
        return out

    def _prefill_slots(self) -> _PrefillSlots | None:
        """This step's concurrent-prompt limits, or None (max_num_partial_prefills = 1: no limit, as vLLM)."""
        cfg = self.config
        if cfg.max_num_partial_prefills <= 1:
            return None
        return _PrefillSlots(cfg.max_num_partial_prefills, cfg.max_long_partial_prefills,
                             cfg.long_prefill_token_threshold)

    def schedule_prompts(self, max_new_seqs: int) -> SchedulerOutputs:
        """Admit up to `max_new_seqs` waiting sequences (their prompt chunks) and schedule nothing else: the
        running sequences advance elsewhere (the engine's device-side speculation). Never preempts."""
        out = SchedulerOutputs()
        seqs_used = sum(g.max_num_running_seqs() for g in self.running)
        budget = _Budget(self.max_num_batched_tokens, min(self.config.max_num_seqs, seqs_used + max_new_seqs),
                         seqs_used=seqs_used)
        if not self.swapped and self.config.batching != "request":
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = budget.tokens_used
        return out

    def _demand(self, group: SequenceGroup, token_budget: int) -> list[tuple[Sequence, int]]:
        """Tokens each unfinished sequence of the group would run this step (may be 0)."""
        demand = []
        chunked = self.config.enable_chunked_prefill
        cap = self.config.long_prefill_token_threshold  # 0 unless chunked prefill (SchedulerConfig checks)
        # A group that may not sample keeps its last token back, unless its first sample is deferred.
        hold = 0 if group.may_sample or group.defer_sample else 1
        for seq in group.unfinished_seqs():
            want = seq.num_uncomputed_tokens - hold
            if want < 0:  # held with nothing uncomputed (never expected: the last token is always computed)
                want = 0
            if 0 < cap < want:
                want = cap
            n = want if want <= token_budget else (token_budget if chunked else 0)
            demand.append((seq, n))
            token_budget -= n
        return _in_lockstep(demand) if len(demand) > 1 else demand

    def _schedule_running(self, out: SchedulerOutputs, budget: _Budget, busy: frozenset[int] = frozenset()) -> None:
        # Decodes first so a long prompt chunk never stalls them, then prefill chunks; within
        # each, earliest in the policy's order first. Victims are the last in that order not yet placed.
        # (This loop runs for every running group every step: it avoids recomputing per-group facts.)
        decodes: list[SequenceGroup] = []
        prefills: list[SequenceGroup] = []
        placed: list[SequenceGroup] = []
        for g in sorted(self.running, key=self._order):
            if busy and id(g) in busy:  # in flight: idle this step, and never a victim
                placed.append(g)
                continue
            (prefills if g.has_prefill() else decodes).append(g)
        pending = decodes + prefills
        pending.reverse()  # pop() from the end is O(1); the earliest arrival is now last
        bm = self.block_manager
        slots = budget.prefills
        while pending:
            group = pending.pop()
            runs = False  # some sequence of the group has tokens to run this step
            num_seqs = group.max_num_running_seqs()
            prefill = slots is not None and group.has_prefill()
            if not budget.can_add_seqs(num_seqs) or (prefill and not slots.admits(group)):
                placed.append(group)  # stays running, idle this step
                continue
            demand = self._demand(group, budget.tokens_left)
            needed = 0
            for s, n in demand:
                if n:
                    needed += bm.num_blocks_to_grow(s, n)
                    runs = True
            if not runs:
                placed.append(group)  # nothing to run this step: stays running, idle
                continue
            while not bm.can_allocate(needed, for_new_request=False):
                victim = self._pick_victim(pending, group)
                self._preempt(victim, out)
                if victim is group:
                    break
                pending.remove(victim)
            else:
                self._place(group, demand, out, budget, num_seqs)
                placed.append(group)
                if prefill:
                    slots.take(group)
        if len(placed) != len(self.running):
            placed_ids = {id(g) for g in placed}
            self.running = [g for g in self.running if id(g) in placed_ids]

    def _pick_victim(self, pending: list[SequenceGroup], current: SequenceGroup) -> SequenceGroup:
        if not pending:
            return current
        return max(pending, key=self._order)

    def _schedule_swapped(self, out: SchedulerOutputs, budget: _Budget) -> None:
        while self.swapped:
            group = self.swapped[0]
            num_seqs = group.num_unfinished_seqs()
            if not budget.can_add_seqs(num_seqs) or budget.tokens_left < num_seqs:
                break
            # Swapped groups are decoding (one token each); leave room for that growth too (a block in each KV
            # cache group of a hybrid model).
            if not self.block_manager.can_swap_in(group, num_extra_blocks=num_seqs * self.block_manager.num_groups):
                break
            if not self._fits_lora_slots(group, self._running_loras()):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.block_manager.swap_in(group))
            for seq in group.unfinished_seqs():
                seq.status = SequenceStatus.RUNNING
            demand = self._demand(group, budget.tokens_left)
            needed = sum(self.block_manager.num_blocks_to_grow(s, n) for s, n in demand if n)
            if not self.block_manager.can_allocate(needed, for_new_request=False):
                # The check above reserved one block per sequence: enough for one token each. A group
                # swapped out in the middle of its prompt continues with one-token chunks until room frees.
                demand = _in_lockstep([(s, min(n, 1)) for s, n in demand])
            self._place(group, demand, out, budget)
            self.running.append(group)

    def _schedule_waiting_request_level(self, out: SchedulerOutputs, budget: _Budget) -> None:
        if self._batch and not self.running and not self.swapped and not any(
            g.request_id in self._batch for g in self.waiting
        ):
            self._batch.clear()  # every member finished or left
        if self._batch:
            # Members of the running batch that were preempted (recompute) may come back; nobody else.
            self._schedule_waiting(out, budget, members_only=True)
        else:
            self._schedule_waiting(out, budget, new_batch=True)

    def _schedule_waiting(
        self, out: SchedulerOutputs, budget: _Budget, new_batch: bool = False, members_only: bool = False
    ) -> None:
        """Admit waiting groups FCFS. `new_batch` (request-level batching): admit regardless of this
        step's token budget and give each admitted prompt all its KV memory at once. A group whose LoRA adapter
        has no free slot is passed over (as in vLLM) and keeps its place in the queue."""
        passed_over: list[SequenceGroup] = []
        try:
            self._admit_waiting(out, budget, new_batch, members_only, passed_over, self._running_loras())
        finally:
            self.waiting.extendleft(reversed(passed_over))

    def _admit_waiting(self, out: SchedulerOutputs, budget: _Budget, new_batch: bool, members_only: bool,
                       passed_over: list[SequenceGroup], loras: set[int] | None) -> None:
        while self.waiting:
            group = self.waiting[0]
            if members_only and group.request_id not in self._batch:
                break
            num_seqs = group.max_num_running_seqs()
            if not budget.can_add_seqs(max(num_seqs, 1)) or (budget.tokens_left == 0 and not new_batch):
                break
            if not self._fits_lora_slots(group, loras):
                passed_over.append(self.waiting.popleft())
                continue
            slots = budget.prefills
            if slots is not None and not slots.admits(group):
                if not slots.has_room():
                    break
                passed_over.append(self.waiting.popleft())  # a long prompt while long ones fill their slots
                continue
            bm = self.block_manager
            fresh = all(s.seq_id not in bm.block_tables for s in group.unfinished_seqs())
            lookup = fresh and not group.skips_prefix_cache
            if lookup:
                for seq in group.unfinished_seqs():
                    cached = bm.allocate_cached_prefix(seq)
                    if cached:
                        seq.num_computed_tokens = cached
            if fresh and group.first_scheduled_time is None:
                group.num_cached_tokens = group.unfinished_seqs()[0].num_computed_tokens
            demand = self._demand(group, budget.tokens_left)
            if new_batch:
                needed = sum(bm.num_blocks_to_grow(s, s.num_uncomputed_tokens) for s in group.unfinished_seqs())
            else:
                needed = sum(bm.num_blocks_to_grow(s, n) for s, n in demand if n)
            status = bm.can_admit(group, needed)
            # A group that may not sample yet is admitted even with nothing to run (its prompt minus the last
            # token came from the prefix cache): it waits in `running` instead of blocking the queue.
            idle = sum(n for _, n in demand) == 0 and not new_batch and group.may_sample
            if idle or status is not AllocStatus.OK:
                if status is AllocStatus.NEVER and not self.running and not self.swapped and not out.scheduled:
                    self.waiting.popleft()
                    for seq in group.unfinished_seqs():
                        bm.free(seq)
                        seq.status = SequenceStatus.FINISHED_IGNORED
                    out.ignored_groups.append(group)
                    continue
                if fresh:
                    # Give the cached prefix back; it is looked up again next time.
                    for seq in group.unfinished_seqs():
                        bm.free(seq)
                        seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            bm.admit(group)
            for seq in group.unfinished_seqs():
                if lookup:
                    bm.record_prefix_lookup(seq, seq.num_computed_tokens)
                seq.status = SequenceStatus.RUNNING
                if new_batch:
                    out.blocks_to_copy.extend(bm.allocate_slots(seq, seq.num_uncomputed_tokens))
            if new_batch:
                self._batch.add(group.request_id)
            self._place(group, demand, out, budget)
            self.running.append(group)
            if slots is not None:
                slots.take(group)
            if loras is not None and group.lora_int_id:
                loras.add(group.lora_int_id)

    def _running_loras(self) -> set[int] | None:
        """The distinct LoRA adapters of the running set (None without LoRA); admissions add theirs."""
        if self.config.max_loras is None:
            return None
        return {g.lora_int_id for g in self.running if g.lora_int_id}

    def _fits_lora_slots(self, group: SequenceGroup, loras: set[int] | None) -> bool:
        """Whether the group may join the running set, whose adapters are `loras`, without a (max_loras + 1)-th
        distinct one."""
        if loras is None or not group.lora_int_id:
            return True
        return group.lora_int_id in loras or len(loras) < self.config.max_loras

    def _place(
        self,
        group: SequenceGroup,
        demand: list[tuple[Sequence, int]],
        out: SchedulerOutputs,
        budget: _Budget,
        num_seqs: int | None = None,
    ) -> None:
        """Give the group's chunks their slots and count them (and its `num_seqs`, if known) in the budget."""
        for seq, n in demand:
            if n == 0:
                continue
            copies = self.block_manager.allocate_slots(seq, n)
            if copies:
                out.blocks_to_copy.extend(copies)
            out.scheduled.append(ScheduledSequence(group, seq, n))
            budget.tokens_used += n
        budget.seqs_used += group.max_num_running_seqs() if num_seqs is None else num_seqs

    # -- preemption -------------------------------------------------------------------------
    def _preempt(self, group: SequenceGroup, out: SchedulerOutputs) -> None:
        self.num_preemptions += 1
        out.num_preempted += 1
        mode = self.cache_config.preemption_mode
        if any(seq.num_pending_tokens for seq in group.unfinished_seqs()):
            self._preempted_in_flight.append(group)
        multi = group.num_unfinished_seqs() > 1
        use_swap = mode == "swap" or (mode == "auto" and multi)
        if use_swap and self.block_manager.can_swap_out(group):
            out.blocks_to_swap_out.extend(self.block_manager.swap_out(group))
            for seq in group.unfinished_seqs():
                seq.status = SequenceStatus.SWAPPED
            self._enqueue(self.swapped, group)
            self.num_swap_preemptions += 1
        else:
            # Recompute: drop the KV cache; prompt + generated tokens become the new prompt.
            for seq in group.unfinished_seqs():
                self.block_manager.free(seq)
                seq.reset_for_recompute()
                seq.status = SequenceStatus.WAITING
            self._enqueue(self.waiting, group, ahead=True)
            self.num_recompute_preemptions += 1

    # -- bookkeeping after a step -----------------------------------------------------------
    def mark_computed(self, scheduled: list[ScheduledSequence]) -> None:
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_computed_blocks(item.seq)


def make_kv_cache_manager(scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> KVCacheManager:
    """The KV manager `cache_config.kv_cache_manager` names, over `cache_config.num_gpu_blocks` blocks."""
    if cache_config.kv_cache_manager == "paged":
        groups = cache_config.kv_cache_group_windows
        return BlockManager(
            block_size=cache_config.block_size,
            num_gpu_blocks=cache_config.num_gpu_blocks,
            num_cpu_blocks=cache_config.num_cpu_blocks or 0,
            num_offload_blocks=cache_config.num_offload_blocks,
            enable_caching=cache_config.enable_prefix_caching,
            watermark=scheduler_config.watermark,
            sliding_window=cache_config.sliding_window,
            group_windows=groups if groups is not None and len(groups) > 1 else None,
            num_state_slots=scheduler_config.max_num_seqs if cache_config.has_recurrent_state else 0,
            num_state_snapshots=cache_config.num_state_snapshots,
            state_snapshot_interval=cache_config.mamba_block_size or 0,
        )
    return ContiguousBlockManager(
        block_size=cache_config.block_size,
        num_gpu_blocks=cache_config.num_gpu_blocks,
        policy=cache_config.kv_cache_manager,
        max_model_len=scheduler_config.max_model_len,
    )


def _arrival_order(group: SequenceGroup) -> float:
    return group.arrival_time  # a plain float: this key sorts every running group every step


def _priority_order(group: SequenceGroup) -> tuple[int, float]:
    return (group.priority, group.arrival_time)


def _in_lockstep(demand: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
    """A multi-sequence group samples in lockstep (beam search needs every beam's next-token
    distribution in the same step): chunks may run now, but none completes before all can."""
    if len(demand) > 1 and any(n < s.num_uncomputed_tokens for s, n in demand):
        return [(s, min(n, s.num_uncomputed_tokens - 1)) for s, n in demand]
    return demand


@dataclass
class _PrefillSlots:
    """One step's prompts under chunked prefill's concurrency limits (vLLM's max_num_partial_prefills and
    max_long_partial_prefills): a prompt is long while more than `threshold` of its tokens are left to compute."""

    limit: int
    long_limit: int
    threshold: int
    used: int = 0
    long_used: int = 0

    def is_long(self, group: SequenceGroup) -> bool:
        return any(seq.num_uncomputed_tokens > self.threshold for seq in group.unfinished_seqs())

    def has_room(self) -> bool:
        return self.used < self.limit

    def admits(self, group: SequenceGroup) -> bool:
        return self.has_room() and (self.long_used < self.long_limit or not self.is_long(group))

    def take(self, group: SequenceGroup) -> None:
        self.used += 1
        self.long_used += self.is_long(group)


@dataclass
class _Budget:
    max_tokens: int
    max_seqs: int
    tokens_used: int = 0
    seqs_used: int = 0
    prefills: _PrefillSlots | None = None

    @property
    def tokens_left(self) -> int:
        return self.max_tokens - self.tokens_used

    def can_add_seqs(self, n: int) -> bool:
        return self.seqs_used + n <= self.max_seqs
