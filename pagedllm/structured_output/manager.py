"""StructuredOutputManager: compiles grammars off the step loop, keeps one matcher per sequence,
and fills the step's packed token bitmask (on its own thread, while the model runs).

A sequence's matcher lives in ``seq.extra["grammar"]`` and always describes exactly
``seq.output_token_ids`` (with a reasoning parser, those after the model's ``</think>``: vLLM constrains the answer,
not the thinking, and a row still thinking samples from the whole vocabulary): it advances as tokens are appended, is forked with the sequence (n > 1),
and is rebuilt by replaying the outputs for any sequence that has none (beam-search forks) or whose
history it no longer matches. Preemption keeps the output tokens (recompute re-prefills them, swap
keeps them), so the matcher needs nothing there.

A reasoning marker may be several tokens (harmony's end is ``<|channel|>final<|message|>``): the reasoning ends at
the token that completes it. Whether it has ended is read from the token history alone (no partial-match state),
so replays, forks and rewinds need nothing more.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.config import StructuredOutputsConfig
from pagedllm.structured_output.backends import make_backend
from pagedllm.structured_output.params import StructuredOutputsParams, resolve_backend

logger = logging.getLogger("pagedllm")

#: Most compiled grammars kept (least recently used ones are dropped).
CACHE_SIZE = 512
#: Most native threads filling one step's bitmasks (used only when threads beat one thread per row: fill_policy).
MAX_FILL_THREADS = 8
#: Fills expected to take longer than this run on the mask thread, overlapping the step thread's work.
MIN_OVERLAPPED_FILL_S = 0.5e-3
#: While a fill runs on the mask thread, the GIL changes hands after this long instead of Python's 5 ms: the mask
#: thread needs it to start and to hand its result back while the step thread runs Python.
FILL_SWITCH_INTERVAL_S = 1e-4


def default_num_threads() -> int:
    """Threads for the batch fill and compiles: the host's cores, at most MAX_FILL_THREADS, at least 2."""
    return max(2, min(MAX_FILL_THREADS, os.cpu_count() or 2))


@dataclass
class SeqGrammar:
    """A sequence's matcher and how many of its output tokens it has accepted."""

    matcher: Any
    num_tokens: int = 0  # output tokens consumed, a thinking block's included
    thinking: bool = False  # inside the model's reasoning: the grammar starts after its end marker
    failed: bool = False  # a token the grammar rejects was appended (a bug elsewhere): the sequence stops
    terminated: bool = False  # the grammar accepted its end (its stop token): nothing more to mask


class StructuredOutputManager:
    def __init__(self, backend: str, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 num_threads: int | None = None, pin_memory: bool = False,
                 reasoning_tokens: tuple[int | Sequence[int], int | Sequence[int]] | None = None,
                 config: StructuredOutputsConfig | None = None) -> None:
        self.backend_name = resolve_backend(backend)
        # Engine-wide grammar options (--structured-outputs-config); its backend and parser arrive as arguments.
        self.config = config or StructuredOutputsConfig()
        # The reasoning's (start, end) markers with a reasoning parser: grammars apply after the reasoning ends.
        self.reasoning_tokens = reasoning_tokens
        self.num_threads = num_threads or default_num_threads()
        self._init_args = (tokenizer, vocab_size, eos_token_ids, self.num_threads)
        self.vocab_size = vocab_size
        self._backend = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._compile_pool: ThreadPoolExecutor | None = None
        self._mask_pool: ThreadPoolExecutor | None = None
        # Two host buffers used in turn: a step's non-blocking copy to the device may still read the
        # previous one. Pinned on CUDA so that copy is truly asynchronous.
        self.pin_memory = pin_memory
        self._bitmasks: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        # Compile time of the most recent CACHE_SIZE grammars (bounded: keys hold whole schemas).
        self.compile_seconds: OrderedDict[tuple, float] = OrderedDict()
        self.init_seconds: float | None = None
        self.min_overlapped_fill_s = MIN_OVERLAPPED_FILL_S
        self._saved_switch_interval: float | None = None  # the interpreter's, while a fill runs on the mask thread

    # -- setup --------------------------------------------------------------------------------
    @property
    def reasoning_tokens(self) -> tuple[int | Sequence[int], int | Sequence[int]] | None:
        """The reasoning's (start, end) markers, each a token id or a sequence of them (None: no reasoning parser)."""
        return self._reasoning_tokens

    @reasoning_tokens.setter
    def reasoning_tokens(self, markers: tuple[int | Sequence[int], int | Sequence[int]] | None) -> None:
        self._reasoning_tokens = markers
        start, end = (None, None) if markers is None else (_token_tuple(m) for m in markers)
        if end is not None and not end:
            raise ValueError("the reasoning's end marker has no tokens")
        self._reasoning_start: tuple[int, ...] | None = start
        self._reasoning_end: tuple[int, ...] | None = end

    @property
    def backend(self):
        """The grammar engine, created at the first constrained request (its tokenizer tables take ~0.1-1 s)."""
        if self._backend is None:
            with self._backend_lock:
                if self._backend is None:
                    if self._init_args[0] is None:
                        raise ValueError("structured outputs need a tokenizer; this engine has skip_tokenizer_init=True.")
                    t0 = time.perf_counter()
                    self._backend = make_backend(self.backend_name, *self._init_args)
                    self.init_seconds = time.perf_counter() - t0
                    logger.info("structured outputs: %s ready in %.0f ms (%d fill threads)", self.backend_name,
                                1e3 * self.init_seconds, self.num_threads)
        return self._backend

    def start_backend_init(self) -> Future | None:
        """Build the backend's tokenizer tables now, on the compile thread (~1 s for a 49k vocabulary), so
        the first constrained request does not pay for it in its TTFT. None without a tokenizer."""
        if self._init_args[0] is None:
            return None
        compile_pool, _ = self._pools()
        return compile_pool.submit(lambda: self.backend)

    def _pools(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        if self._compile_pool is None:
            self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-grammar-compile")
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-grammar-mask")
        return self._compile_pool, self._mask_pool  # type: ignore[return-value]

    def shutdown(self) -> None:
        self._restore_switch_interval()
        for pool in (self._compile_pool, self._mask_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    # -- compilation --------------------------------------------------------------------------
    def cache_key(self, params: StructuredOutputsParams) -> tuple[str, str, bool, bool, bool]:
        """(kind, spec, compact, no whitespace, close objects): what a grammar is compiled from and cached under, the
        request's constraint with the engine's options (--structured-outputs-config) applied."""
        kind, spec, compact = params.cache_key()
        is_json = kind in ("json", "json_object")
        no_whitespace = is_json and self.config.disable_any_whitespace
        close_objects = kind == "json" and self.config.disable_additional_properties
        return kind, spec, compact or no_whitespace, no_whitespace, close_objects

    def request(self, params: StructuredOutputsParams) -> Future:
        """Validate now (ValueError naming what is wrong) and compile on the pool; cached by `cache_key`."""
        key = self.cache_key(params)
        fut = self._cache.get(key)
        if fut is not None:
            self._cache.move_to_end(key)
            return fut
        t0 = time.perf_counter()
        built = self.backend.build(*key)
        compile_pool, _ = self._pools()
        fut = compile_pool.submit(self._compile, key, built, time.perf_counter() - t0)
        self._cache[key] = fut
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return fut

    def _compile(self, key: tuple, built: Any, build_seconds: float = 0.0) -> Any:
        """The grammar's compiled form; its compile time counts the build (parsing, on the caller's thread) too."""
        t0 = time.perf_counter()
        compiled = self.backend.compile(built)
        self.compile_seconds[key] = build_seconds + time.perf_counter() - t0
        while len(self.compile_seconds) > CACHE_SIZE:  # only this (single) compile thread writes it
            self.compile_seconds.popitem(last=False)
        logger.info("compiled a %s grammar in %.1f ms", key[0], 1e3 * self.compile_seconds[key])
        return compiled

    # -- per-sequence state -------------------------------------------------------------------
    def sync(self, seq: Any, compiled: Any) -> SeqGrammar:
        """The sequence's matcher, advanced over any output token it has not accepted yet."""
        state: SeqGrammar | None = seq.extra.get("grammar")
        out = seq.output_token_ids
        if state is not None and state.num_tokens == len(out):  # the common case: nothing to do
            return state
        if state is None or state.num_tokens > len(out):
            state = SeqGrammar(self.backend.new_matcher(compiled), thinking=self._thinks_first(seq))
            seq.extra["grammar"] = state
        be = self.backend
        while state.num_tokens < len(out) and not state.failed:
            if state.thinking:
                state.thinking = not self._ends_reasoning(seq, state.num_tokens + 1)
            elif not be.accept(state.matcher, out[state.num_tokens]):
                state.failed = True
                logger.error("sequence %s: token %d is not allowed by its grammar", seq.seq_id, out[state.num_tokens])
            state.num_tokens += 1
        state.terminated = not state.failed and not state.thinking and be.is_terminated(state.matcher)
        return state

    def _thinks_first(self, seq: Any) -> bool:
        """Whether the output starts inside the reasoning: unless the prompt's last end marker is followed by no
        start marker (a template that turned thinking off, as Qwen3's enable_thinking=False does, or a harmony
        prompt that opened the final channel)."""
        start, end = self._reasoning_start, self._reasoning_end
        if start is None or end is None:
            return False
        prompt = seq.prompt_token_ids
        last_end = _rfind(prompt, end)
        return last_end < 0 or _rfind(prompt, start, last_end + len(end)) >= 0

    def _ends_reasoning(self, seq: Any, n: int) -> bool:
        """Whether the first `n` output tokens end with the reasoning's end marker (which may begin in the prompt)."""
        end = self._reasoning_end
        out = seq.output_token_ids
        if out[n - 1] != end[-1]:  # the common case, kept short
            return False
        k = len(end)
        if n >= k:
            return tuple(out[n - k:n]) == end
        prompt = seq.prompt_token_ids
        return len(prompt) >= k - n and tuple(prompt[len(prompt) - (k - n):]) + tuple(out[:n]) == end

    def accept(self, seq: Any, compiled: Any) -> bool:
        """After a token was appended: advance; → True when the sequence must stop (grammar finished or broken)."""
        state: SeqGrammar | None = seq.extra.get("grammar")
        out = seq.output_token_ids
        if state is None or state.failed or state.num_tokens != len(out) - 1:
            state = self.sync(seq, compiled)  # anything but the one new token: replay
        elif state.thinking:
            state.num_tokens += 1
            state.thinking = not self._ends_reasoning(seq, state.num_tokens)
            return False
        else:  # the per-step path, kept short: it runs for every constrained row of every step
            state.num_tokens += 1
            advanced = self._backend.advance(state.matcher, out[-1])
            if advanced < 0:
                state.failed = True
                logger.error("sequence %s: token %d is not allowed by its grammar", seq.seq_id, out[-1])
            state.terminated = advanced > 0
        return state.failed or state.terminated

    def draft_masks(self, seq: Any, compiled: Any, drafts: list[int]) -> tuple[int, torch.Tensor] | None:
        """Speculative decoding: the masks a verification of ``drafts`` needs → (n, masks): the grammar accepts
        ``drafts[:n]`` (a stop token that ends it is the last), and row i of ``masks`` ([n + 1, words] int32) is
        the bitmask after ``drafts[:i]``, the one plain decoding would apply there. The matcher is rolled back,
        so it still describes the sequence's own tokens. A sequence still thinking takes the drafts before the
        token that completes the reasoning's end marker, unmasked. None when its grammar ended or broke (the
        sequence stops)."""
        state = self.sync(seq, compiled)
        if state.failed or state.terminated:
            return None
        words = (self.vocab_size + 31) // 32
        if state.thinking:  # the grammar starts after the end marker; the row after it would need its first mask
            n = self._reasoning_end_in(seq, drafts)
            return n, torch.full((n + 1, words), -1, dtype=torch.int32)
        be = self.backend
        masks = torch.empty((len(drafts) + 1, words), dtype=torch.int32)
        be.fill_row(state.matcher, masks, 0)
        n = 0
        for tok in drafts:
            advanced = be.try_advance(state.matcher, tok)
            if advanced < 0:
                break
            n += 1
            if advanced > 0:  # the grammar ended: nothing may follow
                break
            be.fill_row(state.matcher, masks, n)
        be.rollback(state.matcher, n)
        return n, masks[:n + 1]

    def _reasoning_end_in(self, seq: Any, drafts: list[int]) -> int:
        """Index of the draft that completes the reasoning's end marker after the sequence's tokens (len(drafts):
        none does)."""
        end = self._reasoning_end
        k = len(end)
        out = seq.output_token_ids
        before = list(out[max(0, len(out) - (k - 1)):])  # the tokens a marker completed by a draft may begin with
        if len(before) < k - 1:  # a short output: the marker may begin in the prompt
            prompt = seq.prompt_token_ids
            before = list(prompt[max(0, len(prompt) - (k - 1 - len(before))):]) + before
        window = before + list(drafts)
        for j, tok in enumerate(drafts):
            i = len(before) + j + 1  # window[:i] ends with drafts[j]
            if tok == end[-1] and i >= k and tuple(window[i - k:i]) == end:
                return j
        return len(drafts)

    def forced_tokens(self, seq: Any, compiled: Any) -> list[int]:
        """Speculative decoding's grammar drafts: the tokens of the continuation the grammar forces next (JSON
        keys, punctuation), or [] (none forced, or the grammar does not constrain the next token)."""
        state = self.sync(seq, compiled)
        if state.failed or state.terminated or state.thinking:
            return []
        return self.backend.forced_tokens(state.matcher)

    def fork(self, parent: Any, child: Any) -> None:
        state: SeqGrammar | None = parent.extra.get("grammar")
        if state is not None:
            child.extra["grammar"] = SeqGrammar(self.backend.fork(state.matcher), state.num_tokens, state.thinking,
                                                state.failed, state.terminated)

    # -- the step's bitmask -------------------------------------------------------------------
    def start_fill(self, seqs_and_grammars: list[tuple[Any, Any]], overlap: bool = True,
                   rows: list[int] | None = None, batch: int | None = None) -> Future:
        """Fill the bitmask rows ``rows`` (default 0..n-1) of a ``batch``-row buffer, one per (sequence,
        compiled grammar) → Future[int32 tensor]. The matchers are brought up to date here; the native fill
        (which releases the GIL) runs on the mask thread, overlapping the caller's work, or, with
        ``overlap=False``, right here (already done). Other rows are left as they are."""
        rows = list(range(len(seqs_and_grammars))) if rows is None else rows
        # The (pinned) buffer is allocated here, on the caller's thread: a pinned allocation on the mask
        # thread while the step thread captures a CUDA graph would invalidate the capture.
        bitmask = self._buffer(max(batch or 0, max(rows, default=-1) + 1))
        live_rows, matchers = self._prepare(seqs_and_grammars, rows, bitmask)
        # A cheap fill runs here: handing it to the mask thread costs more (waking it, and its waits for the
        # GIL while this thread runs Python) than the ~0.1 ms it takes.
        if (not overlap or not matchers
                or self._expected_fill_seconds(len(matchers)) < self.min_overlapped_fill_s):
            fut: Future = Future()
            fut.set_result(self._native_fill(matchers, bitmask, live_rows))
            return fut
        _, mask_pool = self._pools()
        if self._saved_switch_interval is None:
            self._saved_switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(FILL_SWITCH_INTERVAL_S)
        return mask_pool.submit(self._native_fill, matchers, bitmask, live_rows)

    def mask_result(self, job: Future) -> torch.Tensor:
        """A fill's bitmask (waits for it); the interpreter's thread switch interval is restored."""
        try:
            return job.result()
        finally:
            self._restore_switch_interval()

    def _restore_switch_interval(self) -> None:
        if self._saved_switch_interval is not None:
            sys.setswitchinterval(self._saved_switch_interval)
            self._saved_switch_interval = None

    def _expected_fill_seconds(self, rows: int) -> float:
        """The fill's cost from its recent cost per row (0 before any fill)."""
        costs = getattr(self._backend, "fill_policy", None)
        known = costs.cost_per_row.values() if costs is not None else ()
        return rows * min(known, default=0.0)

    def reserve_buffers(self, batch: int) -> None:
        """Allocate both (pinned) bitmask buffers for ``batch`` rows now: the first pinned allocation of a
        process takes milliseconds, which the first constrained request would otherwise pay in its TTFT."""
        for _ in range(2):
            self._buffer(batch)

    def _buffer(self, batch: int) -> torch.Tensor:
        words = (self.vocab_size + 31) // 32
        self._turn ^= 1
        buf = self._bitmasks[self._turn]
        if buf is None or buf.shape[0] < batch:
            buf = torch.empty((max(batch, 64), words), dtype=torch.int32, pin_memory=self.pin_memory)
            self._bitmasks[self._turn] = buf
        return buf[:batch]

    def _prepare(self, seqs_and_grammars: list[tuple[Any, Any]], rows: list[int],
                 bitmask: torch.Tensor) -> tuple[list[int], list[Any]]:
        """The rows to fill and their up-to-date matchers; rows that may sample anything are set here."""
        n = len(seqs_and_grammars)
        if len(rows) != n:
            raise ValueError(f"fill got {n} sequences but {len(rows)} rows")
        live_rows, matchers = [], []
        for r, (seq, compiled) in zip(rows, seqs_and_grammars):
            state = seq.extra.get("grammar")
            if state is None or state.num_tokens != len(seq.output_token_ids):  # not kept up by accept()
                state = None if seq.is_finished() else self.sync(seq, compiled)
            # A sequence whose grammar ended or broke (the step before finished it while this one ran) samples
            # a token that is dropped: let it sample anything. So does one still thinking.
            if state is None or state.failed or state.terminated or state.thinking:
                bitmask[r].fill_(-1)
            else:
                live_rows.append(r)
                matchers.append(state.matcher)
        return live_rows, matchers

    def _native_fill(self, matchers: list[Any], bitmask: torch.Tensor, live_rows: list[int]) -> torch.Tensor:
        if matchers:
            self.backend.fill_bitmask(matchers, bitmask, live_rows)
        return bitmask

    def fill(self, seqs_and_grammars: list[tuple[Any, Any]], rows: list[int] | None = None,
             bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """Write one packed row per (sequence, compiled grammar) into ``rows`` of ``bitmask`` (default: a
        buffer of this manager with a row per sequence) → the bitmask."""
        rows = list(range(len(seqs_and_grammars))) if rows is None else rows
        if bitmask is None:
            bitmask = self._buffer(max(rows, default=-1) + 1)
        live_rows, matchers = self._prepare(seqs_and_grammars, rows, bitmask)
        return self._native_fill(matchers, bitmask, live_rows)


def _token_tuple(marker: int | Sequence[int]) -> tuple[int, ...]:
    return (int(marker),) if isinstance(marker, int) else tuple(int(t) for t in marker)


def _rfind(tokens: Sequence[int], marker: tuple[int, ...], begin: int = 0) -> int:
    """Index of the last occurrence of `marker` in ``tokens[begin:]``, or -1."""
    k = len(marker)
    if k == 1:
        return next((i for i in range(len(tokens) - 1, begin - 1, -1) if tokens[i] == marker[0]), -1)
    return next((i for i in range(len(tokens) - k, begin - 1, -1)
                 if tokens[i] == marker[0] and tuple(tokens[i:i + k]) == marker), -1)
