"""GGUF weights served quantized (--quantization gguf): kernels vs gguf.quants + torch, the bundled model vs
its dequantized twin (greedy agreement, perplexity), memory, errors, and the llama.cpp peer when present."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.benchmarks.gguf_quant import random_gguf_blocks
from pagedllm.kernels import cpu_isa, cpu_quant, reference
from pagedllm.kernels.cpu_quant import BLOCK_LAYOUT, GGML_TYPES, GGUFWeight


_DETECTED = cpu_isa.detect_cpu_isa().detected
# Every ISA level this CPU can run (the top one with its VNNI extension, the lower ones without).
_LEVELS = [pytest.param(lv, id=lv) for lv in cpu_isa.ISA_LEVELS[: cpu_isa.ISA_LEVELS.index(_DETECTED) + 1]]
MXFP4 = GGML_TYPES["MXFP4"]


def random_blocks(qtype: int, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF blocks of ``qtype`` (uint8 [rows, row_bytes]). MXFP4: gguf.quants' blocks of Gaussian rows of a
    spread of magnitudes (random_gguf_blocks' fp16 scale bytes would be exponents up to 2^127); the other types:
    random_gguf_blocks'."""
    if qtype != MXFP4:
        return random_gguf_blocks(qtype, rows, k, seed=seed)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((rows, k)) * rng.uniform(0.005, 0.5, size=(rows, 1))
    return quantize(dense.astype(np.float32), GGMLQuantizationType.MXFP4)


@pytest.mark.parametrize("level", _LEVELS)
@pytest.mark.parametrize("type_name", sorted(GGML_TYPES))
def test_kernels_match_gguf_quants_and_torch(level, type_name):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kern = cpu_quant.load_quant_kernels(level)
    qtype, n = GGML_TYPES[type_name], 72
    k = 512 if BLOCK_LAYOUT[qtype][0] == 256 else 544  # 17 blocks of 32: an odd count
    raw = random_blocks(qtype, n, k, seed=qtype)
    w = GGUFWeight.from_gguf_blocks(torch.from_numpy(raw), qtype, n, k)
    # R16: the file's bytes rearranged (Q4_K: 1.03x; the 5- and 6-bit types a byte per quant: at most 1.57x), rows
    # padded to a multiple of 16 (72 -> 80)
    widened = 1.03 if type_name in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "MXFP4") else 1.57
    assert w.nbytes == cpu_quant.r16_bytes(qtype, n, k) <= widened * raw.nbytes * 80 / 72
    dense = torch.from_numpy(dequantize(raw, GGMLQuantizationType(qtype)).reshape(n, k).astype(np.float32))
    # dequantization: bit-exact with gguf.quants (rows in any order)
    ids = torch.tensor([5, 0, 71, 5, 33])
    assert torch.equal(kern.dequantize_rows(w, ids), dense[ids])
    torch.manual_seed(qtype)
    for m in (1, 3, 5, 17):  # single rows, partial and full 4-row register blocks, a remainder
        x = torch.randn(m, k) * 3
        for method in ("int8", "dequant"):
            y = kern.linear(x, w, method)
            ref = reference.gguf_linear(x, dense, method)
            torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        # the int8 design's only approximation is the activation rounding: close to full precision too
        full = x @ dense.T
        rel = ((kern.linear(x, w, "int8") - full).norm() / full.norm()).item()
        assert rel < 3e-2, rel


@pytest.mark.parametrize("level", _LEVELS)
@pytest.mark.parametrize("type_name", sorted(GGML_TYPES))
def test_each_design_gives_a_row_the_same_result_in_any_batch(level, type_name):
    """Per design, a row's output is bit-identical whether it is computed alone or batched with others (1, 2,
    5, 8, 9 or 17 rows: whole and partial register tiles; 40 weight rows: two whole groups of 16 and a partial
    one): speculative verification (k+1 rows per sequence) then reproduces plain decoding exactly."""
    kern = cpu_quant.load_quant_kernels(level)
    qtype, n = GGML_TYPES[type_name], 40
    k = 512 if BLOCK_LAYOUT[qtype][0] == 256 else 544
    w = GGUFWeight.from_gguf_blocks(torch.from_numpy(random_blocks(qtype, n, k, seed=qtype + 1)), qtype, n, k)
    torch.manual_seed(qtype + 1)
    x = torch.randn(17, k) * 3
    for method in ("int8", "dequant"):
        alone = torch.cat([kern.linear(x[i:i + 1], w, method) for i in range(17)])
        for m in (2, 5, 8, 9, 17):
            assert torch.equal(kern.linear(x[:m], w, method), alone[:m]), (method, m)


def test_weight_and_input_validation():
    kern = cpu_quant.load_quant_kernels()
    q41 = GGML_TYPES["Q4_1"]
    with pytest.raises(ValueError, match="multiple of 256"):
        cpu_quant.row_bytes(GGML_TYPES["Q4_K"], 320)
    with pytest.raises(ValueError, match="not supported"):
        cpu_quant.row_bytes(10, 256)  # Q2_K
    with pytest.raises(ValueError, match=r"must be uint8 \(4, 20\)"):
        GGUFWeight.from_gguf_blocks(torch.zeros(4, 19, dtype=torch.uint8), q41, 4, 32)
    with pytest.raises(ValueError, match=r"R16 weight data must be contiguous uint8 \(320,\)"):
        GGUFWeight(torch.zeros(4, 20, dtype=torch.uint8), q41, 4, 32)
    w = GGUFWeight.from_gguf_blocks(torch.from_numpy(random_blocks(q41, 4, 64)), q41, 4, 64)
    with pytest.raises(ValueError, match="input has 32 features, weight expects 64"):
        kern.linear(torch.zeros(2, 32), w)
    with pytest.raises(ValueError, match="float32"):
        kern.linear(torch.zeros(2, 64, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match=r"row ids must lie in \[0, 4\)"):
        kern.dequantize_rows(w, torch.tensor([4]))
    assert kern.linear(torch.zeros(0, 64), w).shape == (0, 4)


@pytest.mark.parametrize("type_name", sorted(GGML_TYPES))
def test_int8_design_gives_the_same_bits_on_every_isa_level(type_name):
    """The int8 design does the same float operations per row in its scalar, AVX2 and AVX-512 (VNNI) builds:
    a machine's outputs do not depend on which level it runs (the portable build is the reference). 36, 40 and
    44 weight rows end on a group of 4, 8 and 12 rows: a partial first half of a group, a whole one, a partial
    second half (the AVX2 tile stores a group's two halves of 8 rows apart); 9 activation rows are two whole
    tiles of 4 and one row."""
    qtype = GGML_TYPES[type_name]
    k = 512 if BLOCK_LAYOUT[qtype][0] == 256 else 544
    for n in (36, 40, 44):
        w = GGUFWeight.from_gguf_blocks(torch.from_numpy(random_blocks(qtype, n, k, seed=qtype + 2)), qtype, n, k)
        torch.manual_seed(qtype + 2)
        x = torch.randn(9, k) * 3
        outs = {lv: cpu_quant.load_quant_kernels(lv).linear(x, w, "int8")
                for lv in cpu_isa.ISA_LEVELS[: cpu_isa.ISA_LEVELS.index(_DETECTED) + 1]}
        for lv, y in outs.items():
            assert torch.equal(y, outs["portable"]), (lv, n)


@pytest.mark.parametrize("type_name", sorted(GGML_TYPES))
def test_int8_sums_of_extreme_blocks_are_exact_on_every_isa_level(type_name):
    """Every nibble at 15 (Q8_0: every byte at 127, or at -128 in every other weight row; the 5- and 6-bit types:
    every quant at its largest, Q6_K's also at 0 (-32 after the offset) in every other row, its scales -128; MXFP4:
    every nibble 7 (12, byte 24 after the offset), or 15 (-12, byte 0) in every other row) and every activation
    quantized to ±127: the largest integer sums a block can give, where the AVX2 path's 16-bit partial sums come
    closest to wrapping. Every level gives the portable build's bits, and the result matches the reference."""
    qtype, n, k = GGML_TYPES[type_name], 24, 512
    # the fp16 scale (and minimum) of each block; MXFP4's exponent byte
    header = 4 if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 1 if type_name == "MXFP4" else 2
    elems, nbytes = BLOCK_LAYOUT[qtype]
    raw = random_blocks(qtype, n, k, seed=qtype + 4).reshape(n, k // elems, nbytes)
    if type_name == "Q6_K":  # ql, qh, then the 16 int8 scales and d
        raw[:, :, :192] = 0xFF
        raw[1::2, :, :192] = 0
        raw[:, :, 192:208] = 0x80
    elif type_name == "MXFP4":
        raw[:, :, header:] = 0x77
        raw[1::2, :, header:] = 0xFF
    else:
        raw[:, :, header:] = 0x7F if type_name == "Q8_0" else 0xFF
    if type_name == "Q8_0":
        raw[1::2, :, header:] = 0x80  # -128: the AVX2 path's |q| · sign(x, q) pairs reach 2·128·127
    raw = raw.reshape(n, -1)
    w = GGUFWeight.from_gguf_blocks(torch.from_numpy(raw), qtype, n, k)
    x = torch.full((6, k), 3.0)
    x[1::2] = -3.0  # rows of +127 and rows of -127
    outs = {lv: cpu_quant.load_quant_kernels(lv).linear(x, w, "int8")
            for lv in cpu_isa.ISA_LEVELS[: cpu_isa.ISA_LEVELS.index(_DETECTED) + 1]}
    for lv, y in outs.items():
        assert torch.equal(y, outs["portable"]), lv
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    dense = torch.from_numpy(dequantize(raw, GGMLQuantizationType(qtype)).reshape(n, k).astype(np.float32))
    ref = reference.gguf_linear(x, dense, "int8")
    torch.testing.assert_close(outs["portable"], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("level", _LEVELS)
def test_mxfp4_exponents_dequantize_bit_exact_and_hold_file_bytes(level):
    """MXFP4 blocks with every exponent byte (e = 0, 1: 2^-128 and 2^-127 are float32 subnormals; from e = 253 the
    largest values overflow to inf, in gguf.quants as here) and random nibbles: dequantize_rows gives gguf.quants'
    bits and the R16 weight takes exactly the file's bytes; with exponents 0..127 the dequant design gives the float
    product of the dequantized weight and the int8 design the portable build's bits."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    kern, n, k = cpu_quant.load_quant_kernels(level), 32, 256 * 32
    raw = np.random.default_rng(5).integers(0, 256, size=(n, k // 32, 17), dtype=np.uint8)
    raw[:, :, 0] = np.arange(n * k // 32).reshape(n, k // 32) % 256
    raw = raw.reshape(n, -1)
    w = GGUFWeight.from_gguf_blocks(torch.from_numpy(raw), MXFP4, n, k)
    assert w.nbytes == raw.nbytes
    with np.errstate(over="ignore"):
        dense = torch.from_numpy(dequantize(raw, GGMLQuantizationType.MXFP4).reshape(n, k).astype(np.float32))
    got = kern.dequantize_rows(w, torch.arange(n))
    assert torch.equal(got.view(torch.int32), dense.view(torch.int32))
    assert (dense[0, :32] != 0).any() and not torch.isfinite(dense).all()  # e = 0 is not flushed; e = 255 overflows
    small = raw.reshape(n, k // 32, 17).copy()  # exponents 0..127: no overflow in either design
    small[:, :, 0] %= 128
    small = small.reshape(n, -1)
    w = GGUFWeight.from_gguf_blocks(torch.from_numpy(small), MXFP4, n, k)
    dense = torch.from_numpy(dequantize(small, GGMLQuantizationType.MXFP4).reshape(n, k).astype(np.float32))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(kern.linear(x, w, "dequant"), x @ dense.T, rtol=1e-4, atol=1e-4)
    assert torch.equal(kern.linear(x, w, "int8"), cpu_quant.load_quant_kernels("portable").linear(x, w, "int8"))


def test_gemm_choice_env(monkeypatch):
    monkeypatch.delenv(cpu_quant.GEMM_ENV, raising=False)
    assert cpu_quant.choose_method() == "int8"
    monkeypatch.setenv(cpu_quant.GEMM_ENV, "dequant")
    assert cpu_quant.choose_method() == "dequant"
    monkeypatch.setenv(cpu_quant.GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="PAGEDLLM_QUANT_GEMM must be one of"):
        cpu_quant.choose_method()


# ------------------------------------------------------------------------------------------------
# The bundled Q4_1 model, quantized vs dequantized


@pytest.fixture(scope="module")
def engines():
    from pagedllm import LLM

    quant = LLM(quantization="gguf", num_gpu_blocks_override=256)
    dense = LLM(quantization="none", num_gpu_blocks_override=256)
    return quant, dense


def _model(llm):
    return llm.llm_engine.executor.driver_worker.model


def test_default_is_quantized_and_memory_within_file_size(engines):
    from pagedllm.model.gguf_loader import read_gguf_raw_tensors
    from pagedllm.model.layers.quantized_linear import resident_weight_bytes
    from pagedllm.model.loader import default_model_path

    quant, dense = engines
    qm, dm = _model(quant), _model(dense)
    assert quant.llm_engine.executor.driver_worker.quantization == "gguf"
    assert dense.llm_engine.executor.driver_worker.quantization is None
    layers = [m for m in qm.modules() if getattr(m, "gguf_weight", None) is not None]
    assert {m.gguf_weight.type_name for m in layers} == {"Q4_1", "Q8_0"}
    assert qm.model.embed_tokens.gguf_weight is qm.lm_head.gguf_weight  # tied: one copy of the blocks
    _, file_bytes = read_gguf_raw_tensors(default_model_path())
    q_bytes, d_bytes = resident_weight_bytes(qm), resident_weight_bytes(dm)
    assert q_bytes <= 1.2 * file_bytes, (q_bytes, file_bytes)
    assert d_bytes > 4 * file_bytes  # float32 copy: what the quantized path saves
    with pytest.raises(ValueError, match="cannot replace GGUF-quantized weights"):
        quant.llm_engine.executor.driver_worker.load_weights(iter([]))


@pytest.fixture(params=["int8", "dequant"])
def gemm_method(request, monkeypatch):
    """Both designs: int8 activations (the default) and dequantized weights with float32 activations."""
    monkeypatch.setenv(cpu_quant.GEMM_ENV, request.param)
    return request.param


@pytest.fixture(scope="module")
def dense_reference(engines, tokenizer):
    """Greedy outputs and perplexity of the dequantized (float32) model: what the quantized one is held to."""
    from pagedllm.benchmarks.gguf_quant import (
        FIXED_TEXT,
        PROMPT_TEXTS,
        greedy,
        perplexity,
    )

    prompts = [tokenizer.encode(t) for t in PROMPT_TEXTS[:8]]
    ids = tokenizer.encode(FIXED_TEXT)
    return prompts, greedy(engines[1], prompts, 16), ids, perplexity(engines[1], ids)


def test_greedy_agreement_and_perplexity_fast(engines, dense_reference, gemm_method):
    from pagedllm.benchmarks.gguf_quant import (
        free_running_agreement,
        greedy,
        perplexity,
        teacher_forced_agreement,
    )

    quant = engines[0]
    prompts, ref, ids, p_d = dense_reference
    agree, total = teacher_forced_agreement(quant, prompts, ref)
    # dequant keeps float32 activations: (near) exact. int8 rounds them: the issue's >= 95 % is held over
    # 32 prompts x 32 tokens (test_greedy_agreement_32_prompts: 96.7 %); 128 tokens are a smoke check.
    assert agree / total >= (0.99 if gemm_method == "dequant" else 0.9), (agree, total)
    same, _ = free_running_agreement(greedy(quant, prompts, 16), ref)
    assert same >= len(prompts)  # every output starts the same way at least
    p_q = perplexity(quant, ids)
    assert abs(p_q / p_d - 1) <= 0.01, (p_q, p_d)
    assert 1.0 < p_d < 100.0


@pytest.mark.slow
def test_greedy_agreement_32_prompts(engines, tokenizer, monkeypatch):
    monkeypatch.setenv(cpu_quant.GEMM_ENV, "int8")
    from pagedllm.benchmarks.gguf_quant import (
        PROMPT_TEXTS,
        greedy,
        teacher_forced_agreement,
    )

    quant, dense = engines
    prompts = [tokenizer.encode(t) for t in PROMPT_TEXTS[:32]]
    ref = greedy(dense, prompts, 32)
    agree, total = teacher_forced_agreement(quant, prompts, ref)
    assert total == 32 * 32 and agree / total >= 0.95, (agree, total)


def test_default_for_a_quantized_gguf_on_cpu(monkeypatch):
    from pagedllm.model.layers.quantized_linear import DEFAULT_ENV, resolve_quantization
    from pagedllm.model.loader import default_model_path

    gguf = default_model_path()
    monkeypatch.delenv(DEFAULT_ENV, raising=False)
    assert resolve_quantization(None, gguf, "cpu", torch.float32) == "gguf"
    assert resolve_quantization(None, gguf, "cpu", torch.bfloat16) is None  # the kernels take float32
    assert resolve_quantization(None, gguf, "cuda", torch.float32) is None
    monkeypatch.setenv(DEFAULT_ENV, "none")
    assert resolve_quantization(None, gguf, "cpu", torch.float32) is None
    monkeypatch.setenv(DEFAULT_ENV, "q4")
    with pytest.raises(ValueError, match="must be 'gguf' or 'none'"):
        resolve_quantization(None, gguf, "cpu", torch.float32)


def test_quantization_errors(tmp_path):
    from pagedllm import LLM
    from pagedllm.model.layers.quantized_linear import resolve_quantization
    from pagedllm.model.loader import default_model_path

    gguf = default_model_path()
    with pytest.raises(ValueError, match="needs a .gguf model file"):
        resolve_quantization("gguf", None, "cpu", torch.float32)
    with pytest.raises(ValueError, match="runs on the CPU"):
        resolve_quantization("gguf", gguf, "cuda", torch.float32)
    with pytest.raises(ValueError, match="dtype='float32'"):
        LLM(quantization="gguf", dtype="bfloat16", num_gpu_blocks_override=16)
    assert resolve_quantization("none", gguf, "cpu", torch.float32) is None
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(quantization="q4", num_gpu_blocks_override=16)


def test_llama_cpp_peer_same_prompts():
    from pagedllm.benchmarks.llama_cpp import find_llama_server, run_llama_server
    from pagedllm.benchmarks.throughput import make_workload
    from pagedllm.model.loader import default_model_path

    binary = find_llama_server()
    if binary is None:
        pytest.skip("no llama-server binary (optional CPU peer; README.md 'llama.cpp as a CPU peer')")
    wl = make_workload(3, 8, 24, 6, 49152, seed=1)
    result, tokens = run_llama_server(binary, default_model_path(), wl, parallel=2, threads=2)
    assert result.num_requests == 3 and result.output_tokens == 18
    assert all(len(t) == 6 for t in tokens)
