"""Process groups for tensor parallelism, built without torch's global default group.

Each rank calls `init_tensor_parallel_group(info, rank)`; rank 0 (the driver, in the engine
process) hosts the TCP rendezvous store. The groups are standalone `ProcessGroupGloo` /
`ProcessGroupNCCL` objects handed down explicitly, so several engines may live in one process
and nothing global is left behind at shutdown.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from pagedllm.distributed.parallel_state import TensorParallelGroup

_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class DistributedInitInfo:
    """Where and how the ranks meet (picklable; sent to every worker)."""

    host: str
    port: int
    world_size: int
    backend: str = "gloo"  # "gloo" (CPU) or "nccl" (CUDA) for the model's collectives
    timeout_s: float = 120.0  # bound on every collective once the engine runs
    setup_timeout_s: float = 600.0  # bound on rendezvous and model loading
    local_only: bool = True  # every rank on this host: talk over 127.0.0.1

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {list(_BACKENDS)}, got {self.backend!r}.")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size!r}.")
        if self.timeout_s <= 0 or self.setup_timeout_s <= 0:
            raise ValueError("timeout_s and setup_timeout_s must be > 0 seconds.")


@dataclass
class RankGroups:
    """What one rank holds: the model's TP group (its pipeline stage's ranks), a CPU (gloo) group of every rank for
    control messages, and with pipeline stages a group of every rank for their point-to-point activations."""

    tp: TensorParallelGroup
    cpu_group: Any
    store: Any  # keeps the rendezvous store alive as long as the groups
    pipeline_group: Any = None


def default_backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _gloo_group(store, rank: int, info: DistributedInitInfo, size: int | None = None):
    size = info.world_size if size is None else size
    try:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = _td(info.setup_timeout_s)
        if info.local_only:
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        else:
            opts._devices = [dist.ProcessGroupGloo.create_default_device()]
        pg = dist.ProcessGroupGloo(store, rank, size, opts)
    except AttributeError:  # older torch without _Options: default device, same timeouts
        pg = dist.ProcessGroupGloo(store, rank, size, _td(info.setup_timeout_s))
    pg.set_timeout(_td(info.timeout_s))  # rendezvous may be slow; steps must not be
    return pg


def _nccl_group(store, rank: int, info: DistributedInitInfo, size: int | None = None):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = _td(info.timeout_s)
    return dist.ProcessGroupNCCL(store, rank, info.world_size if size is None else size, opts)


def create_master_store(host: str, world_size: int, timeout_s: float = 600.0):
    """Rank 0's rendezvous store on a free port of `host` (read it back from `.port`)."""
    return dist.TCPStore(host, 0, world_size, True, timeout=_td(timeout_s), wait_for_workers=False)


def _client_store(info: DistributedInitInfo):
    return dist.TCPStore(
        info.host, info.port, info.world_size, False, timeout=_td(info.setup_timeout_s), wait_for_workers=False
    )


def wait_for_ranks(store, world_size: int, check_alive: Callable[[], None], timeout_s: float) -> None:
    """On rank 0: wait until every other rank has reached the store, calling `check_alive` meanwhile."""
    keys = [f"joined/{r}" for r in range(1, world_size)]
    deadline = time.monotonic() + timeout_s
    while keys and not store.check(keys):
        check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"tensor-parallel workers did not join within {timeout_s:.0f} s")
        time.sleep(0.05)


def init_tensor_parallel_group(
    info: DistributedInitInfo, rank: int, store=None, local_rank: int | None = None, tp_size: int | None = None,
) -> RankGroups:
    """Join the rendezvous as `rank` and build this rank's groups (blocks until all ranks join).

    `tp_size` (default: every rank) is the ranks per pipeline stage: ranks are numbered stage-major, and each stage's
    model group spans its own `tp_size` ranks. On CUDA the rank uses GPU `local_rank` (default: `rank`, i.e. one GPU
    per rank on this host).
    """
    if not 0 <= rank < info.world_size:
        raise ValueError(f"rank must be in [0, {info.world_size}), got {rank}.")
    tp_size = info.world_size if tp_size is None else tp_size
    if tp_size < 1 or info.world_size % tp_size:
        raise ValueError(f"tp_size ({tp_size}) must divide the world size ({info.world_size}).")
    if info.backend == "nccl":
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    if store is None:
        if rank == 0:
            raise ValueError("rank 0 serves the rendezvous: pass the store from create_master_store().")
        store = _client_store(info)
    if rank > 0:
        store.set(f"joined/{rank}", "1")
    cpu_group = _gloo_group(dist.PrefixStore("cpu/", store), rank, info)
    if tp_size == info.world_size:  # tensor parallelism only
        model_group = cpu_group if info.backend == "gloo" else _nccl_group(dist.PrefixStore("tp/", store), rank, info)
        return RankGroups(TensorParallelGroup(rank, info.world_size, model_group), cpu_group, store)
    stage, tp_rank = divmod(rank, tp_size)
    model_group = None
    if tp_size > 1:  # this stage's ranks only
        stage_store = dist.PrefixStore(f"tp{stage}/", store)
        model_group = (_gloo_group(stage_store, tp_rank, info, tp_size) if info.backend == "gloo"
                       else _nccl_group(stage_store, tp_rank, info, tp_size))
    pipeline_group = cpu_group if info.backend == "gloo" else _nccl_group(dist.PrefixStore("pp/", store), rank, info)
    return RankGroups(TensorParallelGroup(tp_rank, tp_size, model_group), cpu_group, store, pipeline_group)


def broadcast_bytes(buf: torch.Tensor, cpu_group, async_op: bool = False):
    """Broadcast a uint8 CPU tensor from rank 0 to all ranks of `cpu_group` (in place); `async_op`: return the work
    instead of waiting for every rank to receive it (keep `buf` alive until it completes)."""
    return dist.broadcast(buf, group=cpu_group, group_src=0, async_op=async_op)
