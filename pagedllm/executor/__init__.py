"""Executors: where the workers live. `uniproc` (one process), `mp` (processes), `ray` (actors)."""
from __future__ import annotations

from pagedllm.config import EngineConfig

_BACKENDS = ("mp", "ray")


def get_distributed_executor(config: EngineConfig, model_dir: str, hf_config):
    """The tensor-parallel executor `config.parallel_config` asks for ("mp" when tp > 1 names none)."""
    pc = config.parallel_config
    backend = pc.distributed_executor_backend or "mp"
    if backend == "uni":
        raise ValueError(
            f"distributed_executor_backend='uni' runs one process and cannot serve tensor_parallel_size="
            f"{pc.tensor_parallel_size} x pipeline_parallel_size={pc.pipeline_parallel_size}; use 'mp' (one host) "
            "or 'ray' (a Ray cluster)."
        )
    if backend == "mp":
        from pagedllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, model_dir, hf_config)
    if backend == "ray":
        from pagedllm.executor.ray import RayExecutor

        return RayExecutor(config, model_dir, hf_config)
    raise ValueError(f"distributed_executor_backend must be one of {list(_BACKENDS)}, got {backend!r}.")
