"""GGUF Q6_K, Q5_K, Q5_0 and Q5_1 linear weights served quantized on the CPU (kernels/cpu/quant_ops.c: one byte per
quant in Q8_0's chunk order; Q6_K's two int8 scales per block of 32 applied to integer half-block sums): dequantization
bit-exact with gguf.quants, the int8 GEMM against its numpy/torch oracle and the float product, the same bits on every
ISA build and in any batch, the dequant design; weights of row segments in different types (a Q4_K_M file's
q | k | v: Q4_K, Q4_K, Q6_K); and tiny Llama GGUF files of these types served end to end with --quantization gguf."""
from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_writing import ENGINE_KW, add_shape_metadata, teacher_forced_ranks, write_gguf
from gguf_writing import own_cache  # noqa: F401 (autouse fixture: a cache directory per test)

from pagedllm.benchmarks.gguf_quant import random_gguf_blocks
from pagedllm.kernels import cpu_isa, cpu_quant, reference
from pagedllm.kernels.cpu_quant import BLOCK_LAYOUT, GGML_TYPES, SEGMENTS, GGUFWeight

gguf = pytest.importorskip("gguf")

NEW_TYPES = ["Q5_0", "Q5_1", "Q5_K", "Q6_K"]
_DETECTED = cpu_isa.detect_cpu_isa().detected
LEVELS = cpu_isa.ISA_LEVELS[: cpu_isa.ISA_LEVELS.index(_DETECTED) + 1]  # every build this CPU runs


def _k(type_name: str) -> int:
    """Inputs: 2 super-blocks of 256 (16 blocks), or 17 blocks of 32 (an odd count)."""
    return 512 if BLOCK_LAYOUT[GGML_TYPES[type_name]][0] == 256 else 544


def _random(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random valid blocks (any bytes are: random quants, Q6_K's int8 scales of both signs), small positive fp16
    scales (and minimums) of a spread of magnitudes."""
    qtype = GGML_TYPES[type_name]
    raw = random_gguf_blocks(qtype, n, k, seed=seed)
    elems, nbytes = BLOCK_LAYOUT[qtype]
    blocks = raw.reshape(n, k // elems, nbytes)
    rng = np.random.default_rng(seed + 1)
    spread = rng.uniform(1e-4, 0.5, size=blocks.shape[:2]).astype(np.float16)
    spread = spread.view(np.uint8).reshape(*blocks.shape[:2], 2)
    at = nbytes - 2 if type_name == "Q6_K" else 0
    blocks[:, :, at:at + 2] = spread
    return blocks.reshape(n, -1)


def _dense(raw: np.ndarray, type_name: str, n: int, k: int) -> torch.Tensor:
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(n, k).astype(np.float32))


@pytest.mark.parametrize("type_name", NEW_TYPES)
def test_dequantize_and_int8_gemm_against_gguf_quants(type_name: str) -> None:
    """dequantize_rows is bit-exact with gguf.quants (every build); the int8 GEMM equals the oracle (activations
    rounded per block of 32, then the dequantized weights) and is near the float product; the dequant design equals
    the float product; the weight takes at most 1.57x the file's bytes (rows padded to 16: 40 -> 48)."""
    qtype, n, k = GGML_TYPES[type_name], 40, _k(type_name)
    raw = _random(type_name, n, k, seed=qtype)
    w = GGUFWeight.from_gguf_blocks(torch.from_numpy(raw), qtype, n, k)
    assert w.nbytes <= 1.57 * raw.nbytes * 48 / 40
    dense = _dense(raw, type_name, n, k)
    ids = torch.tensor([39, 0, 17, 17, 5])
    torch.manual_seed(qtype)
    x = torch.randn(7, k) * 3
    for level in LEVELS:
        kern = cpu_quant.load_quant_kernels(level)
        assert torch.equal(kern.dequantize_rows(w, torch.arange(n)), dense), level
        assert torch.equal(kern.dequantize_rows(w, ids), dense[ids]), level
        for method in ("int8", "dequant"):
            y, ref = kern.linear(x, w, method), reference.gguf_linear(x, dense, method)
            torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        full = x @ dense.T
        rel = ((kern.linear(x, w, "int8") - full).norm() / full.norm()).item()
        assert rel < 3e-2, (level, rel)


@pytest.mark.parametrize("type_name", NEW_TYPES)
def test_int8_same_bits_on_every_isa_build_and_in_any_batch(type_name: str) -> None:
    """The int8 design gives a row the portable build's bits on every level (36 / 44 weight rows: partial halves of
    a group), alone or in a batch of 2, 5, 9 or 17 rows; the dequant design the same bits alone as batched."""
    qtype, k = GGML_TYPES[type_name], _k(type_name)
    torch.manual_seed(qtype + 7)
    x = torch.randn(17, k) * 3
    for n in (36, 44):
        w = GGUFWeight.from_gguf_blocks(torch.from_numpy(_random(type_name, n, k, seed=qtype + n)), qtype, n, k)
        want = cpu_quant.load_quant_kernels("portable").linear(x, w, "int8")
        for level in LEVELS:
            kern = cpu_quant.load_quant_kernels(level)
            for method in ("int8", "dequant"):
                alone = torch.cat([kern.linear(x[i:i + 1], w, method) for i in range(17)])
                if method == "int8":
                    assert torch.equal(alone, want), (level, n)
                for m in (2, 5, 9, 17):
                    assert torch.equal(kern.linear(x[:m], w, method), alone[:m]), (level, method, n, m)


def test_avx_vnni_build_gives_the_same_bits() -> None:
    """The 8-lane AVX-VNNI path (an AVX2 build with -mavxvnni, which load_quant_kernels makes only on CPUs whose own
    level is AVX2) gives the portable build's bits, where this CPU can run it."""
    import ctypes

    from pagedllm.kernels.cpu_kernels import build_library

    if "avx_vnni" not in cpu_isa.detect_cpu_isa().flags:
        pytest.skip("the CPU has no AVX-VNNI")
    path = build_library(cpu_quant.SOURCE, "avx2", ("-mavxvnni",))
    vnni, portable = cpu_quant.QuantKernels(ctypes.CDLL(str(path)), path), cpu_quant.load_quant_kernels("portable")
    assert vnni.isa == "avx_vnni"
    torch.manual_seed(11)
    for type_name in NEW_TYPES:
        qtype, k = GGML_TYPES[type_name], _k(type_name)
        w = GGUFWeight.from_gguf_blocks(torch.from_numpy(_random(type_name, 44, k, seed=qtype)), qtype, 44, k)
        x = torch.randn(9, k) * 3
        want = portable.linear(x, w, "int8")
        assert torch.equal(vnni.linear(x, w, "int8"), want), type_name
        assert torch.equal(torch.cat([vnni.linear(x[i:i + 1], w, "int8") for i in range(9)]), want), type_name


def test_extreme_q6_k_and_q5_blocks_are_exact() -> None:
    """The largest integer sums: Q6_K quants all 0 (-32) or all 63 with scales -128 or 127, the 5-bit types' all 31,
    activations at ±127; every build gives the portable build's bits and the oracle's values."""
    k, n = 512, 32
    x = torch.full((5, k), 2.0)
    x[1::2] = -2.0
    for type_name in NEW_TYPES:
        qtype = GGML_TYPES[type_name]
        elems, nbytes = BLOCK_LAYOUT[qtype]
        raw = random_gguf_blocks(qtype, n, k, seed=3).reshape(n, k // elems, nbytes)
        if type_name == "Q6_K":
            raw[0::2, :, :192], raw[1::2, :, :192] = 0, 0xFF
            raw[0::4, :, 192:208], raw[2::4, :, 192:208] = 0x80, 0x7F
        else:
            raw[:, :, {"Q5_0": 2, "Q5_1": 4, "Q5_K": 4}[type_name]:] = 0xFF
        raw = raw.reshape(n, -1)
        w = GGUFWeight.from_gguf_blocks(torch.from_numpy(raw), qtype, n, k)
        outs = {lv: cpu_quant.load_quant_kernels(lv).linear(x, w, "int8") for lv in LEVELS}
        for lv, y in outs.items():
            assert torch.equal(y, outs["portable"]), (type_name, lv)
        ref = reference.gguf_linear(x, _dense(raw, type_name, n, k), "int8")
        torch.testing.assert_close(outs["portable"], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_row_segments_of_different_types() -> None:
    """q | k | v rows in Q4_K, Q4_K, Q6_K (48 + 24 + 24: segments not multiples of 16) as one weight: two segments
    (the Q4_K neighbours joined); its GEMM is each segment's own, bit for bit, in both designs and on every build;
    its rows dequantize as gguf.quants does; one type gives a plain weight."""
    k = 512
    parts = [("Q4_K", 48, 1), ("Q4_K", 24, 2), ("Q6_K", 24, 3)]
    raws = [(_random(t, n, k, seed=s), t) for t, n, s in parts]
    w = GGUFWeight.from_segments([(torch.from_numpy(r), GGML_TYPES[t]) for r, t in raws], k)
    assert w.qtype == SEGMENTS and w.type_name == "Q4_K+Q6_K" and w.out_features == 96
    assert w.segments == ((GGML_TYPES["Q4_K"], 72), (GGML_TYPES["Q6_K"], 24))
    q4k = GGUFWeight.from_gguf_blocks(torch.from_numpy(np.concatenate([raws[0][0], raws[1][0]])), GGML_TYPES["Q4_K"],
                                      72, k)
    q6k = GGUFWeight.from_gguf_blocks(torch.from_numpy(raws[2][0]), GGML_TYPES["Q6_K"], 24, k)
    dense = torch.cat([_dense(r, t, r.shape[0], k) for r, t in raws])
    torch.manual_seed(5)
    x = torch.randn(6, k)
    for level in LEVELS:
        kern = cpu_quant.load_quant_kernels(level)
        assert torch.equal(kern.dequantize_rows(w, torch.tensor([95, 0, 71, 72])), dense[[95, 0, 71, 72]])
        for method in ("int8", "dequant"):
            want = torch.cat([kern.linear(x, q4k, method), kern.linear(x, q6k, method)], dim=1)
            assert torch.equal(kern.linear(x, w, method), want), (level, method)
            assert torch.equal(kern.linear(x[2:3], w, method), want[2:3]), (level, method)
        assert kern.linear(torch.zeros(0, k), w).shape == (0, 96)
    one = GGUFWeight.from_segments([(torch.from_numpy(raws[0][0]), GGML_TYPES["Q4_K"])], k)
    assert one.qtype == GGML_TYPES["Q4_K"] and one.segments == ()


# ------------------------------------------------------------------------------------------------
# Tiny Llama GGUF files end to end

PROMPTS = [[3, 17, 250, 9], [100, 5], [42, 43, 44, 45, 46, 47, 48]]
MAX_TOKENS = 10


def _q4_k_m(name: str) -> str | None:
    """llama.cpp's Q4_K_M choice in miniature: Q6_K attn_v, output and the first layer's ffn_down, Q4_K the rest."""
    if name.endswith("attn_v.weight") or name in ("output.weight", "blk.0.ffn_down.weight"):
        return "Q6_K"
    return "Q4_K"


MIXES = {"Q6_K": lambda name: "Q6_K", "Q5_K": lambda name: "Q5_K", "Q4_K_M": _q4_k_m}


def _llama_meta(w, cfg) -> None:
    add_shape_metadata(w, cfg, head_dim=False)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)


def _llama_gguf(path: Path, mix: str) -> Path:
    """A 2-layer Llama with rows of 256 (the K-quants' super-block), its linears and embedding in ``mix``."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return write_gguf(model, "llama", path, partial(_llama_meta, cfg=cfg), permute_qk=True, tensor_type=MIXES[mix])


@pytest.mark.parametrize("mix", list(MIXES))
def test_llama_gguf_of_k_quants_runs_quantized(mix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Every linear layer and the embedding hold GGUF blocks (Q4_K_M's q | k | v as Q4_K+Q6_K segments), the log
    names no dense linear, and greedy decoding, teacher-forced on the dequantized model's tokens, ranks them first:
    always with the dequant design (float32 activations), at >= 90 % with int8 activations."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.model.layers.linear import PackableGemm

    src = _llama_gguf(tmp_path / f"llama-{mix}.gguf", mix)
    dense = LLM(model=str(src), **ENGINE_KW, quantization="none")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    want = [list(o.outputs[0].token_ids) for o in dense.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                                 use_tqdm=False)]
    for method, share in (("dequant", 1.0), ("int8", 0.9)):
        monkeypatch.setenv(cpu_quant.GEMM_ENV, method)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="pagedllm"):
            llm = LLM(model=str(src), **ENGINE_KW, quantization="gguf")
        model = llm.llm_engine.executor.driver_worker.model
        linears = [m for m in model.modules() if isinstance(m, PackableGemm)]
        assert linears and all(m.gguf_weight is not None for m in linears)
        types = {m.gguf_weight.type_name for m in linears} | {model.model.embed_tokens.gguf_weight.type_name}
        assert types == ({"Q4_K", "Q6_K", "Q4_K+Q6_K"} if mix == "Q4_K_M" else {mix}), types
        assert "GGUF weights served quantized: 10 layers" in caplog.text, caplog.text
        assert "stays dense float32" not in caplog.text
        ranks = teacher_forced_ranks(llm, PROMPTS, want)
        assert sum(r == 1 for r in ranks) >= share * len(ranks), (method, ranks)
