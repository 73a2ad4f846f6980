"""Sampled tokens → sequences: append, fork for parallel sampling, stop checks, detokenize, outputs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.engine import beam_search
from pagedllm.logprobs import Logprob
from pagedllm.outputs import (CompletionOutput, DeltaState, PoolingOutput, PoolingRequestOutput,
                              RequestOutput)
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.tokenizer import IncrementalDetokenizer


@dataclass
class StopConfig:
    """Engine-wide facts the stop checks need."""

    eos_token_ids: tuple[int, ...]
    max_model_len: int


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, tokenizer: Any, stop_config: StopConfig, new_seq_id,
                 structured_output: Any = None) -> None:
        self.scheduler = scheduler
        self.structured_output = structured_output  # StructuredOutputManager: grammar matchers per sequence
        self.tokenizer = tokenizer
        self.stop_config = stop_config
        self._new_seq_id = new_seq_id  # callable → fresh int
        self._token_texts: dict[int, str] = {}  # token id → its text alone (bounded by the vocabulary)

    # -- per-sequence state -----------------------------------------------------------------
    def init_sequence(self, seq: Sequence, params: Any) -> None:
        if self.tokenizer is not None and params.detokenize:
            seq.extra["detok"] = IncrementalDetokenizer(
                self.tokenizer,
                seq.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop or None,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )

    def fork(self, group: SequenceGroup, parent: Sequence, make_generator) -> Sequence:
        child = parent.fork(self._new_seq_id())
        self.scheduler.block_manager.fork(parent, child)
        if "structured_output" in group.extra:
            self.structured_output.fork(parent, child)
        self.init_sequence(child, group.sampling_params)
        detok = child.extra.get("detok")
        if detok is not None and parent.output_token_ids:
            detok.append(list(parent.output_token_ids))
        child.extra["generator"] = make_generator(len(group.seqs))
        group.seqs.append(child)
        return child

    # -- beam search ------------------------------------------------------------------------
    def beam_step(self, group: SequenceGroup, parents: list[Sequence], logprobs: torch.Tensor) -> None:
        """One beam-search step for a group whose running beams were all sampled (rows in order)."""
        ctx = beam_search.BeamContext(
            self.scheduler.block_manager,
            self._new_seq_id,
            self.stop_config.eos_token_ids,
            self.stop_config.max_model_len,
            self._stop_string_finder(group.sampling_params),
        )
        beam_search.beam_step(group, parents, logprobs, ctx)

    def _stop_string_finder(self, params):
        """For beams: output token ids → the first stop string their text contains (beams are not
        detokenized incrementally, since they fork and die every step)."""
        if not params.stop or self.tokenizer is None or not params.detokenize:
            return None
        tokenizer, stops, skip = self.tokenizer, list(params.stop), params.skip_special_tokens

        def find(token_ids: list[int]) -> str | None:
            text = tokenizer.decode(token_ids, skip_special_tokens=skip)
            return next((s for s in stops if s in text), None)

        return find

    def _beam_text(self, group: SequenceGroup, seq: Sequence) -> str:
        """Beams skip incremental detokenization while they run (they fork and die every step)."""
        if seq.is_finished():
            if "beam_detok" not in seq.extra:
                self.init_sequence(seq, group.sampling_params)
                detok = seq.extra.pop("detok", None)
                if detok is not None and detok.append(list(seq.output_token_ids)).stop_str_matched is None:
                    detok.flush()
                seq.extra["beam_detok"] = detok
            detok = seq.extra["beam_detok"]
            return detok.output_text if detok is not None else ""
        params = group.sampling_params
        if self.tokenizer is None or not params.detokenize:
            return ""
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=params.skip_special_tokens)

    # -- log-probs' token texts --------------------------------------------------------------
    def name_logprobs(self, params: Any, entries: dict[int, Logprob]) -> None:
        """Set each entry's `decoded_token` (the token's text alone, as vLLM's) when the request detokenizes."""
        if self.tokenizer is None or not params.detokenize:
            return
        texts = self._token_texts
        for tid, entry in entries.items():
            if entry.decoded_token is None:
                text = texts.get(tid)
                if text is None:
                    text = texts[tid] = self.tokenizer.decode([tid])
                entry.decoded_token = text

    # -- appending tokens -------------------------------------------------------------------
    def append_token(
        self, group: SequenceGroup, seq: Sequence, token_id: int, logprob: float, top: dict[int, Logprob] | None
    ) -> None:
        seq.append_token(token_id, logprob)
        if top is not None:
            self.name_logprobs(group.sampling_params, top)
            seq.output_logprobs.append(top)
        detok = seq.extra.get("detok")
        stop_str = None
        # As vLLM: a token that ends the sequence (EOS, stop_token_ids) is in token_ids, not in the text, unless
        # include_stop_str_in_output (it shows with skip_special_tokens=False, or when it is an ordinary token).
        stop_token = self._stops_on_token(group, seq, token_id)
        if detok is not None and (group.sampling_params.include_stop_str_in_output or not stop_token):
            stop_str = detok.append([token_id]).stop_str_matched
        self._check_stop(group, seq, token_id, stop_str, stop_token)
        grammar = group.extra.get("structured_output")  # the compiled grammar
        if grammar is not None:
            # The grammar reached its end (its stop token accepted, even under ignore_eos) or was broken.
            if self.structured_output.accept(seq, grammar) and not seq.is_finished():
                seq.status = SequenceStatus.FINISHED_STOPPED
        if seq.is_finished():
            self.scheduler.free_seq(seq)
            if detok is not None and stop_str is None:
                detok.flush()

    def _stops_on_token(self, group: SequenceGroup, seq: Sequence, token_id: int) -> bool:
        """Whether `token_id`, just appended, ends `seq` as an EOS or one of the request's stop_token_ids."""
        params = group.sampling_params
        if len(seq.output_token_ids) < params.min_tokens:
            return False
        return (not params.ignore_eos and token_id in self.stop_config.eos_token_ids) \
            or token_id in (params.stop_token_ids or ())

    def _check_stop(self, group: SequenceGroup, seq: Sequence, token_id: int, stop_str: str | None,
                    stop_token: bool) -> None:
        """Finish `seq` on a matched stop string, a stop token (`stop_token`: _stops_on_token), max_tokens or the
        model's length."""
        params = group.sampling_params
        n_out = len(seq.output_token_ids)
        if stop_str is not None:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop_str
            return
        if stop_token:
            eos = not params.ignore_eos and token_id in self.stop_config.eos_token_ids
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, None if eos else token_id
            return
        if n_out >= group.extra["max_tokens"] or seq.get_len() >= self.stop_config.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    # -- building outputs -------------------------------------------------------------------
    def make_output(self, group: SequenceGroup) -> RequestOutput | PoolingRequestOutput | None:
        """The group's output now: cumulative, or for a ``RequestOutputKind.DELTA`` request what is new since its
        last output (None when nothing is and it is not finished)."""
        if "pooling" in group.extra:
            return self._pooling_output(group)
        params = group.sampling_params
        finished = group.is_finished()
        if params.output_kind == RequestOutputKind.DELTA:
            return self._delta_output(group, finished)
        seqs = list(group.seqs)
        n = params.n
        is_beam = "beam" in group.extra
        if is_beam:
            seqs = beam_search.output_seqs(group, n)
            if params.logprobs is not None:
                for seq in seqs:
                    for entries in seq.output_logprobs:
                        self.name_logprobs(params, entries)
        elif finished and len(seqs) > n:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:n]
        outputs = []
        for i, seq in enumerate(seqs):
            if is_beam:
                text = self._beam_text(group, seq)
            else:
                detok = seq.extra.get("detok")
                text = detok.output_text if detok is not None else ""
            outputs.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.output_logprobs) if params.logprobs is not None else None,
                    finish_reason=seq.status.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return self._request_output(group, outputs, finished, group.extra.get("prompt_logprobs"))

    def _delta_output(self, group: SequenceGroup, finished: bool) -> RequestOutput | None:
        """Each completion's new tokens, text and logprobs since the last output: O(new) per step, where a
        cumulative output copies every token so far. (DELTA excludes beam search and best_of > n, whose
        completions are chosen only at the end: SamplingParams refuses them.)"""
        state = group.extra.get("delta")
        if state is None:
            state = group.extra["delta"] = DeltaState()
        wants_logprobs = group.sampling_params.logprobs is not None
        outputs = []
        for i, seq in enumerate(group.seqs):
            detok = seq.extra.get("detok")
            comp = state.cursor(i).take(i, seq.output_token_ids, detok.output_text if detok is not None else "",
                                        seq.cumulative_logprob, seq.output_logprobs if wants_logprobs else None,
                                        seq.status.finish_reason, seq.stop_reason)
            if comp is not None:
                outputs.append(comp)
        if not outputs and not finished:
            return None
        return self._request_output(group, outputs, finished, state.prompt_logprobs(group.extra.get("prompt_logprobs")))

    @staticmethod
    def _request_output(group: SequenceGroup, outputs: list[CompletionOutput], finished: bool,
                        prompt_logprobs: Any) -> RequestOutput:
        metrics = {
            "arrival_time": group.arrival_time,
            "first_scheduled_time": group.first_scheduled_time,
            "first_token_time": group.first_token_time,
        }
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=group.num_cached_tokens,
            metrics=metrics,
            lora_request=group.extra.get("lora_request"),
        )

    @staticmethod
    def _pooling_output(group: SequenceGroup) -> PoolingRequestOutput:
        metrics = {"arrival_time": group.arrival_time, "first_scheduled_time": group.first_scheduled_time,
                   "first_token_time": group.first_token_time}
        return PoolingRequestOutput(request_id=group.request_id, outputs=PoolingOutput(group.extra["pooling"].result),
                                    prompt_token_ids=group.prompt_token_ids, finished=group.is_finished(),
                                    prompt=group.prompt, num_cached_tokens=group.num_cached_tokens, metrics=metrics)
