"""vLLM's torch profiler: `LLM.start_profile()` / `stop_profile()` and the server's POST /start_profile, /stop_profile.

Profiling is on only when ``VLLM_TORCH_PROFILER_DIR`` names a directory (vLLM's rule), or when ``profiler_config``
(``--profiler-config``, newer vLLM's) gives ``torch_profiler_dir``; the engine reads `TorchProfilerConfig` once, at
start-up. Each worker (every tensor-parallel rank, in its own process) records its own process: CPU activities, and
CUDA ones on a GPU. `stop_profile` writes one ``<host>_<pid>-rank<N>.<ns>.pt.trace.json.gz`` per worker
(``torch.profiler.tensorboard_trace_handler``, as vLLM), viewable in https://ui.perfetto.dev, and rank 0 logs a
short table of the ops that took the most time.
"""
from __future__ import annotations

import glob
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from pagedllm.json_object import parse_json_object

logger = logging.getLogger("pagedllm")

PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"
RECORD_SHAPES_ENV = "VLLM_TORCH_PROFILER_RECORD_SHAPES"
WITH_MEMORY_ENV = "VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY"
WITH_STACK_ENV = "VLLM_TORCH_PROFILER_WITH_STACK"
WITH_FLOPS_ENV = "VLLM_TORCH_PROFILER_WITH_FLOPS"
TABLE_ROWS = 20  # rows of the table logged at stop_profile

# profiler_config keys (vLLM's names) → TorchProfilerConfig fields; "profiler" is checked on its own.
_CONFIG_KEYS = {
    "torch_profiler_dir": "torch_profiler_dir",
    "torch_profiler_record_shapes": "record_shapes",
    "torch_profiler_with_memory": "with_memory",
    "torch_profiler_with_stack": "with_stack",
    "torch_profiler_with_flops": "with_flops",
}


class ProfilerError(RuntimeError):
    """start_profile / stop_profile called where they cannot act: profiling is off, or no profile is running."""


def profiler_disabled_error() -> ProfilerError:
    return ProfilerError(
        f"the torch profiler is off: set {PROFILER_DIR_ENV} to the directory for the traces before the engine "
        f"starts (e.g. {PROFILER_DIR_ENV}=./profiles), or pass profiler_config={{'torch_profiler_dir': DIR}} "
        "(--profiler-config '{\"torch_profiler_dir\": DIR}').")


def _env_flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    # vLLM's reading: anything but "0" turns a flag on.
    return environ.get(name, "1" if default else "0") != "0"


@dataclass(frozen=True)
class TorchProfilerConfig:
    """Where traces go (None: profiling is off) and what torch.profiler records (vLLM's defaults: stacks only)."""

    torch_profiler_dir: str | None = None
    record_shapes: bool = False
    with_memory: bool = False
    with_stack: bool = True
    with_flops: bool = False

    @property
    def enabled(self) -> bool:
        return self.torch_profiler_dir is not None

    @classmethod
    def from_env(cls, profiler_config: str | Mapping[str, Any] | None = None,
                 environ: Mapping[str, str] | None = None) -> TorchProfilerConfig:
        """The VLLM_TORCH_PROFILER_* variables, with `profiler_config`'s keys (a dict or a JSON object) over them.
        ValueError for a bad profiler_config."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {
            "torch_profiler_dir": env.get(PROFILER_DIR_ENV) or None,
            "record_shapes": _env_flag(env, RECORD_SHAPES_ENV, False),
            "with_memory": _env_flag(env, WITH_MEMORY_ENV, False),
            "with_stack": _env_flag(env, WITH_STACK_ENV, True),
            "with_flops": _env_flag(env, WITH_FLOPS_ENV, False),
        }
        values.update(_parse_profiler_config(profiler_config))
        if values["torch_profiler_dir"] is not None:
            values["torch_profiler_dir"] = os.path.abspath(os.path.expanduser(values["torch_profiler_dir"]))
        return cls(**values)


def _parse_profiler_config(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """profiler_config's keys as TorchProfilerConfig fields."""
    if value is None or value == "" or value == {}:
        return {}
    value = parse_json_object("profiler_config", value, '{"torch_profiler_dir": "./profiles"}')
    unknown = sorted(set(value) - set(_CONFIG_KEYS) - {"profiler"})
    if unknown:
        raise ValueError(f"profiler_config: unknown key(s) {unknown}; allowed: {['profiler', *_CONFIG_KEYS]}.")
    kind = value.get("profiler")
    if kind not in (None, "torch"):
        raise ValueError(f"profiler_config: profiler={kind!r} is not supported; allowed: 'torch' (or leave it out).")
    out: dict[str, Any] = {}
    for key, name in _CONFIG_KEYS.items():
        if key not in value:
            continue
        v = value[key]
        if key == "torch_profiler_dir":
            if not isinstance(v, str) or not v:
                raise ValueError(f"profiler_config: torch_profiler_dir must be a non-empty path, got {v!r}.")
        elif not isinstance(v, bool):
            raise ValueError(f"profiler_config: {key} must be true or false, got {v!r}.")
        out[name] = v
    if kind == "torch" and "torch_profiler_dir" not in out:
        raise ValueError("profiler_config: profiler='torch' needs torch_profiler_dir, the directory for the traces.")
    return out


class TorchProfiler:
    """One worker's torch.profiler session, from `start` to `stop` (a new one for every profile)."""

    def __init__(self, config: TorchProfilerConfig, device: torch.device, rank: int = 0) -> None:
        if not config.enabled:
            raise profiler_disabled_error()
        self.config = config
        self.rank = rank
        self.worker_name = f"{socket.gethostname()}_{os.getpid()}-rank{rank}"
        activities = [torch.profiler.ProfilerActivity.CPU]
        self.on_cuda = device.type == "cuda"
        if self.on_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(
            activities=activities, record_shapes=config.record_shapes, profile_memory=config.with_memory,
            with_stack=config.with_stack, with_flops=config.with_flops,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(config.torch_profiler_dir,
                                                                   worker_name=self.worker_name, use_gzip=True),
        )
        self.is_running = False

    def start(self) -> None:
        self._profile.start()
        self.is_running = True

    def stop(self) -> str | None:
        """Stop recording, write the trace (rank 0 also logs the top ops); the trace's path (None if not found)."""
        if not self.is_running:
            raise ProfilerError("stop_profile: no profile is running; call start_profile() first.")
        self.is_running = False
        self._profile.stop()  # without a schedule this runs on_trace_ready: the trace is written now
        path = self._trace_path()
        if self.rank == 0:
            sort_by = "self_device_time_total" if self.on_cuda else "self_cpu_time_total"
            logger.info("torch profiler: top %d ops by %s\n%s", TABLE_ROWS, sort_by,
                        self._profile.key_averages().table(sort_by=sort_by, row_limit=TABLE_ROWS))
        return path

    def _trace_path(self) -> str | None:
        pattern = os.path.join(glob.escape(self.config.torch_profiler_dir),
                               glob.escape(self.worker_name) + ".*.pt.trace.json.gz")
        paths = glob.glob(pattern)
        return max(paths, key=os.path.getmtime) if paths else None
