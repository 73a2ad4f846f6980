"""One tensor-parallel rank: joins the groups, loads its shard, and follows the driver step by step.

Used in the engine process for rank 0 (the driver) and in every worker process / Ray actor for
ranks 1..N-1. A step is announced out of band (a pipe message or a Ray call carrying its size),
then its encoded ExecuteModelRequest arrives by a gloo broadcast from rank 0, so no rank waits in
a collective while the engine is idle and every collective is bounded by the group's timeout.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import PP_LAYER_PARTITION_ENV, make_pipeline_group
from pagedllm.distributed.process_group import (
    DistributedInitInfo,
    RankGroups,
    broadcast_bytes,
    init_tensor_parallel_group,
)
from pagedllm.executor.rpc import run_method_guarded
from pagedllm.executor.step_codec import decode_request
from pagedllm.model.models.registry import text_config
from pagedllm.worker.cpu_threads import configure_cpu_threads
from pagedllm.worker.model_input import ExecuteModelRequest
from pagedllm.worker.worker import Worker

logger = logging.getLogger("pagedllm")

# Worker methods the driver may call on every rank (anything else is refused); collective_rpc runs any method.
ALLOWED_CALLS = ("determine_num_available_blocks", "init_cache", "release_free_memory", "sleep", "wake_up",
                 "start_profile", "stop_profile")


class WorkerWrapper:
    """Holds a rank's Worker and groups; the same object serves mp processes and Ray actors."""

    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.groups: RankGroups | None = None
        self.rank = -1

    def init_worker(
        self, config: EngineConfig, model_dir: str, hf_config, info: DistributedInitInfo, rank: int,
        store=None, local_rank: int | None = None,
    ) -> None:
        """Join the rendezvous as `rank` (on GPU `local_rank`), then build and load this rank's shard."""
        self.rank = rank
        if config.device_config.resolve() == "cpu":
            configure_cpu_threads(rank, info.world_size)
        pc = config.parallel_config
        self.groups = init_tensor_parallel_group(info, rank, store, local_rank, pc.tensor_parallel_size)
        pp = None
        if pc.pipeline_parallel_size > 1:
            pp = make_pipeline_group(text_config(hf_config).num_hidden_layers, pc.pipeline_parallel_size,
                                     pc.tensor_parallel_size, rank, self.groups.pipeline_group,
                                     os.environ.get(PP_LAYER_PARTITION_ENV))
        self.worker = Worker(config, model_dir, hf_config, self.groups.tp, pp)
        self.worker.load_model()

    def call(self, method: str, *args: Any) -> Any:
        if method == "collective_rpc":  # (method, args, kwargs): ("ok", result) or ("err", traceback)
            return run_method_guarded(self.worker, *args)
        if method not in ALLOWED_CALLS:
            raise ValueError(f"unknown worker call {method!r}; allowed: {list(ALLOWED_CALLS)}")
        return getattr(self.worker, method)(*args)

    def receive_and_execute(self, nbytes: int) -> None:
        """Take part in one step: receive its request from rank 0, run the model shard."""
        buf = torch.empty(nbytes, dtype=torch.uint8)
        broadcast_bytes(buf, self.groups.cpu_group)
        self.worker.execute_model(decode_request(buf.numpy()))

    def ping(self) -> int:
        return self.rank

    def execute_model(self, req: ExecuteModelRequest) -> torch.Tensor | None:
        return self.worker.execute_model(req)
