"""Single-process executor: one worker in this process."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.executor.rpc import check_rpc_method, run_method
from pagedllm.worker.model_input import ExecuteModelRequest
from pagedllm.worker.cpu_threads import configure_cpu_threads
from pagedllm.worker.profiler import TorchProfilerConfig
from pagedllm.worker.worker import Worker


class UniProcExecutor:
    supports_async_scheduling = True  # the worker shares the sampler's device tensors
    def __init__(self, config: EngineConfig, model_dir: str, hf_config) -> None:
        self.config = config
        if config.device_config.resolve() == "cpu":
            configure_cpu_threads(0, 1)
        self.driver_worker = Worker(config, model_dir, hf_config)
        self.driver_worker.load_model()

    def determine_num_available_blocks(self) -> tuple[int, int, int]:
        return self.driver_worker.determine_num_available_blocks()

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.driver_worker.init_cache(num_gpu_blocks, num_cpu_blocks)

    def add_lora(self, request, in_use: set[int] = frozenset()) -> bool:
        return self.driver_worker.add_lora(request, in_use)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.driver_worker.remove_lora(lora_int_id)

    def execute_model(self, req: ExecuteModelRequest) -> torch.Tensor | None:
        return self.driver_worker.execute_model(req)

    @property
    def device(self) -> torch.device:
        return self.driver_worker.device

    @property
    def dtype(self) -> torch.dtype:
        return self.driver_worker.dtype

    def check_health(self) -> None:
        return None

    def release_free_memory(self) -> None:
        """The engine is idle: let the worker return freed host memory to the OS."""
        self.driver_worker.release_free_memory()

    def sleep(self, level: int = 1) -> None:
        self.driver_worker.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.driver_worker.wake_up(tags)

    def start_profile(self, config: TorchProfilerConfig) -> None:
        self.driver_worker.start_profile(config)

    def stop_profile(self) -> list[str | None]:
        """The trace's path, as a one-element list (rank order, as the distributed executors)."""
        return [self.driver_worker.stop_profile()]

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """The worker's result, as a one-element list (`timeout` has nothing to bound in one process)."""
        kwargs = check_rpc_method(method, args, kwargs)
        return [run_method(self.driver_worker, method, tuple(args), kwargs)]

    def shutdown(self) -> None:
        """Stop watching Triton builds: a later engine's warm start in this process is not this engine's step."""
        runner = self.driver_worker.model_runner
        if runner is not None:
            runner.compile_watch.uninstall()
