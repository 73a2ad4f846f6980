"""The "ray" executor: tensor-parallel ranks 1..N-1 as Ray actors, placed by a placement group.

Connects to the cluster named by RAY_ADDRESS, else to a running local cluster
(`ray start --head`, address="auto"), else starts a private local one (shut down with the
executor); RAY_ADDRESS=local always starts a private one. The placement group has one bundle per rank ({"GPU": 1} on CUDA, {"CPU": 1} on CPU);
bundle 0 is pinned to this node for the driver rank, which runs in the engine process. Each step
the driver calls `receive_and_execute(nbytes)` on every actor and broadcasts the encoded request
over the gloo group, exactly like the mp executor. The model directory must exist at the same
path on every node (a shared filesystem or a copy).
"""
from __future__ import annotations

import logging
import os
import traceback
import weakref
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.distributed.process_group import DistributedInitInfo
from pagedllm.executor.distributed_base import DistributedExecutorBase, TensorParallelWorkerError
from pagedllm.executor.worker_wrapper import WorkerWrapper

logger = logging.getLogger("pagedllm")

_PLACEMENT_TIMEOUT_S = 120.0


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "distributed_executor_backend='ray' needs Ray: `pip install ray` (check that it keeps your torch)."
        ) from e
    return ray


class RayExecutor(DistributedExecutorBase):
    backend_name = "ray"

    def _host(self) -> tuple[str, bool]:
        ray = _import_ray()
        self._owns_ray = False
        if not ray.is_initialized():
            self._owns_ray = _connect_or_start(ray, self.world_size)
        single_node = sum(1 for n in ray.nodes() if n.get("Alive")) == 1
        if single_node:
            return "127.0.0.1", True
        return ray.util.get_node_ip_address(), False

    def _start_workers(self, config: EngineConfig, model_dir: str, hf_config, info: DistributedInitInfo) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._actors: list[Any] = []
        on_gpu = info.backend == "nccl"
        unit = {"GPU": 1.0} if on_gpu else {"CPU": 1.0}
        driver_bundle = dict(unit, **{f"node:{ray.util.get_node_ip_address()}": 0.001})
        bundles = [driver_bundle] + [dict(unit) for _ in range(1, self.world_size)]
        self._pg = placement_group(bundles, strategy="PACK")
        self._finalizer = weakref.finalize(self, _release, ray, self._actors, self._pg, self._owns_ray)
        try:
            ray.get(self._pg.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError as e:
            raise TensorParallelWorkerError(
                f"the Ray cluster could not place {self.world_size} bundles of {unit} within "
                f"{_PLACEMENT_TIMEOUT_S:.0f} s; cluster resources: {ray.cluster_resources()}"
            ) from e
        self._driver_gpu: int | None = None
        if on_gpu:
            # Hold bundle 0's GPU with a placeholder actor: Ray then gives the other ranks other GPUs,
            # and the driver (which Ray does not schedule) uses the GPU the placeholder was given.
            holder = ray.remote(_GpuHolder).options(
                num_cpus=0, num_gpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self._pg, placement_group_bundle_index=0),
            ).remote()
            self._actors.append(holder)
            self._driver_gpu = int(ray.get(holder.gpu_id.remote(), timeout=_PLACEMENT_TIMEOUT_S))
        actor_cls = ray.remote(RayWorkerWrapper)
        workers = []
        for rank in range(1, self.world_size):
            actor = actor_cls.options(
                num_cpus=0 if on_gpu else 1,
                num_gpus=1 if on_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank
                ),
            ).remote()
            workers.append(actor)
        self._actors.extend(workers)
        self._workers = workers
        # Ray shows each actor only its own GPU, so every actor's local GPU index is 0.
        self._init_refs = [
            a.init_worker.remote(config, model_dir, hf_config, info, rank, None, 0 if on_gpu else None)
            for rank, a in enumerate(workers, start=1)
        ]

    def _driver_local_rank(self) -> int | None:
        return self._driver_gpu

    def _wait_workers_ready(self, timeout_s: float) -> None:
        self._get(self._init_refs, timeout_s, "load its model shard")

    def _get(self, refs: list[Any], timeout_s: float, what: str) -> list[Any]:
        ray = _import_ray()
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise TensorParallelWorkerError(f"a Ray worker did not {what} within {timeout_s:.0f} s") from e
        except ray.exceptions.RayError as e:
            raise TensorParallelWorkerError(f"a Ray worker failed to {what}: {e}") from e

    def _start_call(self, method: str, args: tuple) -> list[Any]:
        return [a.call.remote(method, *args) for a in self._workers]

    def _finish_call(self, handle: list[Any], timeout_s: float | None = None) -> list[Any]:
        return self._get(handle, timeout_s if timeout_s is not None else max(self.timeout_s, 600.0), "answer")

    def _announce_step(self, nbytes: int) -> list[Any]:
        return [a.receive_and_execute.remote(nbytes) for a in self._workers]

    def _finish_step(self, handle: list[Any]) -> None:
        # The collectives kept every rank in step with the driver, so this returns at once.
        self._get(handle, self.timeout_s, "finish a step")

    def _check_workers_alive(self) -> None:
        ray = _import_ray()
        if not getattr(self, "_workers", None):
            return
        # An init call that already failed (e.g. the actor died) is the cheap signal here.
        done, _ = ray.wait(list(getattr(self, "_init_refs", [])), num_returns=len(self._init_refs), timeout=0)
        for ref in done:
            ray.get(ref)

    def _ping_workers(self, timeout_s: float) -> None:
        self._get([a.ping.remote() for a in self._workers], timeout_s, "answer a health check")

    def _describe_workers(self) -> str:
        ray = _import_ray()
        lines = []
        for rank, actor in enumerate(getattr(self, "_workers", []), start=1):
            try:
                ray.get(actor.ping.remote(), timeout=2.0)
            except ray.exceptions.GetTimeoutError:
                lines.append(f"worker rank {rank} does not answer")
            except ray.exceptions.RayError as e:
                lines.append(f"worker rank {rank}: {type(e).__name__}: {str(e).strip().splitlines()[0]}")
        return "; ".join(lines)


class _GpuHolder:
    """Placeholder actor that reserves the driver's GPU inside the placement group."""

    def gpu_id(self) -> int:
        import ray

        return int(ray.get_gpu_ids()[0])


class RayWorkerWrapper(WorkerWrapper):
    """The actor class: a failed step kills the actor, so the other ranks' collectives fail fast."""

    def receive_and_execute(self, nbytes: int) -> None:
        try:
            super().receive_and_execute(nbytes)
        except BaseException:
            logger.error("tensor-parallel rank %d failed a step; exiting:\n%s", self.rank, traceback.format_exc())
            os._exit(1)


def _connect_or_start(ray, world_size: int) -> bool:
    """Join RAY_ADDRESS or a running local cluster; else start a private one. True if started here."""
    address = os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address, log_to_driver=True)
        return False
    if not address:
        try:
            ray.init(address="auto", log_to_driver=True)
            logger.info("Connected to the running Ray cluster")
            return False
        except ConnectionError:
            pass
    num_cpus = max(os.cpu_count() or 1, world_size)
    ray.init(
        address="local", num_cpus=num_cpus, include_dashboard=False, object_store_memory=256 << 20,
        log_to_driver=True,
    )
    logger.info("Started a local Ray cluster (%d CPUs) for this engine", num_cpus)
    return True


def _release(ray, actors: list[Any], pg, owns_ray: bool) -> None:
    """Kill the actors, free the placement group, and stop a cluster we started (never raises)."""
    if not ray.is_initialized():
        return
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass
    try:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)
    except Exception:
        pass
    if owns_ray:
        try:
            ray.shutdown()
        except Exception:
            pass
