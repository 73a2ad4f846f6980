"""Every Triton kernel compiles for Hopper (sm_90) and, FP8 aside, Ampere (sm_80) on any machine
(tests/kernel_compile_check.py): the interpreter runs their semantics on CPU, this proves their compiled form, so a
CPU-only CI catches a kernel no GPU would build."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# First, as in every kernel test: without CUDA it sets TRITON_INTERPRET before Triton is imported in this process, so
# the other kernel tests of the run get interpreted kernels whatever order they run in (the check itself runs in
# a subprocess without it).
import triton_setup  # noqa: F401

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent
UNSUPPORTED_TRITON = 3  # kernel_compile_check.py's exit status when this Triton lacks its hooks
# Shared memory a block may take (bytes): H100 227 KiB (as Triton reports it), A100 163 KiB. BENCHMARKS.md §79.1: a
# 576-wide head's prefill launch once asked the H100 for 384 KiB.
SHARED_MEMORY_LIMIT = {"sm_90": 232448, "sm_80": 166912}


def _nvidia_backend() -> bool:
    from triton import backends

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return "nvidia" in backends.backends and ptxas.exists()


def _kernels_in_tree() -> set[str]:
    """The launched kernels: @triton.jit functions named *_kernel in pagedllm/kernels/triton_*.py."""
    names: set[str] = set()
    for path in (ROOT / "pagedllm" / "kernels").glob("triton_*.py"):
        names |= set(re.findall(r"@triton\.jit[^\n]*\ndef (_\w+_kernel)\(", path.read_text()))
    return names


def _run_check(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / "pagedllm-kernel-compile-check")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "kernel_compile_check.py"), *args], env=env,
                          capture_output=True, text=True, timeout=900)
    if done.returncode == UNSUPPORTED_TRITON:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.skipif(not _nvidia_backend(), reason="this Triton has no NVIDIA backend with ptxas")
def test_every_triton_kernel_compiles_for_sm90_and_sm80():
    done = _run_check()
    built: dict[str, set[str]] = {}
    too_big = []
    for line in done.stdout.splitlines():
        arch, name, _, shared = line.split()
        built.setdefault(arch, set()).add(name)
        if int(shared) > SHARED_MEMORY_LIMIT[arch]:  # the launch would fail with OutOfResources on the GPU
            too_big.append((arch, name, int(shared)))
    assert not too_big, f"launches needing more shared memory than the GPU has: {too_big}"
    expected = _kernels_in_tree()
    assert len(expected) >= 15
    for arch, want in (("sm_90", expected), ("sm_80", expected - {"_quant_rows_kernel"})):  # sm_80 has no FP8
        got = built.get(arch, set())
        assert got == want, f"{arch}: not compiled {sorted(want - got)}; unknown {sorted(got - want)}"


@pytest.mark.skipif(not _nvidia_backend(), reason="this Triton has no NVIDIA backend with ptxas")
def test_unified_kernel_reads_an_fp8_v_tile_as_16_bit_through_ldmatrix():
    """An FP8 V tile converted right after its load reaches shared memory as fp16 and is read transposed by
    ldmatrix; left 8-bit (fp8_upcast=False, the former path) it is read byte by byte (BENCHMARKS.md §57.1: 1.3x the
    kernel's time on an H200)."""
    runs = {}
    for line in _run_check("--fp8-v-operand").stdout.splitlines():
        fields = dict(f.split("=") for f in line.split())
        upcast = fields.pop("upcast")
        runs[upcast] = {k: int(v) for k, v in fields.items()}
    new, old = runs["True"], runs["False"]
    assert new["shared_byte_loads"] == 0 and new["ldmatrix_trans"] > 0, runs
    assert old["shared_byte_loads"] > 0, runs  # the check sees the difference it guards
    # ptxas's figures (kernels/triton_compile_only.ptxas_usage): fewer registers, so more programs per SM, no spills.
    assert 0 < new["registers"] < old["registers"] and new["spill_stores"] == 0, runs
