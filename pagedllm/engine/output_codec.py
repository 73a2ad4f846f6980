"""Step outputs between the engine-core process and the API server process, sent as deltas.

A `RequestOutput` is cumulative (every token and the whole text so far), so pickling each step's outputs
costs O(length) per request per step: ~0.5 ms a step for 70 requests of a few hundred tokens. The
encoder sends a request's first output and its last (finished) one whole, and in between only what
was appended to each completion (new token ids, new text, new logprobs); the decoder rebuilds the
cumulative outputs the serving code reads. A completion that changed in any other way (beam search
reorders and rewrites its beams, a detokenizer revision, a different set of completions) is sent whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.outputs import CompletionOutput, RequestOutput

_TAIL = 16  # characters of text remembered to check that the next text extends it

_FULL, _DELTA = 0, 1


@dataclass
class _SentCompletion:
    index: int
    num_tokens: int
    last_token: int | None
    text_len: int
    text_tail: str
    num_logprobs: int | None


def _sent(c: CompletionOutput) -> _SentCompletion:
    return _SentCompletion(c.index, len(c.token_ids), c.token_ids[-1] if c.token_ids else None, len(c.text),
                           c.text[-_TAIL:], None if c.logprobs is None else len(c.logprobs))


def _extends(c: CompletionOutput, s: _SentCompletion) -> bool:
    if c.index != s.index or len(c.token_ids) < s.num_tokens or len(c.text) < s.text_len:
        return False
    if s.num_tokens and c.token_ids[s.num_tokens - 1] != s.last_token:
        return False
    if not c.text.startswith(s.text_tail, s.text_len - len(s.text_tail)):
        return False
    if (c.logprobs is None) != (s.num_logprobs is None):
        return False
    return s.num_logprobs is None or len(c.logprobs) >= s.num_logprobs


class OutputEncoder:
    """Engine side: `encode(outputs)` → a picklable list; one encoder per stream of steps."""

    def __init__(self) -> None:
        self._sent: dict[str, list[_SentCompletion]] = {}
        #: Requests always sent whole (beam search rewrites its outputs). Filled before their first step.
        self.whole_only: set[str] = set()

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._sent.pop(rid, None)
            self.whole_only.discard(rid)

    def encode(self, outputs: list[RequestOutput]) -> list[tuple]:
        items = []
        for out in outputs:
            items.append(self._encode_one(out))
            if out.finished:
                self.forget([out.request_id])
        return items

    def _encode_one(self, out: RequestOutput) -> tuple:
        prev = self._sent.get(out.request_id)
        if (prev is None or out.finished or out.request_id in self.whole_only or len(prev) != len(out.outputs)
                or not all(_extends(c, s) for c, s in zip(out.outputs, prev))):
            if not out.finished:
                self._sent[out.request_id] = [_sent(c) for c in out.outputs]
            return (_FULL, out)
        comps = []
        for c, s in zip(out.outputs, prev):
            comps.append((c.token_ids[s.num_tokens:], c.text[s.text_len:], c.cumulative_logprob,
                          None if c.logprobs is None else c.logprobs[s.num_logprobs:], c.finish_reason, c.stop_reason))
        self._sent[out.request_id] = [_sent(c) for c in out.outputs]
        m = out.metrics
        return (_DELTA, out.request_id, comps, out.num_cached_tokens,
                (m.get("arrival_time"), m.get("first_scheduled_time"), m.get("first_token_time")))


class OutputDecoder:
    """API side: `decode(items)` → the cumulative `RequestOutput`s the encoder was given."""

    def __init__(self) -> None:
        self._last: dict[str, RequestOutput] = {}

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._last.pop(rid, None)

    def decode(self, items: list[tuple]) -> list[RequestOutput]:
        outputs = []
        for item in items:
            out = item[1] if item[0] == _FULL else self._apply_delta(*item[1:])
            if out is None:  # a delta of a request forgotten here (aborted): nobody reads it
                continue
            if out.finished:
                self._last.pop(out.request_id, None)
            else:
                self._last[out.request_id] = out
            outputs.append(out)
        return outputs

    def _apply_delta(self, request_id: str, comps: list[tuple], num_cached_tokens: int,
                     times: tuple[Any, Any, Any]) -> RequestOutput | None:
        prev = self._last.get(request_id)
        if prev is None:
            return None
        completions = []
        for c, (ids, text, cum, logprobs, finish, stop) in zip(prev.outputs, comps):
            completions.append(CompletionOutput(
                index=c.index, text=c.text + text, token_ids=c.token_ids + ids, cumulative_logprob=cum,
                logprobs=None if logprobs is None else c.logprobs + logprobs, finish_reason=finish,
                stop_reason=stop))
        arrival, scheduled, first_token = times
        return RequestOutput(
            request_id=request_id, prompt=prev.prompt, prompt_token_ids=prev.prompt_token_ids, outputs=completions,
            finished=False, prompt_logprobs=prev.prompt_logprobs, lora_request=prev.lora_request,
            num_cached_tokens=num_cached_tokens,
            metrics={"arrival_time": arrival, "first_scheduled_time": scheduled, "first_token_time": first_token},
        )
