"""The engine's side of device-side n-gram speculation (`"method": "ngram_gpu"`, spec_decode/device_ngram.py).

While every running sequence is a plain greedy single-sequence decode and nothing waits to be admitted, the
engine runs this mode: each `step()` queues a speculating step built from the device's own token history,
then reads the step before it, so the host's bookkeeping overlaps the device's work, as plain asynchronous
steps do. The host learns step t's tokens while step t + 1 runs:

- it appends them (detokenisation, stop checks; a sequence that stopped inside step t was already queued in
  step t + 1, whose rows for it are ignored), sets `num_computed_tokens` and hashes newly full blocks;
- before queueing a step it gives each sequence blocks for 2 (k + 1) tokens past what it knows: the step in
  flight may add up to k + 1 tokens, and the new step writes k + 1 rows.

A sequence enters from the ordinary step still in flight (the token it sampled is copied into the history on
the device), and greedy requests that arrive while the mode runs are admitted beside it: their prompts run as a
prefill-only step (`Scheduler.schedule_prompts`) and they join from that step in flight. Anything else (a sampled
or constrained request, more sequences than `disable_by_batch_size`, a full pool, the mode chooser preferring
plain steps) drains the mode: the step in flight completes, the sequences' blocks are trimmed to their tokens,
and the ordinary scheduler takes over in the same `step()` call.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.core.block_manager import cdiv
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.spec_decode.device_ngram import accept_greedy, append_history, build_rows, propose_ngrams
from pagedllm.worker.model_input import fill_block_table_row

if TYPE_CHECKING:
    from pagedllm.engine.launched_step import LaunchedStep

logger = logging.getLogger("pagedllm")

# After the pool could not give every sequence its look-ahead blocks, this many ordinary steps run before the mode
# is tried again (each try completes the step in flight first).
_SKIP_AFTER_FULL_POOL = 32


def _plain_greedy(group: SequenceGroup) -> bool:
    """One greedy sequence without logprobs, penalties, logit adjustments, beams or a grammar: what the mode
    decodes."""
    p = group.sampling_params
    return not (len(group.seqs) != 1 or "beam" in group.extra or "structured_output" in group.extra
                or p.has_logit_adjustments
                or p.temperature > 0 or p.logprobs is not None or p.repetition_penalty != 1.0
                or p.presence_penalty or p.frequency_penalty or (group.extra.get("best_of") or 1) > 1)


@dataclass
class _DeviceStep:
    members: list[tuple[SequenceGroup, Sequence]]
    host_out: torch.Tensor  # [max_seqs, 2 (k + 1) + 3] float64 (pinned on CUDA): tokens, logprobs, count, accepted, drafted
    done: torch.cuda.Event | None


class DeviceSpecLoop:
    """Drives the device-side speculation mode for an `LLMEngine` (single-process executor only)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        cfg = engine.config.speculative_config
        self.k = cfg.num_speculative_tokens
        self.nmin, self.nmax = cfg.prompt_lookup_min, cfg.prompt_lookup_max
        self.max_seqs = min(cfg.disable_by_batch_size, engine.config.scheduler_config.max_num_seqs)
        worker = engine.executor.driver_worker
        self.worker = worker
        self.device = worker.device
        self.block_size = engine.config.cache_config.block_size
        self.max_model_len = engine.config.scheduler_config.max_model_len
        width = engine.max_seq_len + 2 * (self.k + 1)  # a history row takes a whole step's tokens past the limit
        self.hist = torch.zeros((self.max_seqs, width), dtype=torch.long, device=self.device)
        self.lens = torch.zeros(self.max_seqs, dtype=torch.long, device=self.device)
        self.remaining = torch.zeros(self.max_seqs, dtype=torch.long, device=self.device)
        self.slot_of: dict[int, int] = {}  # seq_id → row of hist
        runner = worker.model_runner
        self.graph_runner = runner.graph_runner if self.device.type == "cuda" else None
        table_width = runner.table_width or cdiv(engine.max_seq_len, self.block_size)
        # Per-step inputs from the host (rows 0..n-1 used): slots, block tables, token capacity of the tables.
        self.idx = torch.zeros(self.max_seqs, dtype=torch.long, device=self.device)
        self.tables = torch.zeros((self.max_seqs, table_width), dtype=torch.int32, device=self.device)
        self.capacity = torch.zeros(self.max_seqs, dtype=torch.long, device=self.device)
        self._pin = self.device.type == "cuda"
        # Host staging, two of each: a step's copies may still be queued when the next step is staged (the one
        # before it has completed by then).
        self._host_idx_cap = [torch.zeros((2, self.max_seqs), dtype=torch.long, pin_memory=self._pin) for _ in range(2)]
        self._host_hist = [torch.zeros((self.max_seqs, width), dtype=torch.long, pin_memory=self._pin)
                           for _ in range(2)]  # an entering sequence's tokens
        self._host_tables = [torch.zeros((self.max_seqs, table_width), dtype=torch.int32, pin_memory=self._pin)
                             for _ in range(2)]
        self.drafts = torch.zeros((self.max_seqs, self.k), dtype=torch.long, device=self.device)
        self.num_real = torch.zeros(self.max_seqs, dtype=torch.long, device=self.device)
        q = self.k + 1
        self.out = torch.zeros((self.max_seqs, 2 * q + 3), dtype=torch.float64, device=self.device)
        # Two host copies of `out`: the step in flight and the one being read (same ring as the staging).
        self._host_out = [torch.zeros(self.out.shape, dtype=torch.float64, pin_memory=self._pin) for _ in range(2)]
        self._ring = 0
        self.lens.fill_(1)  # every index valid before a sequence takes the slot (graph warm-up)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, int, torch.cuda.CUDAGraph]] = {}
        if self.graph_runner is not None and self.graph_runner.graphs:
            self._capture()
        self.inflight: _DeviceStep | None = None
        self._unread: torch.cuda.Event | None = None  # a step drained without waiting for it
        self.num_steps = 0  # steps run in this mode (launched)
        self.num_entries = 0  # times the mode was entered
        self.num_entries_in_flight = 0  # of those, from an ordinary step still in flight
        self.num_admissions = 0  # prompt steps launched while the mode ran
        self.num_pool_fallbacks = 0  # times the pool could not hold the look-ahead blocks
        self._skip_steps = 0  # ordinary steps left before the mode is tried again (after a full pool)

    # -- eligibility --------------------------------------------------------------------------
    def _members(self, prev: LaunchedStep | None = None) -> list[tuple[SequenceGroup, Sequence]] | None:
        """The running sequences, when all may run in this mode; else None. `prev`: the ordinary step in flight
        (its sampled tokens are still on the device); a sequence whose last token it holds may enter, the token
        copied on the device."""
        eng, s = self.engine, self.engine.scheduler
        if s.waiting or s.swapped or eng._awaiting_grammar or not s.running:
            return None
        spec = eng.spec_decoder
        if not spec.small_batch() or not spec.mode_allows():
            return None
        sampled = prev.sampler_output.sampled_token_ids if prev is not None and prev.sampler_output else None
        members = []
        for group in s.running:
            if not _plain_greedy(group):
                return None
            p = group.sampling_params
            seq = group.seqs[0]
            if seq.is_finished():
                continue
            if seq.status != SequenceStatus.RUNNING:
                return None
            if seq.seq_id not in self.slot_of:
                if len(seq.output_token_ids) + seq.num_pending_tokens < p.min_tokens:
                    return None
                if seq.num_pending_tokens:  # its last token is prev's sample, not yet on the host
                    if seq.num_pending_tokens != 1 or sampled is None or seq.seq_id not in prev.row_of_seq:
                        return None
                elif not seq.output_token_ids:
                    return None
                if seq.num_uncomputed_tokens != 1:
                    return None
            members.append((group, seq))
        return members if 0 < len(members) <= self.max_seqs else None

    def _admit(self, outputs: list) -> None:
        """While the mode runs, launch the waiting prompts as an ordinary prefill-only step when every waiting
        request may join the mode: they enter it from that step in flight (`_members`), the running
        sequences' device state untouched."""
        eng, s = self.engine, self.engine.scheduler
        room = self.max_seqs - len(s.running)
        if (s.swapped or eng._awaiting_grammar or len(s.waiting) > room
                or not all(_plain_greedy(g) for g in s.waiting)):
            return
        sched = s.schedule_prompts(room)
        outputs.extend(eng._finish_ignored(g) for g in sched.ignored_groups)
        if sched.is_empty():
            return
        cur = eng._launch_forward(sched, None)
        eng._launch_sampling(cur)
        s.mark_computed(cur.scheduled)
        self.num_admissions += 1
        if cur.needs_host_results:
            outputs.extend(eng._complete_step(cur))
        else:
            eng._inflight = cur

    # -- the step -----------------------------------------------------------------------------
    def step(self, outputs: list) -> bool:
        """One engine step in this mode, its outputs appended to `outputs`. False when the mode does not apply
        (after draining it, if it was running): the caller then runs an ordinary step in the same call."""
        eng = self.engine
        if self.inflight is None and self._skip_steps:  # the pool was short of blocks lately: ordinary steps
            self._skip_steps -= 1
            return False
        if self.inflight is not None and eng.scheduler.waiting:
            self._admit(outputs)
        prev = eng._inflight  # an ordinary step in flight (its tokens still on the device)
        members = self._members(prev)
        if members is None:
            outputs.extend(self._drain())
            return False
        start = time.perf_counter()
        tokens_before = eng.num_generation_tokens_total
        if not self._reserve(members):
            # The ordinary scheduler takes over (it preempts if it must); the mode is retried a while later.
            self._skip_steps = _SKIP_AFTER_FULL_POOL
            self.num_pool_fallbacks += 1
            outputs.extend(self._drain())
            self._trim(members)  # (those given look-ahead blocks before the pool ran short)
            return False
        if self.inflight is None:
            self.num_entries += 1
            self.num_entries_in_flight += prev is not None
        eng._inflight = None
        launched = self._launch(members, prev)
        self.num_steps += 1
        done, self.inflight = self.inflight, launched
        if prev is not None:  # queued before this step, which reads its tokens on the device
            outputs.extend(eng._complete_step(prev))
        if done is not None:
            outputs.extend(self._complete(done))
        eng.spec_decoder.step_done(True, eng.num_generation_tokens_total - tokens_before,
                                   time.perf_counter() - start, True)
        return True

    def skips_host_drafts(self, sched) -> bool:
        """True when an ordinary step admits a prompt (or recomputes one): the mode resumes from that step while
        it is in flight, so host-side drafts would only make it synchronous."""
        return any(item.num_new_tokens > 1 or not item.seq.output_token_ids for item in sched.scheduled)

    def _reserve(self, members) -> bool:
        """Blocks for 2 (k + 1) tokens past the host's view of each sequence (copy-on-write copies run now)."""
        bm = self.engine.scheduler.block_manager
        limit = self.engine.max_seq_len
        for _, seq in members:
            want = min(seq.num_computed_tokens + 2 * (self.k + 1), limit) - seq.num_computed_tokens
            need = bm.num_blocks_to_grow(seq, want)
            if need and not bm.can_allocate(need, for_new_request=True):
                return False
            copies = bm.allocate_slots(seq, want)
            if copies:
                self.worker.cache_engine.copy(copies)
        return True

    def _enter(self, group: SequenceGroup, seq: Sequence, ring: int, prev: LaunchedStep | None) -> int:
        """A row of `hist` for a sequence entering the mode: its host tokens (staged in pinned memory), then the
        token `prev` sampled for it when that is still on the device."""
        used = set(self.slot_of.values())
        slot = next(i for i in range(self.max_seqs) if i not in used)
        self.slot_of[seq.seq_id] = slot
        ids = seq.token_ids
        n = len(ids)
        staged = self._host_hist[ring]
        staged.numpy()[slot, :n] = ids
        self.hist[slot, :n].copy_(staged[slot, :n], non_blocking=self._pin)
        if seq.num_pending_tokens:
            row = prev.row_of_seq[seq.seq_id]
            self.hist[slot, n : n + 1].copy_(prev.sampler_output.sampled_token_ids[row : row + 1])
            n += 1
        self.lens[slot] = n
        known = len(seq.output_token_ids) + seq.num_pending_tokens
        left = min(group.extra["max_tokens"] - known, self.engine.max_seq_len - n)
        self.remaining[slot] = max(0, left)
        return slot

    # -- the device work of one step: before the forward pass, and after it ---------------------
    def _pre(self, n: int):
        """Drafts and decode rows for the sequences in slots idx[:n] (device ops only)."""
        idx = self.idx[:n]
        hist, lens = self.hist.index_select(0, idx), self.lens.index_select(0, idx)
        drafts, num_real = propose_ngrams(hist, lens, self.k, self.nmin, self.nmax)
        self.drafts[:n].copy_(drafts)
        self.num_real[:n].copy_(num_real)
        last = hist.gather(1, (lens - 1)[:, None]).squeeze(1)
        return build_rows(last, drafts, lens, self.tables[:n], self.capacity[:n], self.block_size, self.max_model_len)

    def _post(self, n: int, logits: torch.Tensor) -> None:
        """Greedy acceptance, the history appended, and the step's results packed into `out` (device ops only)."""
        idx = self.idx[:n]
        tokens, logprobs, count, accepted = accept_greedy(logits, self.drafts[:n], self.remaining.index_select(0, idx))
        append_history(self.hist, self.lens, idx, tokens, count)
        self.remaining.index_add_(0, idx, -count)
        num_real = self.num_real[:n]
        self.out[:n].copy_(torch.cat([tokens.double(), logprobs.double(), count[:, None].double(),
                                      torch.minimum(accepted, num_real)[:, None].double(),
                                      num_real[:, None].double()], dim=1))

    def _pre_kernel(self, n: int) -> int:
        """CUDA: `_pre` in one kernel, the rows written straight into the decode graph's static buffers; → the
        bucket to replay."""
        from pagedllm.kernels.triton_ngram import propose_rows

        gr = self.graph_runner
        b = gr.bucket(n * (self.k + 1))
        propose_rows(self.hist, self.lens, self.idx[:n], self.tables[:n], self.capacity[:n], self.k, self.nmin,
                     self.nmax, self.block_size, self.max_model_len, self.drafts[:n], self.num_real[:n],
                     gr.input_ids, gr.positions, gr.slot_mapping, gr.seq_lens, gr.block_tables, b)
        return b

    def _post_kernel(self, n: int, logits: torch.Tensor) -> None:
        """CUDA: `_post` in two kernels (the argmax the plain greedy sampler takes, then acceptance)."""
        from pagedllm.kernels.triton_greedy import greedy_sample_with_logprob
        from pagedllm.kernels.triton_ngram import accept_append

        pred, logprob = greedy_sample_with_logprob(logits)
        accept_append(pred, logprob, self.drafts[:n], self.num_real[:n], self.idx[:n], self.hist, self.lens,
                      self.remaining, self.out)

    @torch.inference_mode()
    def _capture(self) -> None:
        """CUDA: per sequence count, `_pre_kernel` (ending in the decode graph's static buffers) and
        `_post_kernel` (from its output) as two graphs around the decode graph's bucket: a step is three replays."""
        gr = self.graph_runner
        q = self.k + 1
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        model = self.worker.model_runner.model
        for n in range(1, self.max_seqs + 1):
            if n * q > gr.max_batch:
                break
            for _ in range(2):  # warm-up: kernels loaded, allocator cached (no KV is written: nothing replays)
                b = self._pre_kernel(n)
                self._post_kernel(n, model.compute_logits(gr.outputs[b][: n * q]))
            torch.cuda.synchronize(self.device)
            pre, post = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(pre, pool=pool):
                b = self._pre_kernel(n)
            with torch.cuda.graph(post, pool=pool):
                self._post_kernel(n, model.compute_logits(gr.outputs[b][: n * q]))
            self.graphs[n] = (pre, b, post)
        torch.cuda.synchronize(self.device)
        self.hist.zero_()
        self.lens.fill_(1)
        self.remaining.zero_()
        logger.info("ngram_gpu: captured proposal and acceptance graphs for 1..%d sequences in %.2f s",
                    len(self.graphs), time.perf_counter() - t0)

    @torch.inference_mode()
    def _launch(self, members, prev: LaunchedStep | None) -> _DeviceStep:
        if self._unread is not None:  # a dropped step's staging buffers are reused below
            self._unread.synchronize()
            self._unread = None
        ring = self._ring
        self._ring ^= 1
        live = {seq.seq_id for _, seq in members}
        for sid in [s for s in self.slot_of if s not in live]:  # finished, aborted or preempted meanwhile
            del self.slot_of[sid]
        slots = [self.slot_of[seq.seq_id] if seq.seq_id in self.slot_of else self._enter(g, seq, ring, prev)
                 for g, seq in members]
        n = len(members)
        bm = self.engine.scheduler.block_manager
        staged_ic, staged_tables = self._host_idx_cap[ring], self._host_tables[ring]
        host_ic, host_tables = staged_ic.numpy(), staged_tables.numpy()
        host_tables[:n] = 0
        for i, (_, seq) in enumerate(members):
            t = bm.get_block_table(seq)
            fill_block_table_row(host_tables[i], t)
            host_ic[0, i] = slots[i]
            host_ic[1, i] = len(t) * self.block_size
        self.idx[:n].copy_(staged_ic[0, :n], non_blocking=self._pin)
        self.capacity[:n].copy_(staged_ic[1, :n], non_blocking=self._pin)
        self.tables[:n].copy_(staged_tables[:n], non_blocking=self._pin)
        graphs = self.graphs.get(n)
        if graphs is not None:
            pre, b, post = graphs
            pre.replay()
            self.graph_runner.graphs[b].replay()
            post.replay()
        else:
            runner = self.worker.model_runner
            self._post(n, runner.run_decode_rows(self._pre(n), self.worker.cache_engine.gpu_cache))
        host_out = self._host_out[ring]
        host_out[:n].copy_(self.out[:n], non_blocking=self._pin)
        done = None
        if self._pin:
            done = torch.cuda.Event()
            done.record()
        return _DeviceStep(members, host_out, done)

    def _complete(self, step: _DeviceStep) -> list:
        """Wait for a launched step and hand its tokens to the host's sequences; → outputs."""
        eng = self.engine
        if step.done is not None:
            step.done.synchronize()
        out = step.host_out[: len(step.members)].tolist()
        q = self.k + 1
        touched: dict[str, SequenceGroup] = {}
        bm = eng.scheduler.block_manager
        stats = eng.spec_decoder.stats
        stats.num_spec_steps += 1
        now = time.monotonic()
        for (group, seq), row in zip(step.members, out):
            if seq.is_finished():  # stopped by the step before, or aborted
                continue
            count, accepted, drafted = int(row[2 * q]), int(row[2 * q + 1]), int(row[2 * q + 2])
            if drafted:
                stats.record(drafted, accepted)
            if group.first_token_time is None:
                group.first_token_time = now
            for j in range(count):
                eng.output_processor.append_token(group, seq, int(row[j]), row[q + j], None)
                eng.num_generation_tokens_total += 1
                if seq.is_finished():
                    break
            touched[group.request_id] = group
            if not seq.is_finished():
                seq.num_computed_tokens = seq.get_len() - 1
                bm.cache_computed_blocks(seq)
        return eng._outputs_of(touched)

    def _drain(self) -> list:
        """Complete the step in flight and leave the mode: every sequence's blocks trimmed to its tokens."""
        step, self.inflight = self.inflight, None
        if step is not None and all(seq.is_finished() for _, seq in step.members):
            # Nothing in it for the host (its sequences stopped in the step before): no need to wait for it.
            self._unread, step = step.done, None
        outputs = self._complete(step) if step is not None else []
        self._trim(step.members if step is not None else [])
        self.slot_of.clear()
        return outputs

    def _trim(self, members) -> None:
        """Give back the look-ahead blocks: each running sequence keeps those its tokens occupy."""
        bm = self.engine.scheduler.block_manager
        for _, seq in members:
            if seq.is_finished() or seq.seq_id not in bm.block_tables:
                continue
            bm.truncate(seq, cdiv(seq.get_len(), self.block_size))
