"""What the mp and Ray executors share: the driver rank, the step protocol, failure handling.

The driver (rank 0) lives in the engine process. Every step it encodes the ExecuteModelRequest
once (step_codec), announces its size to the other ranks through the backend's channel,
broadcasts the bytes over the gloo group, and runs its own shard; the model's collectives keep
the ranks in lock-step and only rank 0's logits are used (with pipeline stages, rank 0 receives them from
the last stage: model/pipeline.py). Any failure (a worker that died, a
collective that timed out, an exception on some rank) marks the executor failed: this and every
later call raise `TensorParallelWorkerError`, and the remaining workers are terminated.
"""
from __future__ import annotations

import logging
import os
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import PP_LAYER_PARTITION_ENV, TensorParallelGroup, pipeline_layer_counts
from pagedllm.distributed.process_group import (
    DistributedInitInfo,
    broadcast_bytes,
    create_master_store,
    default_backend,
    wait_for_ranks,
)
from pagedllm.executor.rpc import check_rpc_method, pack_method, unpack_results
from pagedllm.executor.step_codec import encode_request
from pagedllm.executor.worker_wrapper import WorkerWrapper
from pagedllm.model.models.registry import get_model_class, text_config
from pagedllm.model.pipeline import check_pipeline_parallel
from pagedllm.worker.cpu_threads import keep_thread_affinity
from pagedllm.worker.model_input import ExecuteModelRequest
from pagedllm.worker.profiler import TorchProfilerConfig

logger = logging.getLogger("pagedllm")

TIMEOUT_ENV = "PAGEDLLM_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 120.0


class TensorParallelWorkerError(RuntimeError):
    """A tensor-parallel worker died, hung past the timeout, or raised; the engine cannot go on."""


def dist_timeout_s() -> float:
    """Bound on any collective / worker reply while serving (env PAGEDLLM_DIST_TIMEOUT_S)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}.")
    return value


def check_model_parallelizable(hf_config, tp_size: int, config: EngineConfig | None = None) -> None:
    """Build every rank's model skeleton on the meta device: a head count that does not split
    raises the layers' ValueError here, before any process is started; so does what pipeline stages cannot run."""
    cls = get_model_class(hf_config)
    for rank in range(tp_size):
        with torch.device("meta"):
            cls(hf_config, TensorParallelGroup(rank, tp_size), torch.float32)
    if config is not None and config.parallel_config.pipeline_parallel_size > 1:
        pc = config.parallel_config
        check_pipeline_parallel(config, hf_config)
        pipeline_layer_counts(text_config(hf_config).num_hidden_layers, pc.pipeline_parallel_size,
                              os.environ.get(PP_LAYER_PARTITION_ENV))


class DistributedExecutorBase(ABC):
    """Driver side of SPMD tensor parallelism; subclasses say where ranks 1..N-1 live."""

    backend_name = "?"
    # Whether several steps may be in the pipeline stages at once (the driver receives each step's logits later,
    # receive_pipeline_logits); a backend that waits for every worker's step call (Ray) cannot.
    overlaps_pipeline_steps = False

    def __init__(self, config: EngineConfig, model_dir: str, hf_config, timeout_s: float | None = None) -> None:
        self.config = config
        self.world_size = config.parallel_config.world_size
        check_model_parallelizable(hf_config, config.parallel_config.tensor_parallel_size, config)
        self.timeout_s = timeout_s if timeout_s is not None else dist_timeout_s()
        self.device_name = config.device_config.resolve()
        self._error: str | None = None
        self._lock = threading.Lock()  # one step or control exchange at a time
        self._finalizer: weakref.finalize | None = None
        self._saved_threads = torch.get_num_threads()
        self._broadcasts_in_flight: list[tuple[Any, torch.Tensor]] = []  # (pipeline stages: _broadcast_step)
        self._restore_affinity = keep_thread_affinity(self)  # rank 0's CPU binding pins this thread
        self.driver = WorkerWrapper()
        try:
            host, local_only = self._host()
            store = create_master_store(host, self.world_size)  # binds a free port: no race
            info = DistributedInitInfo(
                host=host, port=store.port, world_size=self.world_size,
                backend=default_backend(self.device_name), timeout_s=self.timeout_s, local_only=local_only,
            )
            self._start_workers(config, model_dir, hf_config, info)
            wait_for_ranks(store, self.world_size, self._check_workers_alive, info.setup_timeout_s)
            self.driver.init_worker(config, model_dir, hf_config, info, 0, store, self._driver_local_rank())
            self._wait_workers_ready(info.setup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        pc = config.parallel_config
        logger.info("%s executor: %d rank(s) over %s (%d tensor-parallel x %d pipeline stage(s))", self.backend_name,
                    self.world_size, info.backend, pc.tensor_parallel_size, pc.pipeline_parallel_size)

    # -- backend hooks ----------------------------------------------------------------------
    @abstractmethod
    def _host(self) -> tuple[str, bool]:
        """(address the other ranks reach rank 0 at, whether every rank is on this host)."""

    @abstractmethod
    def _start_workers(self, config: EngineConfig, model_dir: str, hf_config, info: DistributedInitInfo) -> None:
        """Launch ranks 1..N-1 (they join the rendezvous and load their shards) and set self._finalizer."""

    @abstractmethod
    def _wait_workers_ready(self, timeout_s: float) -> None:
        """Block until every worker has loaded its shard; raise if one failed."""

    @abstractmethod
    def _start_call(self, method: str, args: tuple) -> Any:
        """Ask every worker to run Worker.`method`(*args); return a handle for _finish_call."""

    @abstractmethod
    def _finish_call(self, handle: Any, timeout_s: float | None = None) -> list[Any]:
        """Every worker's result of the call, in rank order (waiting at most `timeout_s`; None: the setup bound)."""

    @abstractmethod
    def _announce_step(self, nbytes: int) -> Any:
        """Tell every worker a step of `nbytes` encoded bytes follows by broadcast."""

    def _driver_local_rank(self) -> int | None:
        """The GPU index rank 0 uses on this host (None: GPU 0)."""
        return None

    def _finish_step(self, handle: Any) -> None:
        """After the driver's own step (Ray collects its calls' results here)."""

    @abstractmethod
    def _check_workers_alive(self) -> None:
        """Raise if a worker is known dead (cheap; no reply needed)."""

    @abstractmethod
    def _ping_workers(self, timeout_s: float) -> None:
        """Raise unless every worker answers within `timeout_s` (called only between steps)."""

    @abstractmethod
    def _describe_workers(self) -> str:
        """One line on each worker that died or reported an error ('' if none)."""

    # -- executor API -----------------------------------------------------------------------
    def _run_workers(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Run Worker.`method` on every rank at once (it may use collectives); results by rank."""
        self._raise_if_failed()
        with self._lock:
            try:
                handle = self._start_call(method, args)
                ours = self.driver.call(method, *args)
                return [ours, *self._finish_call(handle, timeout_s)]
            except BaseException as e:
                raise self._fail(f"{method} failed: {e!r}") from e

    def sleep(self, level: int = 1) -> None:
        """Every rank frees its KV pools and weights (Worker.sleep)."""
        self._run_workers("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._run_workers("wake_up", tags)

    def start_profile(self, config: TorchProfilerConfig) -> None:
        """Every rank starts torch.profiler in its own process (Worker.start_profile)."""
        self._run_workers("start_profile", config)

    def stop_profile(self) -> list[str | None]:
        """Every rank writes its own trace; their paths in rank order."""
        return self._run_workers("stop_profile")

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's collective_rpc: `method` on every rank at once, results in rank order. A method that raises on a
        rank raises WorkerRPCError here and the ranks keep serving; one that outlasts `timeout` seconds leaves the
        ranks out of step, which fails the executor (TensorParallelWorkerError)."""
        kwargs = check_rpc_method(method, args, kwargs)
        return unpack_results(self._run_workers("collective_rpc", pack_method(method), tuple(args), kwargs,
                                                timeout_s=timeout))

    def determine_num_available_blocks(self) -> tuple[int, int, int]:
        """Every rank sizes its own pools; the scheduler must fit the smallest."""
        results = self._run_workers("determine_num_available_blocks")
        logger.info("KV blocks per rank (device, cpu swap, cpu offloading): %s", results)
        return tuple(min(r[i] for r in results) for i in range(3))

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._run_workers("init_cache", num_gpu_blocks, num_cpu_blocks)
        self.driver.worker.model_runner.defer_pipeline_logits = self.pipeline_depth > 1

    @property
    def pipeline_depth(self) -> int:
        """How many steps the engine may have in flight at once: one per pipeline stage where the backend allows."""
        pp = self.config.parallel_config.pipeline_parallel_size
        # (CPU only: on a GPU a stage's NCCL sends and receives queue on one stream, so a step's logits waiting for
        # rank 0 would hold the next step's activations behind them)
        return pp if self.overlaps_pipeline_steps and self.device_name == "cpu" else 1

    def receive_pipeline_logits(self) -> torch.Tensor:
        """The logits of the oldest step in flight whose rank 0 result was PENDING_PIPELINE_LOGITS."""
        self._raise_if_failed()
        with self._lock:
            try:
                return self.driver.worker.model_runner.pipeline.recv_from_last_stage(self.device)
            except BaseException as e:
                raise self._fail(f"receiving a step's logits from the last pipeline stage failed: {e!r}") from e

    def execute_model(self, req: ExecuteModelRequest) -> torch.Tensor | None:
        """One SPMD step; returns rank 0's logits (the LM head gathers full rows on every rank; pipeline stages send
        the last stage's to rank 0)."""
        self._raise_if_failed()
        buf = encode_request(req)
        with self._lock:
            try:
                handle = self._announce_step(buf.size) if self.world_size > 1 else None
                if self.world_size > 1:
                    self._broadcast_step(torch.from_numpy(buf))
                logits = self.driver.execute_model(req)
                self._finish_step(handle)
                return logits
            except BaseException as e:
                raise self._fail(f"a model step failed: {e!r}") from e

    def _broadcast_step(self, buf: torch.Tensor) -> None:
        """The step's bytes to every rank. With steps overlapping in the pipeline stages the driver does not wait for
        the later stages to take them (they are still busy with earlier steps): the sends stay in flight, with their
        buffers."""
        if self.pipeline_depth == 1:
            broadcast_bytes(buf, self.driver.groups.cpu_group)
            return
        self._broadcasts_in_flight[:] = [(w, b) for w, b in self._broadcasts_in_flight if not w.is_completed()]
        self._broadcasts_in_flight.append((broadcast_bytes(buf, self.driver.groups.cpu_group, async_op=True), buf))

    def release_free_memory(self) -> None:
        """The engine is idle: every rank returns its freed host memory to the OS."""
        self._run_workers("release_free_memory")

    def check_health(self) -> None:
        """Raise TensorParallelWorkerError unless every rank is alive (and, between steps, answers)."""
        self._raise_if_failed()
        if self._lock.acquire(blocking=False):
            try:
                self._ping_workers(self.timeout_s)
            except Exception as e:
                raise self._fail(f"health check failed: {e!r}") from e
            finally:
                self._lock.release()
        else:  # a step is running; it is bounded by the collectives' timeout
            try:
                self._check_workers_alive()
            except Exception as e:
                raise self._fail(f"health check failed: {e!r}") from e

    @property
    def device(self) -> torch.device:
        return self.driver.worker.device

    @property
    def dtype(self) -> torch.dtype:
        return self.driver.worker.dtype

    def shutdown(self) -> None:
        """Stop and reap every worker (idempotent; also runs when the executor is collected)."""
        if self._finalizer is not None:
            self._finalizer()
        if self._error is None:
            self._error = f"the tensor-parallel {self.backend_name} executor was shut down"
        self.driver.groups = None  # drop rank 0's process groups and rendezvous store
        torch.set_num_threads(self._saved_threads)
        self._restore_affinity()

    # -- failure ----------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise TensorParallelWorkerError(self._error)

    def _fail(self, reason: str) -> BaseException:
        """Record the first failure, terminate the workers, and return the error to raise."""
        if self._error is None:
            details = ""
            try:
                details = self._describe_workers()
            except Exception as e:  # describing must never mask the failure itself
                details = f"(could not inspect workers: {e!r})"
            self._error = (
                f"tensor-parallel {self.backend_name} executor ({self.world_size} ranks) failed: "
                + (f"{details}; " if details else "")
                + f"cause: {reason}. The engine cannot continue; restart it."
            )
            logger.error(self._error)
            if self._finalizer is not None:
                self._finalizer()
        return TensorParallelWorkerError(self._error)
