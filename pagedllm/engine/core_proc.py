"""The engine-core process: an `LLMEngine` and its loop, away from the API server's interpreter.

`run_engine_core` is the process's main function (started by `core_client.AsyncMPClient`). It builds the
engine, reports `("ready", EngineInfo)` (or `("failed", exception)`: a bad argument's own ValueError /
FileNotFoundError / TypeError, which the server reports in one line as it does in-process), then runs
`EngineLoop` on its main thread while a reader thread moves commands from the API process's pipe onto the
loop's queue. What the
loop produces goes back over the other pipe, one message each (`PipeSink`):

    ("out", encoded outputs, {request_id: exception}, time)   a step's outputs (output_codec deltas)
    ("call", token, exception | None, result)                   a `call_between_steps` result
    ("aborted", [request_id, ...])                              for the metrics' abort counter
    ("stats", snapshot)                                         the /metrics snapshot
    ("dead", reason)                                            the engine can serve nothing more

The process ends after a stop command, or when the API process goes away (end of file on the command
pipe, or the parent-death signal on Linux), and never lingers as an orphan.
"""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import queue
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.engine_loop import AddCommand, EngineLoop, StopCommand
from pagedllm.engine.output_codec import OutputEncoder
from pagedllm.outputs import RequestOutput

logger = logging.getLogger("pagedllm.engine_core")

_PR_SET_PDEATHSIG = 1


def _picklable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else a RuntimeError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class PipeSink:
    """An `EngineSink` that sends everything to the API process (on the loop's thread)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.encoder = OutputEncoder()
        self._lock = threading.Lock()  # the loop and the reader thread (at stop) may both send

    def _send(self, message: tuple) -> None:
        with self._lock:
            try:
                self.conn.send(message)
            except (BrokenPipeError, EOFError, OSError):  # the API process is gone; the reader stops us
                pass

    def deliver(self, outputs: list[RequestOutput], errors: dict[str, BaseException], now: float) -> None:
        if errors:
            self.encoder.forget(list(errors))
        self._send(("out", self.encoder.encode(outputs), {k: _picklable(v) for k, v in errors.items()}, now))

    def resolve(self, token: Any, exc: BaseException | None, result: Any) -> None:
        try:
            self._send(("call", token, None if exc is None else _picklable(exc), result))
        except Exception as e:  # the result does not pickle
            self._send(("call", token, RuntimeError(f"the result could not be sent: {e}"), None))

    def aborted(self, request_ids: list[str]) -> None:
        self.encoder.forget(request_ids)
        self._send(("aborted", list(request_ids)))

    def publish_stats(self, stats: dict[str, Any]) -> None:
        self._send(("stats", stats))

    def dead(self, reason: str) -> None:
        self._send(("dead", reason))


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _read_commands(conn: Connection, commands: queue.Queue, sink: PipeSink) -> None:
    """Reader thread: pipe → loop queue; end of file (the API process is gone) stops the loop."""
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, OSError):
            commands.put(StopCommand())
            return
        if isinstance(cmd, AddCommand) and getattr(cmd.params, "use_beam_search", False):  # (PoolingParams: none)
            sink.encoder.whole_only.add(cmd.request_id)
        commands.put(cmd)
        if isinstance(cmd, StopCommand):
            return


def run_engine_core(engine_args: EngineArgs, cmd_conn: Connection, out_conn: Connection, parent_pid: int,
                    log_level: int, admission_window_s: float = 0.002, process_env: dict[str, str] | None = None) -> None:
    """Main of the engine-core process (see the module docstring). `process_env`: environment variables of this
    process alone (a data-parallel rank's CUDA_VISIBLE_DEVICES and CPU thread count), set before the engine is built."""
    _die_with_parent()
    if process_env:
        os.environ.update(process_env)
        if "OMP_NUM_THREADS" in process_env:  # torch read the variable at import, before it was set
            import torch

            torch.set_num_threads(int(process_env["OMP_NUM_THREADS"]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the API process decides
    if not logging.getLogger().handlers:  # spawned (a forked process keeps the parent's logging)
        logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
        from pagedllm.log_config import apply_log_config_from_env

        apply_log_config_from_env("engine core")
    if os.getppid() != parent_pid:  # the parent died before we got here
        return
    from pagedllm.engine.gc_heap import step_with_fewer_young_collections
    from pagedllm.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine.from_engine_args(engine_args)
    except (ValueError, FileNotFoundError, TypeError) as e:  # a bad argument: the API process reports it as such
        out_conn.send(("failed", _picklable(e)))
        return
    except BaseException as e:
        logger.exception("the engine could not be built")
        out_conn.send(("failed", RuntimeError(f"the engine could not be built: {type(e).__name__}: {e}")))
        return
    step_with_fewer_young_collections()  # this process only steps the engine (engine/gc_heap.py)
    sink = PipeSink(out_conn)
    commands: queue.Queue = queue.Queue()
    loop = EngineLoop(engine, sink, commands, admission_window_s)
    loop.publish_stats()
    out_conn.send(("ready", EngineInfo.of(engine)))
    reader = threading.Thread(target=_read_commands, args=(cmd_conn, commands, sink), name="pagedllm-core-reader",
                              daemon=True)
    reader.start()
    logger.info("engine core (pid %d) serving", os.getpid())
    loop.run()
    try:
        engine.executor.shutdown()
    except Exception:
        logger.exception("executor shutdown failed")
    out_conn.close()

