"""The async front of the engine: coroutines await per-request streams of `RequestOutput`s.

Two fronts share one interface (`AsyncEngineFront`): `AsyncLLMEngine` runs the engine loop
(`engine_loop.EngineLoop`) on a background thread of this process; `core_client.AsyncMPClient` runs it
in an engine-core process of its own (the OpenAI server's default, vLLM's API-server / engine-core
split), so the event loop and the step loop never share an interpreter lock. Either way adding a
request never waits for the loop: it is checked on the caller's side (`RequestChecker` reads only the
configuration) and queued, so requests that arrive during a step all join the next one. All the
outputs of a step reach the event loop in ONE `loop.call_soon_threadsafe`; a stats snapshot for
/metrics is published by the loop, so nothing outside it ever touches the engine.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import itertools
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, Protocol, TypeVar

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.engine_loop import (
    AbortCommand,
    AddCommand,
    CallCommand,
    Command,
    EngineDeadError,
    EngineLoop,
    EngineStepError,
    StopCommand,
)
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.request_checker import RequestChecker
from pagedllm.engine.sleep_mode import EngineSleepingError, check_sleep_args, check_wake_tags, sleep_mode_disabled_error
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.processor import MultiModalProcessor, prepare_multimodal_prompt
from pagedllm.outputs import DeltaState, RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")


def _reset_prefix_cache(engine: LLMEngine) -> bool:
    return engine.reset_prefix_cache()


def _remove_lora(lora_int_id: int, engine: LLMEngine) -> bool:
    return engine.remove_lora(lora_int_id)


def _check_sleep_mode(engine: LLMEngine) -> None:
    if not engine.engine_args.enable_sleep_mode:
        raise sleep_mode_disabled_error()


def _sleep(level: int, mode: str, engine: LLMEngine) -> None:
    engine.sleep(level, mode)


def _wake_up(tags: list[str] | None, engine: LLMEngine) -> bool:
    engine.wake_up(tags)
    return engine.is_sleeping()


def _is_sleeping(engine: LLMEngine) -> bool:
    return engine.is_sleeping()


def _collective_rpc(method, timeout: float | None, args: tuple, kwargs: dict | None, engine: LLMEngine) -> list:
    return engine.collective_rpc(method, timeout, args, kwargs)


def _start_profile(engine: LLMEngine) -> None:
    engine.start_profile()


def _stop_profile(engine: LLMEngine) -> None:
    engine.stop_profile()

__all__ = ["AsyncEngineFront", "AsyncLLMEngine", "AsyncStream", "EngineDeadError", "EngineStepError",
           "FrontSink", "StepObserver"]


class StepObserver(Protocol):
    """Called off the event loop (metrics); must be cheap and thread-safe."""

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_abort(self, request_id: str) -> None: ...


class AsyncStream:
    """The outputs of one request, consumed by one coroutine (fed on the event loop's thread).

    Outputs are cumulative, so with `coalesce=True` an output not yet read is replaced by the next
    one: a consumer that falls behind (a slow client, a busy loop) reads only the latest state
    instead of formatting every step it missed (what vLLM's output collector does). With `delta` (a
    ``RequestOutputKind.DELTA`` request) the consumer reads each output as what is new since the one it read
    before; the engine still sends cumulative outputs, so coalesced steps merge into one delta.
    """

    def __init__(self, request_id: str, coalesce: bool = False, delta: DeltaState | None = None) -> None:
        self.request_id = request_id
        self.coalesce = coalesce
        self._delta = delta
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
        while True:
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
            if self._delta is None:
                return item
            delta = self._delta.delta_of(item)
            if delta is not None:
                return delta


class AsyncEngineFront:
    """Streams, request checks and delivery on the event loop; subclasses move commands to the loop."""

    def __init__(self, observer: StepObserver | None = None) -> None:
        self.observer = observer
        self._streams: dict[str, AsyncStream] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead_reason: str | None = None
        self._stats: dict[str, Any] = {}
        self._sleeping = False  # from sleep() until wake_up() woke every part: new requests are refused

    # -- what a front provides ----------------------------------------------------------------------
    @property
    def request_checker(self) -> RequestChecker:
        raise NotImplementedError

    def _submit(self, command: Command) -> None:
        """Hand a command to the engine loop (never waits for it)."""
        raise NotImplementedError

    @property
    def mm_processor(self) -> MultiModalProcessor | None:
        """A multimodal model's processor (prompts with images become ids and pixel values here, before they
        reach the engine loop); None for a text-only model."""
        return None

    def _loop_alive(self) -> bool:
        raise NotImplementedError

    # -- state ----------------------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self._dead_reason is None and self._loop_alive()

    @property
    def dead_reason(self) -> str | None:
        return self._dead_reason

    def stats(self) -> dict[str, Any]:
        """The latest snapshot published by the engine loop (safe from any thread)."""
        return self._stats

    @property
    def num_steps(self) -> int:
        return int(self._stats.get("num_steps", 0))

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def call_between_steps(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine loop between two steps and return its result.

        For readers that need a consistent view (the dashboard's block snapshot): `fn` must be
        quick (it delays the next step), must not change what a step in flight relies on (reading, or
        ``reset_prefix_cache``, which acts only while no block is in use), and (for the engine-core
        process) must be a module-level function whose result pickles.
        """
        if not self.is_healthy:
            raise EngineDeadError(self._dead_reason or "the engine is not running")
        call_id = next(self._call_ids)
        done = self._calls[call_id] = asyncio.get_running_loop().create_future()
        try:
            self._submit(CallCommand(fn, call_id))
            return await done
        finally:
            self._calls.pop(call_id, None)

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block between two steps (``LLMEngine.reset_prefix_cache``): False while requests
        hold KV blocks."""
        return await self.call_between_steps(_reset_prefix_cache)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a loaded LoRA adapter between two steps (``LLMEngine.remove_lora``)."""
        return await self.call_between_steps(functools.partial(_remove_lora, lora_int_id))

    # -- sleep mode (engine/sleep_mode.py) and worker calls --------------------------------------------------
    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """``LLMEngine.sleep`` between two steps. New requests are refused (EngineSleepingError) from now on; those in
        flight end with EngineSleepingError (mode "abort", vLLM's default) or are waited for (mode "wait")."""
        check_sleep_args(level, mode)
        await self.call_between_steps(_check_sleep_mode)  # ValueError before any request is touched
        was_sleeping, self._sleeping = self._sleeping, True
        try:
            if mode == "abort" and self._streams:
                ids = list(self._streams)
                self._end_streams(ids, EngineSleepingError(f"the engine was put to sleep (level {level}) while this "
                                                           f"request ran; it was aborted"))
                self._submit(AbortCommand(ids))
            while self._streams:  # mode "wait": nothing new is admitted meanwhile
                await asyncio.sleep(0.01)
            await self.call_between_steps(functools.partial(_sleep, level, mode))
        except BaseException:
            self._sleeping = was_sleeping
            raise

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """``LLMEngine.wake_up``; requests are admitted again once every part is awake."""
        check_wake_tags(tags)
        self._sleeping = await self.call_between_steps(functools.partial(_wake_up, tags))

    async def is_sleeping(self) -> bool:
        return await self.call_between_steps(_is_sleeping)

    async def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``LLMEngine.collective_rpc`` between two steps (to an engine-core process `method` must pickle: a name,
        or a module-level function)."""
        return await self.call_between_steps(functools.partial(_collective_rpc, method, timeout, tuple(args), kwargs))

    async def start_profile(self) -> None:
        """``LLMEngine.start_profile`` between two steps (worker/profiler.py)."""
        await self.call_between_steps(_start_profile)

    async def stop_profile(self) -> None:
        """``LLMEngine.stop_profile`` between two steps: the traces are written before it returns."""
        await self.call_between_steps(_stop_profile)

    # -- requests ---------------------------------------------------------------------------------
    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None,
        coalesce: bool = False, priority: int = 0, lora_request: LoRARequest | None = None,
    ) -> AsyncStream:
        """Queue a request for the next step, without waiting for the engine loop.

        Raises what `LLMEngine.add_request` raises (ValueError, TypeError) on bad input; a text
        prompt is tokenized by the engine, and an error there ends the stream with it.
        `coalesce`: see `AsyncStream`. `priority`: see `LLMEngine.add_request`."""
        if not self.is_healthy:
            raise EngineDeadError(self._dead_reason or "the engine is not running")
        if self._sleeping:
            raise EngineSleepingError("the engine is asleep (POST /sleep): wake it up (POST /wake_up) before sending "
                                      "requests.")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt = prepare_multimodal_prompt(prompt, self.mm_processor, None)  # pixel values cross, not images
        self.request_checker.check_request(prompt, params, priority)
        delta = None
        if getattr(params, "output_kind", None) == RequestOutputKind.DELTA:  # (PoolingParams: none)
            # The engine sends cumulative outputs (the metrics observer and the output codec read those); the
            # stream hands out their deltas.
            delta, params = DeltaState(), dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE)
        stream = AsyncStream(request_id, coalesce, delta)
        self._streams[request_id] = stream
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._submit(AddCommand(request_id, prompt, params, arrival, priority, lora_request))
        return stream

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, arrival_time: float | None = None,
        priority: int = 0, lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes; leaving early (or being cancelled) aborts it."""
        stream = await self.add_request(request_id, prompt, sampling_params, arrival_time, priority=priority,
                                        lora_request=lora_request)
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
        self._submit(AbortCommand(ids))

    def abort_all(self, reason: str) -> int:
        """Stop accepting requests; end every in-flight stream with EngineDeadError(reason). Returns how many."""
        if self._dead_reason is None:
            self._dead_reason = reason
        ids = list(self._streams)
        self._fail_all_streams(EngineDeadError(reason))
        if ids:
            self._submit(AbortCommand(ids))
        return len(ids)

    def _begin_shutdown(self) -> None:
        """Abort every in-flight request and ask the loop to stop (the subclass waits for it). A stream still open
        ends with EngineDeadError, so its client is told the request was cut short (a server's stream never ends
        as a bare [DONE])."""
        self._submit(AbortCommand(list(self._streams)))
        if self._dead_reason is None:
            self._dead_reason = "the engine was shut down"
        for stream in list(self._streams.values()):
            stream.put(EngineDeadError(self._dead_reason))
            stream.finish()
        self._streams.clear()
        self._submit(StopCommand())

    # -- delivery (event loop side) ------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput], errors: dict[str, BaseException]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            stream.put(out)
            if out.finished:
                self._streams.pop(out.request_id, None)
                stream.finish()
        for rid, exc in errors.items():
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(exc)
                stream.finish()

    def _resolve_call(self, call_id: int, exc: BaseException | None, result: Any) -> None:
        fut = self._calls.get(call_id)
        if fut is None or fut.done():
            return
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)

    def _end_streams(self, request_ids: list[str], exc: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(exc)
                stream.finish()

    def _fail_all_streams(self, exc: BaseException) -> None:
        for rid in list(self._streams):
            stream = self._streams.pop(rid)
            stream.put(exc)
            stream.finish()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(exc)

    def _post(self, callback, *args) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # loop closed between the check and the call
            pass


class FrontSink:
    """The engine loop's results, handed to a front's event loop (an `EngineSink`).

    Runs on the loop's thread in-process, or on the API process's pipe reader thread."""

    def __init__(self, front: AsyncEngineFront) -> None:
        self.front = front

    def deliver(self, outputs: list[RequestOutput], errors: dict[str, BaseException], now: float) -> None:
        observer = self.front.observer
        if observer is not None and outputs:
            observer.on_outputs(outputs, now)
        self.front._post(self.front._deliver, outputs, errors)

    def resolve(self, token: Any, exc: BaseException | None, result: Any) -> None:
        self.front._post(self.front._resolve_call, token, exc, result)

    def aborted(self, request_ids: list[str]) -> None:
        observer = self.front.observer
        if observer is not None:
            for rid in request_ids:
                observer.on_abort(rid)

    def publish_stats(self, stats: dict[str, Any]) -> None:
        if self.front._dead_reason is not None:
            stats = {**stats, "healthy": False}
        self.front._stats = stats  # one reference swap: readers see a whole snapshot

    def dead(self, reason: str) -> None:
        if self.front._dead_reason is None:
            self.front._dead_reason = reason
        self.front._post(self.front._fail_all_streams, EngineDeadError(reason))


class AsyncLLMEngine(AsyncEngineFront):
    """The engine loop on a thread of this process; `generate()` streams `RequestOutput`s (cumulative, like vLLM)."""

    def __init__(self, engine: LLMEngine, observer: StepObserver | None = None,
                 admission_window_s: float = 0.002) -> None:
        super().__init__(observer)
        self.engine = engine
        self._commands: queue.Queue[Command] = queue.Queue()
        self.loop = EngineLoop(engine, FrontSink(self), self._commands, admission_window_s)
        self._checker = engine.request_checker
        self._thread: threading.Thread | None = None
        self.loop.publish_stats()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, observer: StepObserver | None = None) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(engine_args), observer)

    # The loop's knobs, settable on the front (tests and benchmarks tune them).
    @property
    def idle_release_s(self) -> float | None:
        return self.loop.idle_release_s

    @idle_release_s.setter
    def idle_release_s(self, value: float | None) -> None:
        self.loop.idle_release_s = value

    @property
    def stats_interval_s(self) -> float:
        return self.loop.stats_interval_s

    @stats_interval_s.setter
    def stats_interval_s(self, value: float) -> None:
        self.loop.stats_interval_s = value

    @property
    def num_steps(self) -> int:
        return self.loop.num_steps

    @property
    def request_checker(self) -> RequestChecker:
        return self._checker

    def _submit(self, command: Command) -> None:
        self._commands.put(command)

    @property
    def mm_processor(self) -> MultiModalProcessor | None:
        return self.engine.mm_processor

    def _loop_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.loop.dead_reason is None

    # -- lifecycle (called on the event loop) ---------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; outputs are delivered to the running event loop."""
        if self._thread is not None:
            raise RuntimeError("AsyncLLMEngine.start() was already called")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self.loop.run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every in-flight request, stop the engine thread and wait for it."""
        self._begin_shutdown()
        thread = self._thread
        if thread is not None and thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, thread.join, timeout)

    @property
    def info(self) -> EngineInfo:
        return EngineInfo.of(self.engine)
