"""Engine side of speculative decoding: per step, pick the sequences that speculate, give their drafts
slots, and after the target's pass verify, append and roll back.

Per step: off when more sequences run than `disable_by_batch_size` (decode is no longer memory-bound,
so verifying k+1 tokens per sequence costs real compute), and off for a sequence whose recent acceptance
is low (it retries after `cooldown_steps`). Among the rest, the `goodput` policy (draft_length.py) verifies
the draft tokens that raise the step's expected tokens per second, from the measured time of decode steps
by their number of query rows and each sequence's recent acceptance. A sequence speculates only when it
is decoding one token whose input is on the host (not pending on the device), is not beam search and has
no logit_bias / allowed_token_ids / bad_words, and its k draft slots fit in the pool (leaving the watermark
free: speculation never preempts anyone) and in the step's token budget.

A grammar-constrained sequence speculates too (vLLM's structured outputs with speculative decoding): its
drafts are cut to the prefix its grammar accepts, and each verification row is masked with the grammar's
bitmask at that point (the matcher advanced over the drafts before it, then rolled back), so verification
sees exactly the distributions plain constrained decoding samples from.

Rollback: the scheduler already counted the sequence's one decode token; verification sets
`num_computed_tokens` to the tokens whose KV is now valid (the old ones plus the accepted drafts),
frees the blocks that held only rejected tokens, and only then hashes newly full blocks for prefix
caching, so a rejected token never reaches the prefix cache.
"""
from __future__ import annotations

import logging
import time

import torch

from pagedllm.config import SpeculativeConfig
from pagedllm.core.block_manager import cdiv
from pagedllm.core.scheduler import ScheduledSequence, Scheduler, SchedulerOutputs
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.model.layers.logits_ops import apply_token_bitmask_
from pagedllm.model.layers.sampler import SamplingRow
from pagedllm.spec_decode.draft_length import StepCostModel, choose_draft_lengths
from pagedllm.spec_decode.metrics import SpecDecodeStats
from pagedllm.spec_decode.mode import SpecModeChooser
from pagedllm.spec_decode.ngram_proposer import NgramProposer
from pagedllm.spec_decode.rejection_sampler import VerifyResult, is_greedy, verify
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.worker.model_input import SequenceChunk

logger = logging.getLogger("pagedllm")

_EMA = 0.5  # weight of the newest step in a sequence's acceptance average
_FIRST_PRIOR = 0.6  # a first draft token's acceptance before any was verified
_BACK_TO_PRIOR = 0.1  # per step a sequence does not speculate, its average moves this far toward the global rate
# Every this many speculative steps, the goodput policy verifies every proposed token, so the step-cost model
# keeps measuring the larger row counts it would otherwise stop choosing (one slow measurement of a row
# count could keep it looking expensive forever).
_EXPLORE_EVERY = 16


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, scheduler: Scheduler, executor, max_seq_len: int,
                 async_steps: bool = False, structured_output: StructuredOutputManager | None = None) -> None:
        """`async_steps`: the engine schedules asynchronously, so not speculating also means overlapping the
        host with the device; the engine then measures both modes and runs the faster (spec_decode/mode.py).
        `structured_output`: the engine's grammar manager; constrained sequences speculate through it."""
        self.config = config
        self.structured_output = structured_output
        # seq_id → the grammar masks of this step's verification rows (constrained sequences that speculate)
        self._grammar_masks: dict[int, torch.Tensor] = {}
        self.scheduler = scheduler
        self.max_seq_len = max_seq_len
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        self.step_cost = StepCostModel()
        # A draft model's seconds per pass (one draft position for every sequence drafting), by how many sequences
        # draft: the goodput rule weighs them with the target's rows (draft_length.choose_draft_lengths).
        self.draft_cost = StepCostModel()
        self._timing: tuple[int, float] | None = None  # (query rows, start) of a decode-only step in flight
        self._num_choices = 0  # goodput choices made (every _EXPLORE_EVERY-th verifies every proposal)
        if config.method in ("ngram", "ngram_gpu"):
            self.ngram = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                       config.prompt_lookup_max)
            self.draft = None
        elif config.model is not None:
            from pagedllm.spec_decode.draft_checkpoint import DraftCheckpointProposer

            self.ngram = None
            self.draft = DraftCheckpointProposer(executor, scheduler.block_manager)
            logger.info("Draft checkpoint %s: %d tokens per step", config.model, config.num_speculative_tokens)
        else:
            from pagedllm.spec_decode.draft_model_proposer import DraftModelProposer

            self.ngram = None
            self.draft = DraftModelProposer(executor, config.draft_num_layers)
            logger.info("Self-speculation: %d draft layers, %d tokens per step", self.draft.num_layers,
                        config.num_speculative_tokens)
        # Speculating or plain steps, by measured tokens per second (spec_decode/mode.py): where plain steps are
        # asynchronous, and wherever drafts cost a model's passes, whose every cost the goodput rule's model does
        # not see (a draft as costly as the target ran at 0.70-0.81x of plain decoding without it, §88.6).
        self.mode = SpecModeChooser() if async_steps or self.draft is not None else None

    def small_batch(self) -> bool:
        """At most `disable_by_batch_size` sequences running or waiting: speculation is worth considering."""
        s = self.scheduler
        return sum(g.num_unfinished_seqs() for g in s.running) + len(s.waiting) <= self.config.disable_by_batch_size

    def mode_allows(self) -> bool:
        """False while plain asynchronous steps measure faster than speculation (spec_decode/mode.py)."""
        return self.mode is None or self.mode.speculate()

    def step_done(self, speculated: bool, tokens: int, seconds: float, small_batch: bool) -> None:
        """An engine step ended (`speculated`: it ran in speculation mode, synchronously where `worth_syncing`
        said so; `small_batch`: it began with few enough sequences to speculate): small-batch steps feed the
        mode choice."""
        if self.mode is None or not small_batch:
            return
        if not speculated and not self.mode.speculate():
            self.stats.num_steps_off_by_rate += 1
        self.mode.record(speculated, tokens, seconds)

    def worth_syncing(self) -> bool:
        """Whether the engine should wait for the step in flight so that this step can speculate. With n-gram
        drafts: only when some running sequence that may speculate already matches earlier text in the tokens
        the host has (one step behind the device). A copied span is found one token late; outside one (most
        steps of ordinary text, or every sequence in its cooldown) steps stay asynchronous instead of waiting
        on the device to propose nothing (BENCHMARKS §30)."""
        if self.ngram is None:
            return True
        for group in self.scheduler.running:
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                if self._may_speculate(seq, group) and self.ngram.propose(seq.token_ids, 1):
                    return True
        return False

    def _may_speculate(self, seq: Sequence, group: SequenceGroup) -> bool:
        """The sequence decodes, is not beam search, has no logit_bias, allowed_token_ids or bad_words (a grammar
        is fine: its drafts are checked and its verification rows masked, see `plan`), and is not in an
        acceptance cooldown.

        The cooldown holds only where steps are asynchronous, or drafts are verified whatever they cost (the
        "fixed" policy). A synchronous engine with the goodput rule already weighs each sequence's recent
        acceptance against the measured cost of its rows every step, and a cooled-down sequence there only
        lost the spans it would have copied (float32 CPU, up to 4 concurrent: 1.39× → 1.56× of plain decoding
        without it, BENCHMARKS.md §42.4); on an asynchronous engine not speculating also keeps the steps
        overlapped."""
        if not seq.output_token_ids or "beam" in group.extra or group.sampling_params.has_logit_adjustments:
            return False
        if "structured_output" in group.extra and (self.structured_output is None or not group.may_sample):
            return False
        if self.mode is None and self.config.draft_length_policy == "goodput":
            return True
        return len(seq.output_token_ids) >= seq.extra.get("spec_resume_at", 0)

    def _eligible(self, item: ScheduledSequence) -> bool:
        seq = item.seq
        if item.num_new_tokens != 1 or not item.completes or seq.num_pending_tokens:
            return False
        return self._may_speculate(seq, item.group)

    def _max_k(self, item: ScheduledSequence) -> int:
        seq = item.seq
        left = item.group.extra["max_tokens"] - len(seq.output_token_ids) - 1  # the bonus token is extra
        k = min(self.config.num_speculative_tokens, left, self.max_seq_len - 1 - seq.get_len())
        if self.config.model is not None:  # a draft checkpoint with a shorter context than the target's
            k = min(k, self.draft.max_drafts(seq))
        return max(0, k)

    def plan(self, sched: SchedulerOutputs) -> dict[int, list[int]]:
        """Drafts (seq_id → tokens) for this step; their slots are allocated here (CoW copies appended)."""
        num_seqs = len(sched.scheduled)
        self._timing = None
        if num_seqs == 0 or num_seqs > self.config.disable_by_batch_size:
            if num_seqs:
                self.stats.num_steps_off_by_batch += 1
            return {}
        bm = self.scheduler.block_manager
        token_room = self.scheduler.max_num_batched_tokens - sched.num_batched_tokens
        start = time.perf_counter()
        self._grammar_masks = {}
        candidates: list[tuple[ScheduledSequence, int, list[int]]] = []
        for item in sched.scheduled:
            if not self._eligible(item):
                continue
            k = min(self._max_k(item), token_room)
            if k <= 0:
                continue
            drafts = self.ngram.propose(item.seq.token_ids, k) if self.ngram is not None else []
            if self.ngram is not None and "structured_output" in item.group.extra:
                drafts = self._grammar_drafts(item, drafts, k)
            if self.ngram is not None and not drafts:
                continue
            candidates.append((item, len(drafts) if drafts else k, drafts))
        lengths = self._draft_lengths(sched, candidates)
        chosen: list[tuple[ScheduledSequence, int, list[int]]] = []
        for (item, _, drafts), k in zip(candidates, lengths):
            k = min(k, token_room)
            if k <= 0:
                continue
            need = bm.num_blocks_to_grow(item.seq, 1 + k)
            if not bm.can_allocate(need, for_new_request=True):
                continue
            sched.blocks_to_copy.extend(bm.allocate_slots(item.seq, 1 + k))
            token_room -= k
            sched.num_batched_tokens += k
            chosen.append((item, k, drafts[:k]))
        decode_only = all(it.num_new_tokens == 1 for it in sched.scheduled)
        self._timing = (sched.num_batched_tokens, start) if decode_only else None
        if self.draft is not None and chosen:
            drafting = time.perf_counter()
            if self.config.model is not None:  # a draft checkpoint: its own pool, which the step's moves do not touch
                proposals = self.draft.propose([it.seq for it, _, _ in chosen], [k for _, k, _ in chosen])
            else:
                chunks = [SequenceChunk(it.seq.seq_id, [it.seq.last_token_id], it.seq.num_computed_tokens,
                                        list(bm.get_block_table(it.seq)), sample=True) for it, _, _ in chosen]
                if sched.blocks_to_copy or sched.blocks_to_swap_in or sched.blocks_to_swap_out:
                    # The draft reads the cache before the step's block moves would run: do them first.
                    self.scheduler_moves(sched)
                proposals = self.draft.propose(chunks, [k for _, k, _ in chosen])
            chosen = [(it, k, self._grammar_prefix(it, p, keep_one=True) if "structured_output" in it.group.extra
                       else p) for (it, k, _), p in zip(chosen, proposals)]
            seconds = time.perf_counter() - drafting
            passes = self.draft.pass_seconds  # (one token per sequence each: a checkpoint's catch-up pass left out)
            if passes:
                self.draft_cost.record(len(chosen), sum(passes) / len(passes))
            if self._timing is not None:  # the step-cost model times the target's step: drafting left out
                self._timing = (self._timing[0], self._timing[1] + seconds)
        if chosen:
            self.stats.num_spec_steps += 1
        return {it.seq.seq_id: drafts for it, _, drafts in chosen}

    def _grammar_drafts(self, item: ScheduledSequence, proposed: list[int], k: int) -> list[int]:
        """A constrained sequence's n-gram drafts: the longer of two candidates' prefixes that its grammar accepts,
        the n-gram proposal and the continuation the grammar forces (JSON keys and punctuation, xgrammar's
        jump-forward tokens) followed by the n-gram proposal from its end."""
        seq, compiled = item.seq, item.group.extra["structured_output"]
        forced = self.structured_output.forced_tokens(seq, compiled)[:k]
        if forced and len(forced) < k:
            forced += self.ngram.propose(seq.token_ids + forced, k - len(forced))
        best: list[int] = []
        for candidate in (proposed, forced):
            if len(candidate) > len(best):
                drafts = self._grammar_prefix(item, candidate)
                if len(drafts) > len(best):
                    best, masks = drafts, self._grammar_masks[seq.seq_id]
        if best:
            self._grammar_masks[seq.seq_id] = masks
        else:
            self._grammar_masks.pop(seq.seq_id, None)
        return best

    def _grammar_prefix(self, item: ScheduledSequence, drafts: list[int], keep_one: bool = False) -> list[int]:
        """A constrained sequence's drafts cut to what its grammar accepts, and the masks of their verification
        rows kept for `verify_seq`. `keep_one` (the draft model's tokens, whose slots are already allocated): a
        first draft the grammar rejects stays, and the masked target rejects it."""
        res = self.structured_output.draft_masks(item.seq, item.group.extra["structured_output"], drafts)
        if res is None:  # its grammar ended or broke: it stops with this step's token
            return drafts if keep_one else []
        n, masks = res
        if n == 0 and keep_one:
            n = 1  # its row (after a rejected draft) is never reached: any mask will do
            masks = torch.cat([masks, torch.full_like(masks, -1)])
        self._grammar_masks[item.seq.seq_id] = masks
        return drafts[:n]

    def _draft_lengths(self, sched: SchedulerOutputs,
                       candidates: list[tuple[ScheduledSequence, int, list[int]]]) -> list[int]:
        """Draft tokens per candidate: all proposed ("fixed"), or the goodput choice."""
        max_lengths = [k for _, k, _ in candidates]
        if self.config.draft_length_policy == "fixed" or not candidates:
            return max_lengths
        self._num_choices += 1
        if self._num_choices % _EXPLORE_EVERY == 0:
            return max_lengths
        st = self.stats
        # rate[j]: P(draft positions 0..j all accepted | position j drafted), engine-wide.
        rate = [a / d if d else None for a, d in zip(st.accepted_per_pos, st.drafted_per_pos)]
        prior = rate[0] if rate and rate[0] is not None else _FIRST_PRIOR
        # P(position j + 1 accepted | 0..j accepted); an unknown depth counts as the first position's rate.
        depth = [rate[j + 1] / rate[j] if rate[j] and rate[j + 1] is not None else prior
                 for j in range(len(rate) - 1)]
        rates = [it.seq.extra.get("spec_first", prior) for it, _, _ in candidates]
        base_tokens = sum(1 for it in sched.scheduled if it.completes)
        draft_seconds = self.draft_cost.estimate(len(candidates)) if self.draft is not None else None
        lengths = choose_draft_lengths(sched.num_batched_tokens, base_tokens, rates, max_lengths,
                                       self.step_cost.estimate, depth, draft_seconds or 0.0)
        for (it, _, _), k, rate in zip(candidates, lengths, rates):
            if k == 0:  # not worth it now: drift back toward the engine-wide rate, to be tried again later
                it.seq.extra["spec_first"] = rate + _BACK_TO_PRIOR * (prior - rate)
        return lengths

    def step_finished(self) -> None:
        """The step planned last has completed on the host: its time joins the step-cost model."""
        if self._timing is not None:
            rows, start = self._timing
            self.step_cost.record(rows, time.perf_counter() - start)
            self._timing = None

    def scheduler_moves(self, sched: SchedulerOutputs) -> None:
        """Run the step's swap/copy block moves now (the draft reads the cache before the step runs)."""
        ce = self.draft.worker.cache_engine
        ce.swap_out(sched.blocks_to_swap_out)  # the worker's order
        ce.swap_in(sched.blocks_to_swap_in)
        ce.copy(sched.blocks_to_copy)
        sched.blocks_to_swap_in, sched.blocks_to_swap_out, sched.blocks_to_copy = [], [], []

    @staticmethod
    def plain_greedy(item: ScheduledSequence) -> bool:
        """Greedy with raw logits (no penalty, no min_tokens ban, no top logprobs): verified in one batch."""
        p = item.group.sampling_params
        return ("structured_output" not in item.group.extra and is_greedy(p) and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
                and len(item.seq.output_token_ids) >= p.min_tokens and p.logprobs is None)

    def verify_seq(self, item: ScheduledSequence, drafts: list[int], logits: torch.Tensor,
                   eos_token_ids: tuple[int, ...], greedy: list[int] | None = None) -> VerifyResult:
        """Accept a prefix of `drafts` for one sequence from its k+1 target rows (`greedy`: their argmax,
        already on the host, for plain greedy sequences)."""
        seq, params = item.seq, item.group.sampling_params
        masks = self._grammar_masks.pop(seq.seq_id, None)
        if masks is not None:  # row i: the grammar's mask after drafts[:i], as plain decoding would apply it
            apply_token_bitmask_(logits, masks, list(range(len(drafts) + 1)))
        if greedy is not None:
            n = 0
            while n < len(drafts) and drafts[n] == greedy[n]:
                n += 1
            res = VerifyResult(drafts[:n] + [greedy[n]], n)
        else:
            out = seq.output_token_ids
            rows = [SamplingRow(params, seq.prompt_token_ids, out + drafts[:i], eos_token_ids=eos_token_ids)
                    for i in range(len(drafts) + 1)]
            res = verify(logits, rows, drafts, generator=seq.extra.get("generator"))
        self.stats.record(len(drafts), res.num_accepted)
        first = seq.extra.get("spec_first", _FIRST_PRIOR)
        seq.extra["spec_first"] = first + _EMA * (float(res.num_accepted > 0) - first)
        rate = res.num_accepted / len(drafts)
        ema = seq.extra.get("spec_ema", 1.0) * (1 - _EMA) + rate * _EMA
        seq.extra["spec_ema"] = ema
        if ema < self.config.min_acceptance_rate:
            seq.extra["spec_resume_at"] = len(seq.output_token_ids) + self.config.cooldown_steps
            seq.extra["spec_ema"] = 1.0  # a fresh start after the cooldown
        return res

    def roll_back(self, item: ScheduledSequence, num_kv_valid: int) -> None:
        """After the accepted tokens were appended: the KV of the first `num_kv_valid` tokens is valid;
        drop blocks holding only rejected drafts, then hash newly full blocks."""
        seq = item.seq
        seq.num_computed_tokens = num_kv_valid
        bm = self.scheduler.block_manager
        if seq.seq_id not in bm.block_tables:  # finished and freed
            return
        bm.truncate(seq, cdiv(num_kv_valid, bm.block_size))
        if self.config.model is not None:
            self.draft.accepted(seq, num_kv_valid)
        bm.cache_computed_blocks(seq)
