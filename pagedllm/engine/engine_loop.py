"""The engine loop: the one thread that ever touches an `LLMEngine` behind an async front.

`LLMEngine` is not thread-safe, so every engine call (add, abort, step, stats) happens on the thread
that runs `EngineLoop.run()`. It drains a queue of commands (add / abort / call / stop) once per step,
steps while there is work and blocks on the queue when idle (no spinning). When the engine is idle,
the first request waits up to `admission_window_s` for others arriving right behind it (a burst of
HTTP requests then starts in one step, as an `LLM.generate` batch does). What comes out goes to an
`EngineSink`: the in-process front (`AsyncLLMEngine`) hands it to its event loop; the engine-core
process (`core_proc.py`) sends it over a pipe to the API server process. A stats snapshot for
/metrics is published after a step that finished a request, when the engine goes idle, and otherwise
at most every `stats_interval_s` (building it walks every block table: ~15 % of the step thread's CPU
at 18 req/s on an H100 when it ran after every step).
"""
from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.async_engine")


class EngineDeadError(RuntimeError):
    """The engine stopped (shut down or failed beyond recovery) and cannot serve requests."""


class EngineStepError(RuntimeError):
    """A step failed while this request was in flight; the request was aborted."""


@dataclass
class AddCommand:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    lora_request: Any = None  # a LoRARequest


@dataclass
class AbortCommand:
    request_ids: list[str]


@dataclass
class StopCommand:
    pass


@dataclass
class CallCommand:
    """Run `fn(engine)` between two steps (a consistent view of its state); `token` names the caller."""

    fn: Callable[[LLMEngine], Any]
    token: Any


Command = AddCommand | AbortCommand | StopCommand | CallCommand


class EngineSink(Protocol):
    """Where the loop's results go. Called on the loop's thread; must not block for long."""

    def deliver(self, outputs: list[RequestOutput], errors: dict[str, BaseException], now: float) -> None:
        """A step's outputs (and requests that failed to be added or were failed by a step fault)."""

    def resolve(self, token: Any, exc: BaseException | None, result: Any) -> None:
        """The result of a `CallCommand`."""

    def aborted(self, request_ids: list[str]) -> None:
        """Requests the engine aborted (client aborts and step faults): for metrics."""

    def publish_stats(self, stats: dict[str, Any]) -> None:
        """A whole stats snapshot (`LLMEngine.stats()` plus the loop's counters)."""

    def dead(self, reason: str) -> None:
        """The engine can serve nothing more: every in-flight request must end with EngineDeadError."""


class EngineLoop:
    """Runs an `LLMEngine` on the calling thread, fed by `commands`, reporting to `sink`."""

    def __init__(self, engine: LLMEngine, sink: EngineSink, commands: queue.Queue,
                 admission_window_s: float = 0.002) -> None:
        self.engine = engine
        self.sink = sink
        self.commands = commands
        # Idle engine: after a request arrives, wait until none has come for this long (at most
        # 10x this) before the first step, so a burst starts together.
        self.admission_window_s = admission_window_s
        self.dead_reason: str | None = None
        self.num_steps = 0
        self.num_step_faults = 0
        self.health_check_interval_s = 5.0  # while idle, how often the workers are checked
        self.stats_interval_s = 0.05  # while busy, the most a /metrics snapshot lags the engine
        # After work, once idle this long, the workers return freed host memory to the OS (CPU path:
        # the heap keeps every step's freed activations; BENCHMARKS.md, soak). None: never.
        self.idle_release_s: float | None = 1.0
        self._release_pending = False
        self._stats_time = 0.0

    def run(self) -> None:
        """Serve commands until a `StopCommand`; never raises (a crash marks the engine dead)."""
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                commands = self._drain(block)
                if any(isinstance(c, StopCommand) for c in commands):
                    self._apply([c for c in commands if not isinstance(c, StopCommand)])
                    self._abort_everything()
                    self.publish_stats()
                    return
                self._apply(commands)
                if self.engine.has_unfinished_requests():
                    self._step()  # publishes the stats
                else:
                    self.publish_stats()
        except BaseException as e:  # the loop must never die silently
            logger.exception("engine loop crashed")
            self._mark_dead(f"engine thread crashed: {type(e).__name__}: {e}")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
        self.sink.dead(self.dead_reason)

    def _drain(self, block: bool) -> list[Command]:
        commands: list[Command] = []
        if block:
            release = self._release_pending and self.idle_release_s is not None
            try:
                commands.append(self.commands.get(
                    timeout=self.idle_release_s if release else self.health_check_interval_s))
            except queue.Empty:  # idle: make sure the workers are still there to serve
                if release:
                    self._release_pending = False
                    self._release_free_memory()
                else:
                    self.check_executor_health()
                return commands
            if self.admission_window_s > 0 and isinstance(commands[0], AddCommand):
                deadline = time.monotonic() + 10 * self.admission_window_s
                while (left := deadline - time.monotonic()) > 0:
                    try:
                        cmd = self.commands.get(timeout=min(self.admission_window_s, left))
                    except queue.Empty:
                        break
                    commands.append(cmd)
                    if isinstance(cmd, StopCommand):
                        return commands
        while True:
            try:
                commands.append(self.commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[Command]) -> None:
        aborts: list[str] = []
        errors: dict[str, BaseException] = {}
        for cmd in commands:
            if isinstance(cmd, AddCommand):
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.arrival_time, cmd.priority,
                                            cmd.lora_request)
                except Exception as e:  # bad input: the engine is untouched
                    errors[cmd.request_id] = e
            elif isinstance(cmd, AbortCommand):
                aborts.extend(cmd.request_ids)
            elif isinstance(cmd, CallCommand):
                try:
                    result = cmd.fn(self.engine)
                except Exception as e:
                    self.sink.resolve(cmd.token, e, None)
                else:
                    self.sink.resolve(cmd.token, None, result)
        if errors:
            self.sink.deliver([], errors, time.monotonic())
        if aborts:
            self.engine.abort_request(aborts)
            self.sink.aborted(aborts)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._handle_step_fault(e)
            return
        self.num_steps += 1
        self._release_pending = True
        now = time.monotonic()
        # Before delivery: a consumer that sees a request finish sees the stats after it.
        if (now - self._stats_time >= self.stats_interval_s or not self.engine.has_unfinished_requests()
                or any(o.finished for o in outputs)):
            self.publish_stats()
        if outputs:
            self.sink.deliver(outputs, {}, now)

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
            self._mark_dead(f"step failed ({exc}) and recovery failed ({cleanup_error})")
            raise
        if len(ids) < len(groups):
            logger.warning("%d queued request(s) that no step had started keep their place", len(groups) - len(ids))
        self.sink.deliver([], {rid: EngineStepError(message) for rid in ids}, time.monotonic())
        self.check_executor_health()  # a dead worker ends serving; a bad request does not
        if self.dead_reason is not None:
            self._abort_everything()  # the queue's streams were failed with EngineDeadError

    def _abort_for_fault(self, ids: list[str]) -> None:
        self.engine.abort_request(ids)
        self.sink.aborted(ids)

    def check_executor_health(self) -> None:
        """Mark the engine dead if a worker (tensor-parallel rank) is gone or does not answer."""
        try:
            self.engine.executor.check_health()
        except Exception as e:
            if self.dead_reason is None:
                logger.error("executor health check failed: %s", e)
                self._mark_dead(f"executor unhealthy: {e}")

    def _release_free_memory(self) -> None:
        release = getattr(self.engine.executor, "release_free_memory", None)
        if release is None:
            return
        try:
            release()
        except Exception as e:  # a dead worker is the health check's business, not a reason to stop
            logger.warning("releasing idle memory failed: %s", e)
            self.check_executor_health()

    def _abort_everything(self) -> None:
        ids = [g.request_id for g in self.engine._all_groups()]
        if ids:
            self.engine.abort_request(ids)

    def publish_stats(self) -> None:
        stats = dict(self.engine.stats())
        stats["num_steps"] = self.num_steps
        stats["num_step_faults"] = self.num_step_faults
        stats["healthy"] = self.dead_reason is None
        self._stats_time = time.monotonic()
        self.sink.publish_stats(stats)
