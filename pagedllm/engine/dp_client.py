"""`DPAsyncMPClient`: `--data-parallel-size N` — N engine-core processes behind one API server.

Each rank is an `AsyncMPClient` with a whole copy of the model: its own scheduler, KV pool and step loop (vLLM's
data parallelism with internal load balancing). A CUDA rank sees its own `tensor_parallel_size` GPUs
(CUDA_VISIBLE_DEVICES); a CPU rank gets an equal share of the cores (its torch threads) and of the KV budget
(`EngineArgs.create_engine_config`). A request goes to the rank with the fewest requests in flight (ties go
round robin), and its stream, aborts and outputs stay with that rank. Calls that change engine state
(`reset_prefix_cache`, `remove_lora`) reach every rank; `call_between_steps` reads rank 0 (the dashboard's block
map shows that rank's pool). `stats()` sums the ranks' counters, so /metrics reports the whole server.
"""
from __future__ import annotations

import asyncio
import itertools
import os
from typing import Any, Callable, TypeVar

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import AsyncEngineFront, AsyncStream, StepObserver
from pagedllm.engine.core_client import AsyncMPClient
from pagedllm.engine.engine_info import EngineInfo
from pagedllm.engine.engine_loop import Command, EngineDeadError
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.engine.request_checker import RequestChecker
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.processor import MultiModalProcessor
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.cpu_threads import BIND_ENV, allowed_cpus, cpus_for_ranks, format_cpu_list

T = TypeVar("T")

# Ratios recomputed from the summed counters (numerator, denominator); other float gauges are averaged.
_RATIOS = {"spec_decode_acceptance_rate": ("spec_decode_num_accepted_tokens", "spec_decode_num_draft_tokens"),
           "spec_decode_mean_acceptance_length": ("spec_decode_num_emitted_tokens", "spec_decode_num_drafts")}


def _averaged(key: str) -> bool:
    return key.startswith("kv_frac_") or key.startswith("spec_decode_acceptance_rate_pos_")


def merge_stats(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """One snapshot for the whole server from the ranks': counters and gauges summed, flags all-of, ratios
    recomputed, fractions averaged, anything else (the KV dtype) from rank 0."""
    if not snapshots:
        return {}
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for s in snapshots for k in s):
        values = [s[key] for s in snapshots if key in s]
        if all(isinstance(v, bool) for v in values):
            merged[key] = all(values)
        elif all(isinstance(v, (int, float)) for v in values):
            merged[key] = sum(values) / len(values) if _averaged(key) else sum(values)
        else:
            merged[key] = values[0]
    for key, (num, den) in _RATIOS.items():
        if key in merged:
            merged[key] = merged.get(num, 0) / merged[den] if merged.get(den) else 0.0
    merged["data_parallel_size"] = len(snapshots)
    return merged


def rank_process_env(rank: int, engine_args: EngineArgs, cpu_cores: int, visible_gpus: list[str],
                     allowed: list[int] | None = None) -> dict[str, str]:
    """Environment of one rank's engine-core process: its GPUs (CUDA) or its share of the CPU cores (on the CPU,
    with VLLM_CPU_OMP_THREADS_BIND other than nobind, its tensor-parallel ranks' CPU lists, disjoint from the other
    data-parallel ranks')."""
    size = engine_args.data_parallel_size
    env = {"OMP_NUM_THREADS": str(max(1, cpu_cores // size))}
    per_rank = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size  # (a whole engine's ranks)
    if visible_gpus and engine_args.device != "cpu":
        if len(visible_gpus) < size * per_rank:
            raise ValueError(f"data_parallel_size={size} x tensor_parallel_size={engine_args.tensor_parallel_size} x "
                             f"pipeline_parallel_size={engine_args.pipeline_parallel_size} needs {size * per_rank} "
                             f"GPUs; {len(visible_gpus)} are visible.")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpus[rank * per_rank:(rank + 1) * per_rank])
        return env
    shares = cpus_for_ranks(os.environ.get(BIND_ENV, "auto"), size * per_rank, allowed)
    if shares is not None:
        mine = shares[rank * per_rank:(rank + 1) * per_rank]
        env[BIND_ENV] = "|".join(format_cpu_list(cpus) for cpus in mine)
        env["OMP_NUM_THREADS"] = str(len(mine[0]))
    return env


def _visible_gpus() -> list[str]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []



class DPAsyncMPClient(AsyncEngineFront):
    """`engine_args.data_parallel_size` engine-core processes as one async front (see the module docstring)."""

    def __init__(self, engine_args: EngineArgs, observer: StepObserver | None = None,
                 startup_timeout_s: float | None = None) -> None:
        self.ranks: list[AsyncMPClient] = []
        super().__init__(observer)
        gpus, cores = _visible_gpus(), len(allowed_cpus())
        envs = [rank_process_env(r, engine_args, cores, gpus) for r in range(engine_args.data_parallel_size)]
        try:
            for rank, env in enumerate(envs):
                self.ranks.append(AsyncMPClient(engine_args, observer, startup_timeout_s, process_env=env,
                                                name=f"pagedllm-engine-core-dp{rank}"))
        except BaseException:
            for client in self.ranks:
                client._finalizer()
            raise
        self._next = itertools.count()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, observer: StepObserver | None = None) -> DPAsyncMPClient:
        return cls(engine_args, observer)

    # -- what the ranks share ------------------------------------------------------------------------------
    @property
    def observer(self) -> StepObserver | None:
        return self._observer

    @observer.setter
    def observer(self, value: StepObserver | None) -> None:  # the warm-up request unsets it for a while
        self._observer = value
        for client in self.ranks:
            client.observer = value

    @property
    def info(self) -> EngineInfo:
        return self.ranks[0].info

    @property
    def request_checker(self) -> RequestChecker:
        return self.ranks[0].request_checker

    @property
    def mm_processor(self) -> MultiModalProcessor | None:
        return self.ranks[0].mm_processor

    @property
    def pids(self) -> list[int | None]:
        return [client.pid for client in self.ranks]

    def _submit(self, command: Command) -> None:
        raise RuntimeError("DPAsyncMPClient routes each command to a rank; nothing is submitted to it directly")

    def _loop_alive(self) -> bool:
        return all(client._loop_alive() for client in self.ranks)

    @property
    def is_healthy(self) -> bool:
        return self._dead_reason is None and all(client.is_healthy for client in self.ranks)

    @property
    def dead_reason(self) -> str | None:
        if self._dead_reason is not None:
            return self._dead_reason
        for rank, client in enumerate(self.ranks):
            if client.dead_reason is not None:
                return f"data-parallel rank {rank}: {client.dead_reason}"
        return None

    def stats(self) -> dict[str, Any]:
        return merge_stats([client.stats() for client in self.ranks])

    @property
    def num_steps(self) -> int:
        return sum(client.num_steps for client in self.ranks)

    @property
    def num_in_flight(self) -> int:
        return sum(client.num_in_flight for client in self.ranks)

    # -- requests -----------------------------------------------------------------------------------------
    def _pick_rank(self) -> AsyncMPClient:
        """The rank with the fewest requests in flight; among equals, the next in turn."""
        start = next(self._next) % len(self.ranks)
        order = self.ranks[start:] + self.ranks[:start]
        return min(order, key=lambda client: client.num_in_flight)

    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None,
        coalesce: bool = False, priority: int = 0, lora_request: LoRARequest | None = None,
    ) -> AsyncStream:
        if not self.is_healthy:
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        if any(request_id in client._streams for client in self.ranks):
            raise ValueError(f"request_id {request_id!r} is already in use")
        return await self._pick_rank().add_request(request_id, prompt, params, arrival_time, coalesce, priority,
                                                   lora_request)

    def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        unknown = set(ids)
        for client in self.ranks:
            mine = [rid for rid in ids if rid in client._streams]
            if mine:
                client.abort(mine)
                unknown.difference_update(mine)
        if unknown:  # already finished here (or never added): the ranks ignore ids they do not hold
            for client in self.ranks:
                client.abort(list(unknown))

    def abort_all(self, reason: str) -> int:
        if self._dead_reason is None:
            self._dead_reason = reason
        return sum(client.abort_all(reason) for client in self.ranks)

    # -- calls ----------------------------------------------------------------------------------------------
    async def call_between_steps(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)` on rank 0 (a reader: the dashboard's snapshot); state changes go to every rank."""
        return await self.ranks[0].call_between_steps(fn)

    async def reset_prefix_cache(self) -> bool:
        results = await asyncio.gather(*(client.reset_prefix_cache() for client in self.ranks))
        return all(results)

    async def remove_lora(self, lora_int_id: int) -> bool:
        results = await asyncio.gather(*(client.remove_lora(lora_int_id) for client in self.ranks))
        return any(results)

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        await asyncio.gather(*(client.sleep(level, mode) for client in self.ranks))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await asyncio.gather(*(client.wake_up(tags) for client in self.ranks))

    async def is_sleeping(self) -> bool:
        return any(await asyncio.gather(*(client.is_sleeping() for client in self.ranks)))

    async def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """Every rank's workers' results, rank after rank."""
        results = await asyncio.gather(*(client.collective_rpc(method, timeout, args, kwargs) for client in self.ranks))
        return [r for rank in results for r in rank]

    async def start_profile(self) -> None:
        await asyncio.gather(*(client.start_profile() for client in self.ranks))

    async def stop_profile(self) -> None:
        await asyncio.gather(*(client.stop_profile() for client in self.ranks))

    # -- life -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        for client in self.ranks:
            client.start()

    async def shutdown(self, timeout: float = 30.0) -> None:
        await asyncio.gather(*(client.shutdown(timeout) for client in self.ranks))
