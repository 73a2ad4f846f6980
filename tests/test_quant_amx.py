"""The AMX-INT8 path of the GGUF int8 GEMM (kernels/cpu/quant_ops.c): every row gets the same bits as on the
vector paths (AVX-512 VNNI / AVX2) and as when computed alone, the library works with AMX off, and the ISA
string and ``PAGEDLLM_CPU_AMX`` say and decide when tiles are used."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedllm.kernels import cpu_isa, cpu_quant, reference
from pagedllm.kernels.cpu_quant import AMX_ENV, GGML_TYPES, GGUFWeight
from tests.test_quantized_gguf import random_blocks

_ISA = cpu_isa.detect_cpu_isa()
_HAS_AMX_FLAGS = {"amx_tile", "amx_int8"} <= _ISA.flags
ROWS = (1, 3, 16, 17, 40, 64)  # vectors only, one tile set, one plus a vector row, two plus 8 rows, four


def _weight(type_name: str, n: int = 72, seed: int = 0) -> tuple[GGUFWeight, int]:
    """Random weights: 72 rows (a partial group of 16), 17 blocks of 32 (two batches of 8 blocks and one)."""
    qtype = GGML_TYPES[type_name]
    k = 768 if cpu_quant.BLOCK_LAYOUT[qtype][0] == 256 else 544  # K-quants: 3 super-blocks = 24 blocks
    raw = torch.from_numpy(random_blocks(qtype, n, k, seed=seed + qtype))
    return GGUFWeight.from_gguf_blocks(raw, qtype, n, k), k


def _amx_outcome() -> str:
    """What turning AMX on in the CPU's own-level build gives here ("on", or why not); the state is restored."""
    kern = cpu_quant.load_quant_kernels(_ISA.detected)
    was_on, was_rows = kern.amx, kern.amx_min_rows
    outcome = kern.configure_amx(True)
    kern.configure_amx(was_on, was_rows)
    return outcome


@pytest.fixture
def amx_kernels():
    """The CPU's own-level build with AMX turned on for the test from 16 rows (below its default threshold, so
    that small batches take tiles too; skipped, with the reason, where it cannot be), then back to what it was."""
    outcome = _amx_outcome()
    if outcome != "on":
        pytest.skip(f"AMX-INT8 unavailable: {outcome}")
    kern = cpu_quant.load_quant_kernels(_ISA.detected)
    was_on, was_rows = kern.amx, kern.amx_min_rows
    kern.configure_amx(True, 16)
    yield kern
    kern.configure_amx(was_on, was_rows)


@pytest.mark.parametrize("type_name", sorted(GGML_TYPES))
def test_amx_rows_have_the_vector_paths_bits(amx_kernels, type_name):
    kern = amx_kernels
    vector_builds = [cpu_quant.load_quant_kernels(lv) for lv in ("avx2",) if _ISA.detected != "portable"]
    w, k = _weight(type_name)
    torch.manual_seed(GGML_TYPES[type_name])
    for m in ROWS:
        x = torch.randn(m, k) * 3
        y_amx = kern.linear(x, w, "int8")
        alone = torch.cat([kern.linear(x[i:i + 1], w, "int8") for i in range(m)])
        kern.configure_amx(False)
        try:
            y_vec = kern.linear(x, w, "int8")
        finally:
            kern.configure_amx(True, 16)
        assert torch.equal(y_amx, y_vec), f"{type_name} M={m}: AMX differs from {kern.isa}'s vector path"
        assert torch.equal(y_amx, alone), f"{type_name} M={m}: a row batched differs from the row alone"
        for other in vector_builds:
            assert torch.equal(y_amx, other.linear(x, w, "int8")), f"{type_name} M={m}: differs from {other.isa}"


def test_amx_output_is_the_int8_linear(amx_kernels):
    """Not only equal to the vector path: right (the int8 oracle) on a batch of tiles plus a remainder."""
    w, k = _weight("Q4_1", n=40)
    dense = amx_kernels.dequantize_rows(w, torch.arange(40))
    x = torch.randn(37, k)
    ref = reference.gguf_linear(x, dense, "int8")
    torch.testing.assert_close(amx_kernels.linear(x, w, "int8"), ref, rtol=1e-4,
                               atol=1e-4 * ref.abs().max().item())


def test_isa_string_follows_the_switch(amx_kernels):
    kern = amx_kernels
    assert kern.amx and kern.isa.endswith("+amx_int8")
    assert kern.configure_amx(False) == "off"
    assert not kern.amx and "amx" not in kern.isa
    assert kern.configure_amx(True) == "on" and kern.isa.endswith("+amx_int8")
    assert kern.amx_min_rows == 64  # the measured default
    kern.configure_amx(True, 1)
    assert kern.amx_min_rows == 16  # tiles take whole 16-row sets


def test_builds_without_amx_code_say_so():
    if _ISA.detected == "portable":
        pytest.skip("no AVX2 on this CPU")
    kern = cpu_quant.load_quant_kernels("avx2")  # 8-lane vectors: no tile code compiled in
    assert kern.configure_amx(True).startswith("not in this build")
    assert not kern.amx and "amx" not in kern.isa


def test_amx_wanted_only_when_asked_at_the_cpus_own_level(monkeypatch):
    amx_cpu = cpu_isa.CpuIsa("avx512_bf16", "avx512_bf16", frozenset({"amx_tile", "amx_int8"}), "test")
    monkeypatch.delenv(AMX_ENV, raising=False)
    assert cpu_quant.amx_wanted(amx_cpu, "avx512_bf16") == (False, f"off ({AMX_ENV}=1 turns it on)")
    monkeypatch.setenv(AMX_ENV, "1")
    assert cpu_quant.amx_wanted(amx_cpu, "avx512_bf16") == (True, "")
    assert not cpu_quant.amx_wanted(amx_cpu, "avx512")[0]  # a level forced below the CPU's own
    forced = cpu_isa.CpuIsa("avx2", "avx512_bf16", amx_cpu.flags, "forced")
    assert not cpu_quant.amx_wanted(forced, "avx2")[0]
    no_amx = cpu_isa.CpuIsa("avx512_bf16", "avx512_bf16", frozenset({"avx512_vnni"}), "test")
    assert cpu_quant.amx_wanted(no_amx, "avx512_bf16") == (False, "the CPU has no AMX-INT8")
    monkeypatch.delenv(AMX_ENV)  # the log names the missing feature, not the switch, where setting it cannot help
    assert cpu_quant.amx_wanted(no_amx, "avx512_bf16") == (False, "the CPU has no AMX-INT8")
    monkeypatch.setenv(AMX_ENV, "yes")
    with pytest.raises(ValueError, match=AMX_ENV):
        cpu_quant.amx_wanted(amx_cpu, "avx512_bf16")


_PROBE = (
    "import torch; from pagedllm.kernels import cpu_quant; from pagedllm.kernels.cpu_quant import GGUFWeight;"
    "from tests.test_quantized_gguf import random_blocks;"
    "k = cpu_quant.load_quant_kernels();"
    "w = GGUFWeight.from_gguf_blocks(torch.from_numpy(random_blocks(3, 48, 576)), 3, 48, 576);"
    "y = k.linear(torch.randn(70, 576), w);"
    "print(k.isa, bool(torch.isfinite(y).all()))"
)


def _probe(**env: str) -> str:
    """The ISA string and a 70-row GEMM's sanity from a fresh process started with ``env``."""
    full = {**os.environ, **env}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=full, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_start_up_env_decides():
    isa = os.environ.get(cpu_isa.ISA_ENV, "")
    off = _probe(**{AMX_ENV: "0"})
    assert "amx" not in off and off.endswith("True")
    on = _probe(**{AMX_ENV: "1"})
    assert on.endswith("True")
    own_level = not isa or isa == _ISA.detected
    if _HAS_AMX_FLAGS and own_level and _amx_outcome() == "on":
        assert "+amx_int8" in on
    else:
        assert "amx" not in on
