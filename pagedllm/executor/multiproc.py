"""The "mp" executor: tensor-parallel ranks 1..N-1 as spawned processes on this host.

Each worker process owns a duplex pipe to the engine. Messages are one tag byte + payload:
    C + pickle((method, args))  → run Worker.method on every rank; the worker replies
    E + 8-byte size             → a step follows by gloo broadcast; no reply (errors excepted)
    P                           → ping; the worker replies with its rank
    S                           → stop
A worker replies ("ok", result) or ("err", traceback); after an error in a step it exits, which
breaks the other ranks' collectives at once. Workers exit on EOF (the engine process died) and
are terminated by `shutdown()`, by garbage collection of the executor, or at interpreter exit.
Workers are started with "spawn"; a script that builds the engine at top level without an
`if __name__ == "__main__":` guard gets "fork" instead (see executor/start_method.py).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import struct
import sys
import time
import traceback
import weakref
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.distributed.process_group import DistributedInitInfo
from pagedllm.executor.start_method import worker_start_method
from pagedllm.executor.distributed_base import TIMEOUT_ENV, DistributedExecutorBase, TensorParallelWorkerError

logger = logging.getLogger("pagedllm")

_CALL, _STEP, _PING, _STOP = b"C", b"E", b"P", b"S"
_JOIN_TIMEOUT_S = 5.0


class MultiprocExecutor(DistributedExecutorBase):
    backend_name = "mp"
    overlaps_pipeline_steps = True  # (no reply per step: the driver never waits for a worker's step call)

    def _host(self) -> tuple[str, bool]:
        return "127.0.0.1", True

    def _start_workers(self, config: EngineConfig, model_dir: str, hf_config, info: DistributedInitInfo) -> None:
        ctx = multiprocessing.get_context(worker_start_method())
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self._errors: dict[int, str] = {}
        self._graceful = [True]  # shared with the finalizer: False after a failure (no polite wait)
        self._finalizer = weakref.finalize(self, _stop_processes, self._procs, self._conns, self._graceful)
        for rank in range(1, self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(child, rank, info, config, model_dir, hf_config, os.getpid()),
                name=f"pagedllm-tp-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def _wait_workers_ready(self, timeout_s: float) -> None:
        self._collect_replies(timeout_s, "load its model shard")

    def _fail(self, reason: str) -> BaseException:
        self._graceful[0] = False  # the ranks are out of step: stop them without a polite wait
        return super()._fail(reason)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # -- calls ------------------------------------------------------------------------------
    def _send_all(self, message: bytes) -> None:
        for rank, conn in enumerate(self._conns, start=1):
            try:
                conn.send_bytes(message)
            except (BrokenPipeError, ConnectionResetError, OSError) as e:
                raise TensorParallelWorkerError(f"could not reach worker rank {rank}: {e!r}") from e

    def _start_call(self, method: str, args: tuple) -> None:
        self._send_all(_CALL + pickle.dumps((method, args)))

    def _finish_call(self, handle: Any, timeout_s: float | None = None) -> list[Any]:
        # Calls such as determine_num_available_blocks may profile for a while: the setup bound.
        return self._collect_replies(timeout_s if timeout_s is not None else max(self.timeout_s, 600.0), "answer")

    def _collect_replies(self, timeout_s: float, what: str) -> list[Any]:
        """One reply per worker; raise on an error reply, a dead worker, or the deadline."""
        results: list[Any] = []
        deadline = time.monotonic() + timeout_s
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            while not conn.poll(0.1):
                if not proc.is_alive():
                    raise TensorParallelWorkerError(f"worker rank {rank} exited ({_exit_text(proc)}) before it could {what}")
                if time.monotonic() > deadline:
                    raise TensorParallelWorkerError(f"worker rank {rank} did not {what} within {timeout_s:.0f} s")
            status, value = _recv(conn)
            if status != "ok":
                self._errors[rank] = value
                raise TensorParallelWorkerError(f"worker rank {rank} raised:\n{value}")
            results.append(value)
        return results

    # -- steps ------------------------------------------------------------------------------
    def _announce_step(self, nbytes: int) -> None:
        self._send_all(_STEP + struct.pack("<q", nbytes))

    def _check_workers_alive(self) -> None:
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            if not proc.is_alive():
                self._read_error(rank, conn)
                raised = f"; it raised {self._errors[rank].strip().splitlines()[-1]}" if rank in self._errors else ""
                raise TensorParallelWorkerError(f"worker rank {rank} (pid {proc.pid}) exited ({_exit_text(proc)})"
                                                + raised)

    def _read_error(self, rank: int, conn: Connection) -> None:
        """Keep the error a worker sent before it exited (its traceback), if any."""
        if rank in self._errors:
            return
        try:
            while conn.poll(0):
                status, value = _recv(conn)
                if status == "err":
                    self._errors[rank] = value
        except Exception:  # a dead worker's pipe: its exit status says enough
            pass

    def _ping_workers(self, timeout_s: float) -> None:
        self._check_workers_alive()
        self._send_all(_PING)
        self._collect_replies(timeout_s, "answer a health check")

    def _describe_workers(self) -> str:
        lines = []
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            proc.join(0.5)  # a worker whose peer died exits right after; give it a moment
            self._read_error(rank, conn)
            if rank in self._errors:
                last = self._errors[rank].strip().splitlines()[-1]
                lines.append(f"worker rank {rank} (pid {proc.pid}) raised {last}")
            elif not proc.is_alive():
                lines.append(f"worker rank {rank} (pid {proc.pid}) exited ({_exit_text(proc)})")
        return "; ".join(lines) or (
            f"every worker process is still running, so one is hung (collectives time out after "
            f"{self.timeout_s:g} s, {TIMEOUT_ENV})"
        )


def _recv(conn: Connection) -> tuple[str, Any]:
    try:
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError) as e:
        raise TensorParallelWorkerError(f"lost the connection to a worker: {e!r}") from e


def _exit_text(proc) -> str:
    code = proc.exitcode
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stop_processes(procs: list, conns: list[Connection], graceful: list[bool]) -> None:
    """Ask each worker to stop (unless the group already failed), then terminate and finally kill
    whatever is left (never raises)."""
    if graceful[0]:
        for conn in conns:
            try:
                conn.send_bytes(_STOP)
            except Exception:
                pass
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    for sig, wait_s in (("terminate", 1.0 if graceful[0] else 0.2), ("kill", 5.0)):
        alive = [p for p in procs if p.is_alive()]
        for proc in alive:
            getattr(proc, sig)()
        for proc in alive:
            proc.join(wait_s)
    for conn in conns:
        try:
            conn.close()
        except Exception:
            pass


# -- the worker process ---------------------------------------------------------------------
def _worker_main(conn: Connection, rank: int, info: DistributedInitInfo, config, model_dir, hf_config, parent_pid: int) -> None:
    """Entry point of a worker process: init, then serve the engine until stop / EOF / error."""
    from pagedllm.executor.worker_wrapper import WorkerWrapper

    logging.basicConfig(level=logging.WARNING, format=f"[tp rank {rank}] %(levelname)s %(message)s")
    from pagedllm.log_config import apply_log_config_from_env

    apply_log_config_from_env(f"tp rank {rank}")  # the server's --log-config-file, as in its engine core
    # tqdm would otherwise create a multiprocessing lock that a fast exit leaves registered.
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    wrapper = WorkerWrapper()
    try:
        wrapper.init_worker(config, model_dir, hf_config, info, rank)
        _reply(conn, "ok", None)
    except BaseException:
        _reply(conn, "err", traceback.format_exc())
        _fast_exit(1)
    while True:
        try:
            while not conn.poll(1.0):
                if os.getppid() != parent_pid:  # the engine process is gone
                    _fast_exit(0)
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the engine closed the pipe or died
            _fast_exit(0)
        tag, body = message[:1], message[1:]
        try:
            if tag == _STEP:
                wrapper.receive_and_execute(struct.unpack("<q", body)[0])
            elif tag == _CALL:
                method, args = pickle.loads(body)
                _reply(conn, "ok", wrapper.call(method, *args))
            elif tag == _PING:
                _reply(conn, "ok", wrapper.ping())
            elif tag == _STOP:
                _fast_exit(0)
            else:
                raise ValueError(f"unknown message tag {tag!r}")
        except BaseException:
            # The ranks are no longer in step: report, then exit so peers' collectives fail fast.
            _reply(conn, "err", traceback.format_exc())
            _fast_exit(1)


def _fast_exit(code: int) -> None:
    """Leave without interpreter teardown (tearing down torch and the gloo group takes seconds)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def _reply(conn: Connection, status: str, value: Any) -> None:
    try:
        conn.send_bytes(pickle.dumps((status, value)))
    except (BrokenPipeError, OSError):
        pass
