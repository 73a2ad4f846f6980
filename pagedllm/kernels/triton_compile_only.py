"""Triton launches compiled for an NVIDIA GPU on a machine without one, launching nothing.

Inside ``compile_only(arch)`` each launch of a ``@triton.jit`` kernel (through its own Python wrapper, on CPU
tensors, so it gets the constexprs, integer specialisations and dtypes a GPU step would give it) is compiled for
``sm_<arch>`` by Triton's NVIDIA backend and its bundled ptxas, and nothing runs. The compiled kernels (their PTX,
cubin, shared memory and warps) are collected, and ``ptxas_usage`` reads a kernel's registers and spills from ptxas.
``tests/kernel_compile_check.py`` proves every kernel builds this way; ``benchmarks/gpu/ptx_report.py`` reports what
Triton made of the attention launches (BENCHMARKS.md §57.1 found an FP8 kernel's byte-wise shared-memory reads so).
"""
from __future__ import annotations

import contextlib
import inspect
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction


class CompileOnlyDriver:
    """The parts of Triton's driver interface a launch asks for, answered for one CUDA architecture. Its device
    index is the architecture's number: each JIT function keeps its kernels (and its target) per device index."""

    def __init__(self, arch: int) -> None:
        self.arch = arch

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self) -> int:
        return self.arch

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@dataclass
class CompiledLaunch:
    """One launch's compiled kernel: the JIT function's name, the architecture and Triton's compiled kernel."""

    name: str
    arch: int
    kernel: object  # triton.compiler.CompiledKernel

    @property
    def ptx(self) -> str:
        return self.kernel.asm["ptx"]


def hooks_present() -> bool:
    """Whether this Triton has the hooks compile-only launches stand on (a swappable driver, warm-up launches)."""
    return hasattr(driver, "set_active") and "warmup" in inspect.signature(JITFunction.run).parameters


@contextlib.contextmanager
def compile_only(arch: int) -> Iterator[list[CompiledLaunch]]:
    """Within the block every Triton launch compiles for sm_`arch` and runs nothing; yields the list each compiled
    launch is appended to. RuntimeError when this Triton lacks the hooks (``hooks_present``)."""
    if not hooks_present():
        raise RuntimeError(f"Triton {triton.__version__} has no swappable driver or compile-only launch.")
    compiled: list[CompiledLaunch] = []
    launch = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(CompiledLaunch(self.fn.__name__, arch, kernel))
        return kernel

    # The driver in use before, restored as it was (reset_active() would create the default driver, which raises on a
    # machine without a GPU); Triton 3.2-3.9 keep it in `_active`, None until first asked for.
    previous = getattr(driver, "_active", None)
    JITFunction.run = run
    driver.set_active(CompileOnlyDriver(arch))
    try:
        yield compiled
    finally:
        JITFunction.run = launch
        driver._active = previous


def ptxas_path(arch: int) -> str:
    """The ptxas Triton's NVIDIA backend builds sm_`arch` with (Triton 3.9 ships a newer one for sm_90 and up)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch).path
    except (ImportError, TypeError, AttributeError):
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def ptxas_usage(launch: CompiledLaunch) -> dict[str, int]:
    """Registers per thread, spill stores / loads and stack bytes of a compiled launch, from ``ptxas -v`` on its PTX
    (sm_90 builds as sm_90a, as Triton does)."""
    arch = f"sm_{launch.arch}a" if launch.arch == 90 else f"sm_{launch.arch}"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(launch.ptx)
    try:
        done = subprocess.run([ptxas_path(launch.arch), f"-arch={arch}", "-v", f.name, "-o", os.devnull],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"ptxas failed on {launch.name}: {done.stderr[-2000:]}")
        out = done.stderr
    finally:
        os.unlink(f.name)

    def number(pattern: str) -> int:
        m = re.search(pattern, out)
        return int(m.group(1)) if m else 0

    return {"registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "stack": number(r"(\d+) bytes stack frame")}
