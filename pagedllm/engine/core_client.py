"""`AsyncMPClient`: the async front of an engine that runs in an engine-core process of its own.

The OpenAI server's default (vLLM's API-server / engine-core split; `--disable-frontend-multiprocessing`
keeps the engine on a thread of the server process instead). The API process holds no model: it
tokenizes, checks requests with the engine's `RequestChecker`, formats responses and streams them,
while the engine-core process (`core_proc.py`) schedules, runs the model and detokenizes, each with an
interpreter lock of its own. Commands go down one pipe without waiting for an answer; one reader
thread here receives the engine's messages, rebuilds the step outputs from their deltas
(`output_codec`), feeds the metrics observer and hands each step's outputs to the event loop at once.
If the engine-core process dies, every in-flight request ends with `EngineDeadError` and /health
turns 503.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import threading
import time
import weakref
from multiprocessing.connection import Connection

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import AsyncEngineFront, FrontSink, StepObserver
from pagedllm.engine.core_proc import run_engine_core
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.engine_loop import AbortCommand, Command
from pagedllm.engine.output_codec import OutputDecoder
from pagedllm.engine.request_checker import RequestChecker
from pagedllm.executor.start_method import worker_start_method
from pagedllm.model.loader import load_config
from pagedllm.multimodal.processor import MultiModalProcessor

logger = logging.getLogger("pagedllm.async_engine")

_STOP_TIMEOUT_S = 30.0


def _stop_process(proc: multiprocessing.process.BaseProcess, conns: list[Connection]) -> None:
    """Finalizer: close the pipes (the core stops on end of file), then make sure the process is gone."""
    for conn in conns:
        try:
            conn.close()
        except OSError:
            pass
    if proc.pid is None:
        return
    proc.join(5.0)
    if proc.is_alive():
        proc.terminate()
        proc.join(5.0)
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)


class AsyncMPClient(AsyncEngineFront):
    """Start an engine-core process for `engine_args` and serve its requests as async streams."""

    def __init__(self, engine_args: EngineArgs, observer: StepObserver | None = None,
                 startup_timeout_s: float | None = None, admission_window_s: float = 0.002,
                 process_env: dict[str, str] | None = None, name: str = "pagedllm-engine-core") -> None:
        super().__init__(observer)
        self._engine_args = engine_args
        ctx = multiprocessing.get_context(worker_start_method())
        cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._out_recv, out_send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=run_engine_core,
            args=(engine_args, cmd_recv, out_send, os.getpid(), logging.getLogger().getEffectiveLevel(),
                  admission_window_s, process_env),
            name=name, daemon=False,  # it may start tensor-parallel worker processes
        )
        self.proc.start()
        cmd_recv.close()
        out_send.close()
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, [self._cmd_send, self._out_recv])
        self._send_lock = threading.Lock()
        self._stopping = False
        self._sink = FrontSink(self)
        self._decoder = OutputDecoder()
        self._decode_lock = threading.Lock()  # the reader decodes, the event loop forgets aborted requests
        self.info: EngineInfo = self._wait_ready(startup_timeout_s)
        self._reader = threading.Thread(target=self._read, name="pagedllm-core-client", daemon=True)
        self._reader.start()
        logger.info("engine core process started (pid %d)", self.proc.pid)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, observer: StepObserver | None = None) -> AsyncMPClient:
        return cls(engine_args, observer)

    def _wait_ready(self, timeout_s: float | None) -> EngineInfo:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not self._out_recv.poll(1.0 if left is None else min(left, 1.0)):
                if not self.proc.is_alive():
                    self._finalizer()
                    raise RuntimeError(f"the engine-core process exited while starting (exit code {self.proc.exitcode})")
                if deadline is not None and time.monotonic() >= deadline:
                    self._finalizer()
                    raise TimeoutError(f"the engine-core process was not ready in {timeout_s:.0f} s")
                continue
            try:
                message = self._out_recv.recv()
            except (EOFError, OSError):
                self.proc.join(5.0)
                self._finalizer()
                raise RuntimeError(f"the engine-core process exited while starting (exit code {self.proc.exitcode})") from None
            kind = message[0]
            if kind == "ready":
                return message[1]
            if kind == "failed":
                self._finalizer()
                raise message[1]
            if kind == "stats":
                self._sink.publish_stats(message[1])

    # -- the front's hooks ---------------------------------------------------------------------------
    @property
    def request_checker(self) -> RequestChecker:
        return self.info.checker

    @functools.cached_property
    def mm_processor(self) -> MultiModalProcessor | None:
        """This process's own copy of the model's processor (None for a text-only model, or without a tokenizer)."""
        if not self.info.has_tokenizer:
            return None
        config = load_config(self.info.model_dir, hf_overrides=self._engine_args.hf_overrides)
        return MultiModalProcessor.for_model(self.info.model_dir, config, self._engine_args.limit_mm_per_prompt)

    def _submit(self, command: Command) -> None:
        if isinstance(command, AbortCommand):
            self._decoder_forget(command.request_ids)
        with self._send_lock:
            try:
                self._cmd_send.send(command)
            except (BrokenPipeError, OSError) as e:
                if not self._stopping:
                    self._core_died(f"the engine-core process is gone ({e})")

    def _decoder_forget(self, request_ids: list[str]) -> None:
        with self._decode_lock:
            self._decoder.forget(request_ids)

    def _loop_alive(self) -> bool:
        return self.proc.is_alive() and self._reader.is_alive()

    def start(self) -> None:
        """Deliver outputs to the running event loop from now on."""
        if self._loop is not None:
            raise RuntimeError("AsyncMPClient.start() was already called")
        self._loop = asyncio.get_running_loop()

    async def shutdown(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """Abort every in-flight request, stop the engine-core process and wait for it."""
        self._stopping = True
        if self.proc.is_alive():
            self._begin_shutdown()
        await asyncio.get_running_loop().run_in_executor(None, self.proc.join, timeout)
        self._finalizer()

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    # -- the reader thread -------------------------------------------------------------------------------
    def _read(self) -> None:
        sink = self._sink
        while True:
            try:
                message = self._out_recv.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "out":
                _, items, errors, now = message
                with self._decode_lock:
                    outputs = self._decoder.decode(items)
                    self._decoder.forget(list(errors))
                sink.deliver(outputs, errors, now)
            elif kind == "stats":
                sink.publish_stats(message[1])
            elif kind == "call":
                sink.resolve(message[1], message[2], message[3])
            elif kind == "aborted":
                sink.aborted(message[1])
            elif kind == "dead":
                sink.dead(message[1])
        if not self._stopping:
            self.proc.join(2.0)
            self._core_died(f"the engine-core process exited (exit code {self.proc.exitcode})")

    def _core_died(self, reason: str) -> None:
        logger.error("%s", reason)
        self._sink.dead(reason)
