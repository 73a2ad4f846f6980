"""AsyncLLMEngine: one engine thread runs `LLMEngine.step()`; coroutines await per-request streams.

`LLMEngine` is not thread-safe, so every engine call (add, abort, step, stats) happens on ONE
background thread. That thread drains a queue of add/abort commands once per step, steps while there
is work and blocks on the queue when idle (no spinning). Adding a request never waits for that thread:
it is checked on the caller's side (`LLMEngine.check_request` reads only the configuration) and
queued, so requests that arrive during a step all join the next one. When the engine is idle, the
first request waits up to `admission_window_s` for others arriving right behind it (a burst of HTTP
requests then starts in one step, as an `LLM.generate` batch does). All the outputs of a step go back
to the asyncio loop in ONE `loop.call_soon_threadsafe`; a stats snapshot for /metrics is published after
a step that finished a request, when the engine goes idle, and otherwise at most every
`stats_interval_s` (building it walks every block table: ~15 % of the step thread's CPU at 18 req/s on
an H100 when it ran after every step), so nothing outside the engine thread ever touches the engine.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Protocol, TypeVar

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.async_engine")

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine stopped (shut down or failed beyond recovery) and cannot serve requests."""


class EngineStepError(RuntimeError):
    """A step failed while this request was in flight; the request was aborted."""


class StepObserver(Protocol):
    """Called on the engine thread (metrics); must be cheap and thread-safe."""

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_abort(self, request_id: str) -> None: ...


class AsyncStream:
    """The outputs of one request, consumed by one coroutine (fed on the event loop's thread).

    Outputs are cumulative, so with `coalesce=True` an output not yet read is replaced by the next
    one: a consumer that falls behind (a slow client, a busy loop) reads only the latest state
    instead of formatting every step it missed (what vLLM's output collector does).
    """

    def __init__(self, request_id: str, coalesce: bool = False) -> None:
        self.request_id = request_id
        self.coalesce = coalesce
        self._items: collections.deque[RequestOutput | BaseException | None] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.finished:
            return
        if (self.coalesce and self._items and isinstance(item, RequestOutput)
                and isinstance(self._items[-1], RequestOutput)):
            self._items[-1] = item
        else:
            self._items.append(item)
        self._wake()

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self._items.append(None)
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if item is None:
            self._items.append(None)  # stays ended for any later read
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    arrival_time: float


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Stop:
    pass


@dataclass
class _Call:
    """Run `fn(engine)` on the engine thread between two steps (a consistent view of its state)."""

    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future


@dataclass
class _Delivery:
    """What the engine thread hands to the loop after one round."""

    outputs: list[RequestOutput] = field(default_factory=list)
    errors: dict[str, BaseException] = field(default_factory=dict)


class AsyncLLMEngine:
    """Async front of an `LLMEngine`: `generate()` streams `RequestOutput`s (cumulative, like vLLM)."""

    def __init__(self, engine: LLMEngine, observer: StepObserver | None = None,
                 admission_window_s: float = 0.002) -> None:
        self.engine = engine
        # Idle engine: after a request arrives, wait until none has come for this long (at most
        # 10x this) before the first step, so a burst starts together.
        self.admission_window_s = admission_window_s
        self.observer = observer
        self._commands: queue.Queue[_Add | _Abort | _Stop] = queue.Queue()
        self._streams: dict[str, AsyncStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead_reason: str | None = None
        self._stats: dict[str, Any] = {}
        self.num_steps = 0
        self.num_step_faults = 0
        self.health_check_interval_s = 5.0  # while idle, how often the workers are checked
        self.stats_interval_s = 0.05  # while busy, the most a /metrics snapshot lags the engine
        self._stats_time = 0.0
        # After work, once idle this long, the workers return freed host memory to the OS (CPU path:
        # the heap keeps every step's freed activations; BENCHMARKS.md, soak). None: never.
        self.idle_release_s: float | None = 1.0
        self._release_pending = False
        self._publish_stats()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, observer: StepObserver | None = None) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(engine_args), observer)

    # -- lifecycle (called on the event loop) ---------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; outputs are delivered to the running event loop."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine.start() was already called")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every in-flight request, stop the engine thread and wait for it."""
        self._commands.put(_Abort(list(self._streams)))
        for stream in list(self._streams.values()):
            stream.finish()
        self._streams.clear()
        if self._dead_reason is None:
            self._dead_reason = "the engine was shut down"
        self._commands.put(_Stop())
        thread = self._thread
        if thread is not None and thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, thread.join, timeout)

    @property
    def is_healthy(self) -> bool:
        return self._dead_reason is None and self._thread is not None and self._thread.is_alive()

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    def stats(self) -> dict[str, Any]:
        """The latest snapshot published by the engine thread (safe from any thread)."""
        return self._stats

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def call_between_steps(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between two steps and return its result.

        For readers that need a consistent view (the dashboard's block snapshot): `fn` must be
        quick (it delays the next step) and must not change the engine.
        """
        if not self.is_healthy:
            raise EngineDeadError(self._dead_reason or "the engine is not running")
        done = asyncio.get_running_loop().create_future()
        self._commands.put(_Call(fn, done))
        return await done

    # -- requests ---------------------------------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None,
        coalesce: bool = False,
    ) -> AsyncStream:
        """Queue a request for the next step, without waiting for the engine thread.

        Raises what `LLMEngine.add_request` raises (ValueError, TypeError) on bad input; a text
        prompt is tokenized on the engine thread, and an error there ends the stream with it.
        `coalesce`: see `AsyncStream`."""
        if not self.is_healthy:
            raise EngineDeadError(self._dead_reason or "the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.engine.check_request(prompt, params)
        stream = AsyncStream(request_id, coalesce)
        self._streams[request_id] = stream
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._commands.put(_Add(request_id, prompt, params, arrival))
        return stream

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, arrival_time: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; leaving early (or being cancelled) aborts it."""
        stream = await self.add_request(request_id, prompt, sampling_params, arrival_time)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    def abort(self, request_id: str | list[str]) -> None:
        """Stop requests wherever they are; their blocks are freed before the next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.finish()
        self._commands.put(_Abort(ids))

    def abort_all(self, reason: str) -> int:
        """Stop accepting requests; end every in-flight stream with EngineDeadError(reason). Returns how many."""
        if self._dead_reason is None:
            self._dead_reason = reason
        ids = list(self._streams)
        self._fail_all_streams(EngineDeadError(reason))
        if ids:
            self._commands.put(_Abort(ids))
        return len(ids)

    # -- delivery (event loop side) ------------------------------------------------------------------
    def _deliver(self, delivery: _Delivery) -> None:
        for out in delivery.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                self._streams.pop(out.request_id, None)
                stream.finish()
        for rid, exc in delivery.errors.items():
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(exc)
                stream.finish()

    def _resolve(self, fut: asyncio.Future, exc: BaseException | None, result: Any = None) -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)

    def _post(self, callback, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # loop closed between the check and the call
            pass

    def _fail_all_streams(self, exc: BaseException) -> None:
        for rid in list(self._streams):
            stream = self._streams.pop(rid)
            stream.put(exc)
            stream.finish()

    # -- the engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                commands = self._drain(block)
                if any(isinstance(c, _Stop) for c in commands):
                    self._apply([c for c in commands if not isinstance(c, _Stop)])
                    self._abort_everything()
                    self._publish_stats()
                    return
                self._apply(commands)
                if self.engine.has_unfinished_requests():
                    self._step()  # publishes the stats
                else:
                    self._publish_stats()
        except BaseException as e:  # the thread must never die silently
            logger.exception("engine thread crashed")
            self._dead_reason = f"engine thread crashed: {type(e).__name__}: {e}"
            self._post(self._fail_all_streams, EngineDeadError(self._dead_reason))

    def _drain(self, block: bool) -> list:
        commands = []
        if block:
            release = self._release_pending and self.idle_release_s is not None
            try:
                commands.append(self._commands.get(
                    timeout=self.idle_release_s if release else self.health_check_interval_s))
            except queue.Empty:  # idle: make sure the workers are still there to serve
                if release:
                    self._release_pending = False
                    self._release_free_memory()
                else:
                    self._check_executor_health()
                return commands
            if self.admission_window_s > 0 and isinstance(commands[0], _Add):
                deadline = time.monotonic() + 10 * self.admission_window_s
                while (left := deadline - time.monotonic()) > 0:
                    try:
                        cmd = self._commands.get(timeout=min(self.admission_window_s, left))
                    except queue.Empty:
                        break
                    commands.append(cmd)
                    if isinstance(cmd, _Stop):
                        return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list) -> None:
        aborts: list[str] = []
        errors: dict[str, BaseException] = {}
        for cmd in commands:
            if isinstance(cmd, _Add):
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.arrival_time)
                except Exception as e:  # bad input: the engine is untouched
                    errors[cmd.request_id] = e
            elif isinstance(cmd, _Abort):
                aborts.extend(cmd.request_ids)
            elif isinstance(cmd, _Call):
                try:
                    result = cmd.fn(self.engine)
                except Exception as e:
                    self._post(self._resolve, cmd.done, e)
                else:
                    self._post(self._resolve, cmd.done, None, result)
        if errors:
            self._post(self._deliver, _Delivery(errors=errors))
        if aborts:
            self.engine.abort_request(aborts)
            if self.observer is not None:
                for rid in aborts:
                    self.observer.on_abort(rid)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._handle_step_fault(e)
            return
        self.num_steps += 1
        self._release_pending = True
        if self.observer is not None:
            self.observer.on_outputs(outputs, time.monotonic())
        # Before delivery: a consumer that sees a request finish sees the stats after it.
        if (time.monotonic() - self._stats_time >= self.stats_interval_s or not self.engine.has_unfinished_requests()
                or any(o.finished for o in outputs)):
            self._publish_stats()
        if outputs:
            self._post(self._deliver, _Delivery(outputs=outputs))

    def _handle_step_fault(self, exc: Exception) -> None:
        """Fail the requests the failed step may have touched, free their blocks, keep serving if the pool is sound.

        Requests still queued that no step has scheduled yet hold no KV state and stay queued; if the
        pool is not whole after aborting the others, they are failed too (the pool must be sound).
        """
        self.num_step_faults += 1
        logger.exception("engine step failed; aborting the requests it may have touched")
        groups = list(self.engine._all_groups())
        ids = [g.request_id for g in groups if g.first_scheduled_time is not None]
        untouched = [g.request_id for g in groups if g.first_scheduled_time is None]
        if not ids:  # the fault is not in a started request (e.g. scheduling): keeping the queue could loop
            ids, untouched = untouched, []
        message = f"the engine failed while running this request: {type(exc).__name__}: {exc}"
        try:
            self._abort_for_fault(ids)
            bm = self.engine.scheduler.block_manager
            if untouched and bm.get_num_free_gpu_blocks() != bm.num_gpu_blocks:
                self._abort_for_fault(untouched)
                ids += untouched
            bm.check_invariants()
            if bm.get_num_free_gpu_blocks() != bm.num_gpu_blocks:
                raise RuntimeError(
                    f"{bm.num_gpu_blocks - bm.get_num_free_gpu_blocks()} KV blocks still held after aborting all"
                )
        except Exception as cleanup_error:
            logger.exception("could not recover from the step failure; the engine is now unhealthy")
            self._dead_reason = f"step failed ({exc}) and recovery failed ({cleanup_error})"
            self._post(self._fail_all_streams, EngineDeadError(self._dead_reason))
            raise
        if len(ids) < len(groups):
            logger.warning("%d queued request(s) that no step had started keep their place", len(groups) - len(ids))
        self._post(self._deliver, _Delivery(errors={rid: EngineStepError(message) for rid in ids}))
        self._check_executor_health()  # a dead worker ends serving; a bad request does not
        if self._dead_reason is not None:
            self._abort_everything()  # the queue's streams were failed with EngineDeadError

    def _abort_for_fault(self, ids: list[str]) -> None:
        self.engine.abort_request(ids)
        if self.observer is not None:
            for rid in ids:
                self.observer.on_abort(rid)

    def _check_executor_health(self) -> None:
        """Mark the engine dead if a worker (tensor-parallel rank) is gone or does not answer."""
        try:
            self.engine.executor.check_health()
        except Exception as e:
            if self._dead_reason is None:
                logger.error("executor health check failed: %s", e)
                self._dead_reason = f"executor unhealthy: {e}"
                self._post(self._fail_all_streams, EngineDeadError(self._dead_reason))

    def _release_free_memory(self) -> None:
        release = getattr(self.engine.executor, "release_free_memory", None)
        if release is None:
            return
        try:
            release()
        except Exception as e:  # a dead worker is the health check's business, not a reason to stop
            logger.warning("releasing idle memory failed: %s", e)
            self._check_executor_health()

    def _abort_everything(self) -> None:
        ids = [g.request_id for g in self.engine._all_groups()]
        if ids:
            self.engine.abort_request(ids)

    def _publish_stats(self) -> None:
        stats = dict(self.engine.stats())
        stats["num_steps"] = self.num_steps
        stats["num_step_faults"] = self.num_step_faults
        stats["healthy"] = self._dead_reason is None
        self._stats = stats  # one reference swap: readers see a whole snapshot
        self._stats_time = time.monotonic()
