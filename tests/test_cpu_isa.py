"""Every x86 CPU works (issue 18): ISA detection, the native kernels built for each level the CPU can run
(AVX-512, AVX2+FMA, portable) against their torch references, the bundled model's greedy output under
forced lower levels, and bfloat16 on an (emulated) AVX2 machine: a fallback, never a crash in oneDNN."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels import cpu_isa, cpu_kernels, cpu_linear, reference
from tests.test_cpu_kernels import _mixed_batch, check_bf16_pool, check_tokens_get_their_lone_bits

DETECTED = cpu_isa.isa_from_flags(cpu_isa.cpu_flags()) if cpu_isa._is_x86_64() else "portable"
RUNNABLE = cpu_isa.ISA_LEVELS[: cpu_isa.ISA_LEVELS.index(DETECTED) + 1]
REPO = Path(__file__).resolve().parents[1]

ZEN1 = ["fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "popcnt"]
SKYLAKE_SP = ZEN1 + ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"]
ZEN4 = SKYLAKE_SP + ["avx512_bf16", "avx512_vnni"]


def _isa_param(isa: str):
    return pytest.param(isa, marks=pytest.mark.skipif(isa not in RUNNABLE, reason=f"this CPU runs only {RUNNABLE}"))


ALL_ISAS = [_isa_param(i) for i in cpu_isa.ISA_LEVELS]


def _isa_resolve_clear():
    cpu_isa._resolve.cache_clear()
    cpu_kernels.load_cpu_kernels.cache_clear()


@pytest.fixture
def forced_isa(monkeypatch):
    """Set PAGEDLLM_CPU_ISA for one test (caches cleared before and after)."""
    def force(level: str | None) -> None:
        if level is None:
            monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_isa.ISA_ENV, level)
        _isa_resolve_clear()

    yield force
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
    _isa_resolve_clear()


# ------------------------------------------------------------------------------------------ detection


def test_levels_from_flags_and_compile_flags():
    assert cpu_isa.isa_from_flags(set()) == "portable"
    assert cpu_isa.isa_from_flags(set(ZEN1) - {"f16c"}) == "portable"
    assert cpu_isa.isa_from_flags(set(ZEN1)) == "avx2"
    assert cpu_isa.isa_from_flags(set(SKYLAKE_SP)) == "avx512"
    assert cpu_isa.isa_from_flags(set(ZEN4)) == "avx512_bf16"
    assert cpu_isa.isa_from_flags(set(ZEN1) | {"avx512_bf16"}) == "avx2"  # levels are cumulative
    assert cpu_isa.missing_flags(set(ZEN1), "avx512") == ["avx512f", "avx512bw", "avx512vl", "avx512dq"]
    assert cpu_isa.c_compile_flags("portable") == ["-O3"]
    assert cpu_isa.c_compile_flags("avx2") == ["-O3", "-mavx2", "-mfma", "-mf16c"]
    assert "-mavx512bw" in cpu_isa.c_compile_flags("avx512")
    assert not any("native" in f for lv in cpu_isa.ISA_LEVELS for f in cpu_isa.c_compile_flags(lv))
    with pytest.raises(ValueError, match="not one of"):
        cpu_isa.c_compile_flags("sse3")


def test_env_override_and_its_errors(forced_isa, caplog):
    with caplog.at_level("INFO", logger="pagedllm"):
        forced_isa(None)
        assert cpu_isa.detect_cpu_isa().name == DETECTED
        forced_isa("portable")
        isa = cpu_isa.detect_cpu_isa()
    assert (isa.name, isa.detected) == ("portable", DETECTED) and not isa.at_least("avx2")
    assert f"CPU ISA: portable, forced by PAGEDLLM_CPU_ISA=portable (the CPU supports {DETECTED})" in caplog.text
    forced_isa("avx512_fp16")
    with pytest.raises(ValueError, match=r"PAGEDLLM_CPU_ISA='avx512_fp16' is not one of"):
        cpu_isa.detect_cpu_isa()
    above = [lv for lv in cpu_isa.ISA_LEVELS if lv not in RUNNABLE]
    if above:
        forced_isa(above[-1])
        with pytest.raises(ValueError, match=f"above what this CPU supports: it lacks .*Allowed here: "
                                             f"{', '.join(RUNNABLE)}"):
            cpu_isa.detect_cpu_isa()
        forced_isa(None)  # an explicit level above the CPU's is refused by the loader itself
        with pytest.raises(ValueError, match="cannot build CPU kernels"):
            cpu_kernels.load_cpu_kernels(above[-1])


# ------------------------------------------------------------------------------ each level's kernels


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_level_build_is_its_own_and_matches_references(isa, kernels_by_isa):
    """Each level's library (its own file, no wider instructions than its level) against the torch
    reference: attention on a mixed decode + prefill batch, the cache write, RMSNorm (+ residual),
    RoPE, SiLU·mul; head_dim 64 and 80 (80 is not a multiple of the AVX-512 width: scalar tails)."""
    k = kernels_by_isa[isa]
    assert k.isa == isa and f"-{isa}-" in k.path.name
    assert len({kk.path for kk in kernels_by_isa.values()}) == len(kernels_by_isa)
    for d, bs in ((64, 16), (80, 8)):
        query, key, value, kc, vc, meta = _mixed_batch(seed=d, block_size=bs, hq=9, hk=3, d=d)
        kc2, vc2 = kc.clone(), vc.clone()
        reference.reshape_and_cache(key, value, kc, vc, meta.slot_mapping)
        k.reshape_and_cache(key, value, kc2, vc2, meta.slot_mapping)
        assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
        out = torch.full_like(query, float("nan"))
        k.paged_attention(out, query, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, d**-0.5)
        tables = [row[: -(-n // bs)] for row, n in zip(meta.block_tables.tolist(), meta.seq_lens_cpu)]
        expected = reference.paged_attention_naive(query, kc, vc, tables, meta.seq_lens_cpu, meta.query_lens_cpu,
                                                   d**-0.5)
        torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-5)
        check_bf16_pool(k, query, key, value, kc, vc, meta, d)  # --kv-cache-dtype bfloat16 on this level
    g = torch.Generator().manual_seed(7)
    x, res, w = torch.randn(37, 200, generator=g), torch.randn(37, 200, generator=g), torch.randn(200, generator=g)
    rms = lambda s: w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(k.rms_norm(x, w, 1e-6), rms(x), atol=1e-5, rtol=1e-5)
    y, s = k.fused_add_rms_norm(x, res, w, 1e-6)
    torch.testing.assert_close(s, x + res)
    torch.testing.assert_close(y, rms(x + res), atol=1e-5, rtol=1e-5)
    head, t = 64, 37
    inv = 1.0 / (10000 ** (torch.arange(0, head, 2).float() / head))
    freqs = torch.outer(torch.arange(300).float(), inv)
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    pos = torch.randint(0, 300, (t,), generator=g)
    qkv = torch.randn(t, 5 * head, generator=g)
    q, kk = qkv[:, : 3 * head], qkv[:, 3 * head : 4 * head]
    eq, ek = (_rope(z.reshape(t, -1, head), cos[pos], sin[pos]).reshape(t, -1) for z in (q, kk))
    k.rotary_embedding(pos, q, kk, cos, sin, head)
    torch.testing.assert_close(q, eq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kk, ek, atol=1e-5, rtol=1e-5)
    for inter in (64, 100):
        xs = 4 * torch.randn(t, 2 * inter, generator=g)
        gate, up = xs.chunk(2, dim=-1)
        torch.testing.assert_close(k.silu_and_mul(xs), F.silu(gate) * up, atol=1e-6, rtol=4e-6)


@pytest.mark.parametrize("isa", ALL_ISAS)
@pytest.mark.parametrize("d", [64, 72])
def test_level_gives_a_chunks_tokens_their_lone_bits(isa, d, kernels_by_isa):
    """On every level the CPU runs, a verification-sized chunk's tokens get the bits each gets alone as a decode
    (speculative decoding's exactness rests on it), with their rows of several tokens sharing V loads; head_dim
    72 (not a multiple of AVX-512's 16 lanes) takes the scalar token path there."""
    check_tokens_get_their_lone_bits(kernels_by_isa[isa], 9, 3, 300, d)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rotated * sin[:, None]


# ------------------------------------------------------------------------ the model on each level


@pytest.fixture(scope="module")
def default_greedy(parity_prompts):
    """The default path's greedy tokens (16 each) for 4 short prompts."""
    return _greedy(parity_prompts[:4])


def _greedy(prompts):
    from pagedllm import LLM, SamplingParams

    llm = LLM(num_gpu_blocks_override=64, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    backend = llm.llm_engine.executor.driver_worker.model_runner.attn_backend
    return [list(o.outputs[0].token_ids) for o in outs], backend


@pytest.mark.parametrize("isa", [_isa_param("avx2"), _isa_param("portable")])
def test_model_greedy_is_identical_on_forced_levels(isa, forced_isa, parity_prompts, default_greedy):
    forced_isa(isa)
    tokens, backend = _greedy(parity_prompts[:4])
    assert backend.kernels.isa == isa
    assert tokens == default_greedy[0]


# ---------------------------------------------------------------------- bfloat16 without AVX-512


def _run_bf16(extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from pagedllm import LLM, SamplingParams\n"
            "llm = LLM(dtype='bfloat16', num_gpu_blocks_override=32, max_model_len=256)\n"
            "o = llm.generate(['The capital of France is'], SamplingParams(temperature=0.0, max_tokens=4), "
            "use_tqdm=False)\n"
            "print('TOKENS', list(o[0].outputs[0].token_ids))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **extra_env}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.skipif(not cpu_isa._is_x86_64(), reason="ONEDNN_MAX_CPU_ISA=AVX2 emulates an x86 AVX2 machine")
@pytest.mark.parametrize("isa_env", [{}, _isa_param("avx2")], ids=["onednn-capped", "forced-avx2"])
def test_bf16_on_an_avx2_machine_falls_back_with_one_warning(isa_env):
    """oneDNN capped at AVX2 (the Zen 1 crash: `mkldnn_reorder_linear_weight: bf16 path needs ...
    avx512bw`) and/or the AVX2 level forced: bfloat16 runs F.linear, says so once, and generates."""
    env = {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    if isa_env:
        env[cpu_isa.ISA_ENV] = "avx2"
    proc = _run_bf16(env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mkldnn_reorder_linear_weight" not in proc.stderr
    assert proc.stderr.count("bfloat16 weights:") == 1 and "fall back to F.linear" in proc.stderr
    assert "GEMMs: torch (bfloat16 without AVX-512" in proc.stderr
    tokens = eval(proc.stdout.split("TOKENS", 1)[1])
    assert len(tokens) == 4


def test_bf16_pack_refused_clearly_when_unsupported(forced_isa):
    if "avx2" in RUNNABLE:
        forced_isa("avx2")
        assert cpu_linear.packable_dtypes() == (torch.float32,)
        with pytest.raises(ValueError, match="cannot pack a bfloat16 weight here: .*AVX-512 BW/VL/DQ.*level in use is avx2"):
            cpu_linear.pack_linear_weight(torch.randn(8, 8).bfloat16())
        cpu_linear.pack_linear_weight(torch.randn(8, 8))  # float32 packs on every level
    forced_isa(None)
    assert (torch.bfloat16 in cpu_linear.packable_dtypes()) == (cpu_linear.bf16_packing_unsupported_reason() is None)


# ------------------------------------------------------------------- GFLOP/s against the FMA peak


def test_fma_peak_and_step_flops_count():
    """The FMA loop builds and runs at every level; a step's FLOP count follows its chunks and the model
    shape (benchmarks/cpu_flops.py)."""
    from pagedllm.benchmarks import cpu_flops
    from pagedllm.benchmarks.lower_bound import ModelShape
    from pagedllm.worker.model_input import SequenceChunk
    from pagedllm.worker.step_stats import StepWork

    peaks = {isa: cpu_flops.measure_fma_peak(isa, repeats=2, seconds=0.02) for isa in RUNNABLE}
    assert all(p > 1e8 for p in peaks.values()), peaks
    chunks = [SequenceChunk(0, [5], 9, [0], True), SequenceChunk(1, [1, 2, 3], 4, [1], True)]
    work = StepWork.of(chunks, logits_rows=2)
    assert work == StepWork(10 + (3 * 4 + 6), 2)  # decode at position 9 attends 10; chunk 4..6 attends 5+6+7
    shape = ModelShape(num_layers=2, hidden=8, intermediate=16, num_heads=2, num_kv_heads=1, head_dim=4, vocab=50)
    n_mm = 2 * (8 * 4 * 4 + 2 * 4 * 8 + 3 * 8 * 16)
    assert cpu_flops.step_flops(shape, 4, work.attended, 2) == 2 * n_mm * 4 + 4 * 2 * 2 * 4 * 28 + 2 * 8 * 50 * 2


def test_a_run_whose_host_slowed_down_is_flagged(capsys):
    """The CPU throughput benchmark reads the FMA peak before, between and after the systems it compares; a spread
    above 15 % (BENCHMARKS.md §52.4: 234 against 369-378 GFLOP/s on a shared host) marks the run unreliable."""
    from pagedllm.benchmarks import cpu_flops

    steady = cpu_flops.host_speed_report([("before pagedllm", 370e9), ("after pagedllm", 360e9), ("at the end", 375e9)])
    assert steady["host_speed_steady"] and "WARNING" not in capsys.readouterr().out
    noisy = cpu_flops.host_speed_report([("before pagedllm", 233.8e9), ("after pagedllm", 369e9),
                                         ("at the end", 375e9)])
    out = capsys.readouterr().out
    assert not noisy["host_speed_steady"] and noisy["fma_peak_spread"] == pytest.approx(375 / 233.8 - 1)
    assert "WARNING" in out and "before pagedllm 233.8" in out and "not reliable" in out


def test_a_float32_engine_on_an_amx_bf16_cpu_hints_at_bfloat16(monkeypatch, caplog):
    """Dense float32 weights leave AMX-BF16 tiles unused: the worker says so once, and only where the CPU has the
    tiles and oneDNN can pack bfloat16 weights."""
    import logging

    from pagedllm.worker import worker

    cases = [(frozenset({"avx512f", "amx_bf16"}), None, True),
             (frozenset({"avx512f"}), None, False),
             (frozenset({"avx512f", "amx_bf16"}), "no bf16 packing here", False)]
    for flags, reason, hinted in cases:
        monkeypatch.setattr(cpu_isa, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(cpu_linear, "bf16_packing_unsupported_reason", lambda reason=reason: reason)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pagedllm"):
            worker.log_amx_bf16_hint()
        assert ("--dtype bfloat16" in caplog.text) == hinted, (flags, reason, caplog.text)
