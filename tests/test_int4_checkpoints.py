"""GPTQ, AWQ and compressed-tensors pack-quantized checkpoints (4- and 8-bit integer weights,
model/int_weight_checkpoint.py and model/layers/int_weight_blocks.py): written by this suite's packers
(tests/int_weight_checkpoints.py, checked here against the real packers' code), they load dequantized as exactly
their dequantized weights and generate what transformers generates from those; on the CPU they run by default as
GGUF blocks, which agree with the dequantized path on the greedy tokens and logprobs and hold the weights in about
the checkpoint's packed bytes; unsupported variants and mismatched flags are refused by name."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from int_weight_checkpoints import (
    AWQ_ORDER,
    Kind,
    pack_awq,
    pack_compressed_tensors,
    pack_gptq,
    quantization_config,
    rtn_quantize,
    write_int_checkpoint,
)
from pagedllm import LLM, SamplingParams
from pagedllm.model.int_weight_checkpoint import (
    IntWeightFormat,
    detect_int_weight_checkpoint,
    int_weight_checkpoint_weights,
    unpack_int_weight,
)
from pagedllm.model.layers.int_weight_blocks import DEFAULT_ENV, gguf_blocks
from pagedllm.model.layers.linear import restore_dense_weights
from tiny_models import TINY_ENGINE_KW as ENGINE_KW, TINY_MAX_TOKENS as MAX_TOKENS, TINY_PROMPTS as PROMPTS
from tiny_models import save_tiny_llama, save_tiny_qwen2, tiny_hf_greedy


GPTQ_SYM = Kind("gptq", 4, 64, sym=True, checkpoint_format="gptq")
GPTQ_ASYM_V2 = Kind("gptq", 4, 64, sym=False, checkpoint_format="gptq_v2")
GPTQ_ASYM_V1 = Kind("gptq", 4, 128, sym=False, checkpoint_format="gptq")
GPTQ_8BIT = Kind("gptq", 8, 64, sym=True, checkpoint_format="gptq")
GPTQ_ACT_ORDER = Kind("gptq", 4, 64, sym=True, checkpoint_format="gptq", desc_act=True)
AWQ = Kind("awq", 4, 64, sym=False)
CT_SYM = Kind("compressed-tensors", 4, 64, sym=True)
CT_ASYM = Kind("compressed-tensors", 4, 32, sym=False)
CT_CHANNEL_8BIT = Kind("compressed-tensors", 8, -1, sym=True)
KINDS = [GPTQ_SYM, GPTQ_ASYM_V2, GPTQ_ASYM_V1, GPTQ_8BIT, AWQ, CT_SYM, CT_ASYM, CT_CHANNEL_8BIT]
# The GGUF block type each kind runs as on the CPU's quantized path.
BLOCK_TYPES = {GPTQ_SYM: "Q4_0", GPTQ_ASYM_V2: "Q4_1", GPTQ_ASYM_V1: "Q4_1", GPTQ_8BIT: "Q8_0", AWQ: "Q4_1",
               CT_SYM: "Q4_0", CT_ASYM: "Q4_1", CT_CHANNEL_8BIT: "Q8_0"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int-src")
    return {"llama": Path(save_tiny_llama(root / "llama")), "qwen2": Path(save_tiny_qwen2(root / "qwen2"))}


@pytest.fixture(scope="module")
def checkpoint(sources, tmp_path_factory):
    """checkpoint(kind, arch="llama") -> (quantized dir, dequantized float32 twin), written once per module."""
    root, made = tmp_path_factory.mktemp("int-ckpt"), {}

    def get(kind: Kind, arch: str = "llama") -> tuple[Path, Path]:
        if (kind, arch) not in made:
            d = root / f"{arch}-{kind.name}"
            made[kind, arch] = (d, write_int_checkpoint(sources[arch], d, kind))
        return made[kind, arch]

    return get


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]



def _forced(llm: LLM, continuations: list[list[int]]) -> tuple[list[bool], list[float]]:
    """Teacher-forced on prompt + continuation: per continuation token, whether it is this engine's argmax there,
    and its logprob."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p + c} for p, c in zip(PROMPTS, continuations)], params,
                        use_tqdm=False)
    top, logprobs = [], []
    for out, p, c in zip(outs, PROMPTS, continuations):
        for pos, token in enumerate(c, start=len(p)):
            lp = out.prompt_logprobs[pos][token]
            top.append(lp.rank == 1)
            logprobs.append(lp.logprob)
    return top, logprobs


def _model(llm: LLM):
    return llm.llm_engine.executor.driver_worker.model


def _linear_weights(model, layer: int = 1) -> dict[str, torch.Tensor]:
    restore_dense_weights(model)
    attn, mlp = model.model.layers[layer].self_attn, model.model.layers[layer].mlp
    return {"qkv": attn.qkv_proj.weight, "o": attn.o_proj.weight, "gate_up": mlp.gate_up_proj.weight,
            "down": mlp.down_proj.weight}


def _twin_weights(twin: Path, layer: int = 1) -> dict[str, torch.Tensor]:
    want = load_file(str(twin / "model.safetensors"))
    p = f"model.layers.{layer}."
    return {"qkv": torch.cat([want[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
            "o": want[p + "self_attn.o_proj.weight"],
            "gate_up": torch.cat([want[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")]),
            "down": want[p + "mlp.down_proj.weight"]}


# --------------------------------------------------------------------------------------------
# The packers' conventions


def _autogptq_pack_loop(intweight: np.ndarray, zeros: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """AutoGPTQ's QuantLinear.pack loops (auto_gptq/nn_modules/qlinear/qlinear_cuda.py) for 2/4/8 bits, transcribed:
    intweight uint32 [in, out], zeros uint32 [groups, out] (already minus one for v1)."""
    qweight = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + (32 // bits)):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += 32 // bits
        row += 1
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 32 * bits), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + (32 // bits)):
            qzeros[:, col] |= zeros[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1
    return qweight.astype(np.int32), qzeros.astype(np.int32)


def _autoawq_pack_loop(intweight: np.ndarray) -> np.ndarray:
    """AutoAWQ's WQLinear_GEMM.from_linear packing loop (awq/modules/linear/gemm.py), transcribed:
    [in, out] → [in, out/8]."""
    qweight = np.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=np.uint32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return qweight.astype(np.int32)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_packer_is_autogptqs_and_unpacks_exactly(bits):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(bits)) * 0.08
    for fmt in ("gptq", "gptq_v2"):
        kind = Kind("gptq", bits, 64, sym=False, checkpoint_format=fmt)
        qt = rtn_quantize(w, bits, 64, False, torch.float16)
        packed = pack_gptq(qt, kind, None)
        zeros = qt.zero.t().numpy() - (1 if fmt == "gptq" else 0)
        qweight, qzeros = _autogptq_pack_loop(qt.q.t().numpy().astype(np.uint32), zeros.astype(np.uint32), bits)
        assert np.array_equal(packed["qweight"].numpy(), qweight) and np.array_equal(packed["qzeros"].numpy(), qzeros)
        got = unpack_int_weight("x", packed, IntWeightFormat("gptq", bits, 64, False, checkpoint_format=fmt))
        assert torch.equal(got.q.long(), qt.q) and torch.equal(got.zero.long(), qt.zero)
        assert torch.equal(got.dequantize(), qt.deq)


def test_awq_packer_is_autoawqs_and_unpacks_exactly():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 0.08
    qt = rtn_quantize(w, 4, 64, False, torch.float16)
    packed = pack_awq(qt, AWQ, None)
    assert np.array_equal(packed["qweight"].numpy(), _autoawq_pack_loop(qt.q.t().numpy().astype(np.uint32)))
    assert np.array_equal(packed["qzeros"].numpy(), _autoawq_pack_loop(qt.zero.t().numpy().astype(np.uint32)))
    got = unpack_int_weight("x", packed, IntWeightFormat("awq", 4, 64, False))
    assert torch.equal(got.dequantize(), qt.deq)


@pytest.mark.parametrize("bits, sym", [(4, True), (4, False), (8, True), (8, False)])
def test_compressed_tensors_packer_is_pack_to_int32(bits, sym):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(bits)) * 0.08
    qt = rtn_quantize(w, bits, 64, sym, torch.float32)
    packed = pack_compressed_tensors(qt, Kind("compressed-tensors", bits, 64, sym), None)
    offset = 2 ** (bits - 1)
    assert torch.equal(packed["weight_packed"], helpers.pack_to_int32((qt.q - offset).to(torch.int8), bits))
    if not sym:
        real = helpers.pack_to_int32((qt.zero - offset).to(torch.int8), bits, packed_dim=0)
        assert torch.equal(packed["weight_zero_point"], real)
    got = unpack_int_weight("x", packed, IntWeightFormat("compressed-tensors", bits, None, sym))
    assert torch.equal(got.dequantize(), qt.deq)


@pytest.mark.parametrize("qtype, bits, sym, scale_dtype", [("Q4_0", 4, True, torch.float16),
                                                           ("Q4_1", 4, False, torch.float16),
                                                           ("Q4_1", 4, False, torch.float32),
                                                           ("Q8_0", 8, True, torch.float16)])
def test_gguf_blocks_hold_the_groups_with_fp16_rounding_only(qtype, bits, sym, scale_dtype):
    """The blocks, dequantized by gguf-py (the reference the kernels are tested against), give the integer weight:
    exactly for fp16 scales where the block has no minimum (Q4_0, Q8_0); within fp16's rounding of d = s and
    m = −s·z otherwise (at most 2^-11 relative each)."""
    from gguf.quants import dequantize
    from gguf import GGMLQuantizationType

    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(7)) * 0.08
    qt = rtn_quantize(w, bits, 64, sym, scale_dtype)
    fmt = IntWeightFormat("compressed-tensors", bits, None, sym)
    iw = unpack_int_weight("x", pack_compressed_tensors(qt, Kind("compressed-tensors", bits, 64, sym), None), fmt)
    raw, why = gguf_blocks("x.weight", iw, qtype)
    assert raw is not None, why
    assert raw.blocks.shape == (48, 256 // 32 * {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[qtype])
    back = torch.from_numpy(dequantize(raw.blocks, GGMLQuantizationType[qtype]).reshape(48, 256))
    if qtype != "Q4_1" and scale_dtype == torch.float16:
        assert torch.equal(back, qt.deq)
    else:
        s = qt.scale.float()[:, torch.arange(256) // 64]
        z = qt.zero[:, torch.arange(256) // 64].float()
        bound = 2.0**-11 * s * (qt.q.float() + z) + 1e-9  # |Δd|·q + |Δm|
        assert bool(((back - qt.deq).abs() <= bound).all())
        assert (back - qt.deq).abs().max() > 0  # the rounding this bounds does happen


def test_act_order_and_partial_blocks_stay_dense_with_the_reason():
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(5)) * 0.08
    fmt = IntWeightFormat("gptq", 4, 64, True, True, "gptq")
    qt = rtn_quantize(w, 4, 64, True, torch.float16, torch.randperm(256, generator=torch.Generator().manual_seed(1)))
    iw = unpack_int_weight("x", pack_gptq(qt, GPTQ_ACT_ORDER, None), fmt)
    assert gguf_blocks("x.weight", iw, "Q4_0") == (None, "act-order g_idx: its groups are not contiguous columns")
    qt16 = rtn_quantize(w, 4, 16, True, torch.float16)
    iw16 = unpack_int_weight("x", pack_gptq(qt16, Kind("gptq", 4, 16), None), IntWeightFormat("gptq", 4, 16, True))
    assert gguf_blocks("x.weight", iw16, "Q4_0")[1] == "groups of 16 columns are not whole blocks of 32"
    qt_asym8 = rtn_quantize(w, 8, 64, False, torch.float16)
    iw8 = unpack_int_weight("x", pack_gptq(qt_asym8, Kind("gptq", 8, 64, False, "gptq_v2"), None),
                            IntWeightFormat("gptq", 8, 64, False, checkpoint_format="gptq_v2"))
    assert "other than 128" in gguf_blocks("x.weight", iw8, "Q8_0")[1]


# --------------------------------------------------------------------------------------------
# Loading: the dequantized path against transformers


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_dequantized_path_loads_the_exact_weights_and_matches_transformers(kind, checkpoint):
    quantized, twin = checkpoint(kind)
    llm = LLM(model=str(quantized), quantization="none", **ENGINE_KW)
    model = _model(llm)
    assert not any(getattr(m, "gguf_weight", None) is not None for m in model.modules())
    got, want = _linear_weights(model), _twin_weights(twin)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=f"{kind.name}: {name}")
    assert _greedy(llm) == tiny_hf_greedy(twin)


def test_qwen2_with_biases_matches_transformers_and_its_quantized_path_agrees(checkpoint):
    quantized, twin = checkpoint(GPTQ_ASYM_V2, "qwen2")
    dense = LLM(model=str(quantized), quantization="none", **ENGINE_KW)
    tokens = _greedy(dense)
    assert tokens == tiny_hf_greedy(twin)
    del dense
    blocks = LLM(model=str(quantized), **ENGINE_KW)
    assert _model(blocks).model.layers[0].self_attn.qkv_proj.gguf_weight is not None
    top, _ = _forced(blocks, tokens)
    assert sum(top) / len(top) >= 0.95


def test_compressed_tensors_checkpoint_equals_transformers_own_decompression(checkpoint):
    """Independent of this suite's packers: transformers with compressed-tensors decompresses the same directory
    (CompressedTensorsConfig(run_compressed=False)) into the twin's weights, and generates what the engine does."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    for kind in (CT_SYM, CT_ASYM):
        quantized, twin = checkpoint(kind)
        hf = AutoModelForCausalLM.from_pretrained(str(quantized), dtype=torch.float32,
                                                  quantization_config=CompressedTensorsConfig(run_compressed=False))
        state, want = hf.state_dict(), load_file(str(twin / "model.safetensors"))
        assert set(want) <= set(state)
        for name, t in want.items():
            assert torch.equal(state[name], t), name
        llm = LLM(model=str(quantized), quantization="none", **ENGINE_KW)
        ct = CompressedTensorsConfig(run_compressed=False)
        assert _greedy(llm) == tiny_hf_greedy(quantized, quantization_config=ct)


def test_act_order_checkpoint_matches_transformers_on_the_dequantized_path(checkpoint, caplog):
    """desc_act with a shuffled g_idx: the CPU default cannot block the layers, dequantizes them (one log line),
    and generates exactly what transformers does."""
    quantized, twin = checkpoint(GPTQ_ACT_ORDER)
    g_idx = load_file(str(quantized / "model.safetensors"))["model.layers.0.mlp.down_proj.g_idx"]
    assert not torch.equal(g_idx, (torch.arange(g_idx.numel()) // 64).to(g_idx.dtype))
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(model=str(quantized), **ENGINE_KW)
    assert "21 quantized tensors dequantized to float32 instead (act-order g_idx" in caplog.text
    assert not any(getattr(m, "gguf_weight", None) is not None for m in _model(llm).modules())
    assert _greedy(llm) == tiny_hf_greedy(twin)


# --------------------------------------------------------------------------------------------
# The CPU's quantized path


@pytest.mark.parametrize("kind", [GPTQ_SYM, GPTQ_ASYM_V1, GPTQ_8BIT, AWQ, CT_ASYM], ids=lambda k: k.name)
def test_quantized_path_is_the_cpu_default_agrees_with_the_dequantized_one_and_stays_small(kind, checkpoint,
                                                                                          caplog):
    quantized, _ = checkpoint(kind)
    dense = LLM(model=str(quantized), quantization="none", **ENGINE_KW)
    tokens = _greedy(dense)
    _, dense_lp = _forced(dense, tokens)
    del dense
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(model=str(quantized), **ENGINE_KW)
    assert f"served quantized on the CPU: 12 linear layers as {BLOCK_TYPES[kind]} blocks" in caplog.text
    assert "CPU direct forward: 3 layers on the native + GGUF kernels" in caplog.text
    model = _model(llm)
    layers = [m for m in model.modules() if getattr(m, "gguf_weight", None) is not None]
    assert len(layers) == 12 and {m.gguf_weight.type_name for m in layers} == {BLOCK_TYPES[kind]}
    assert all(m.weight.numel() == 0 for m in layers)  # the float32 copies are gone
    # Memory: the blocks against the checkpoint's packed tensors of the same layers (qweight, qzeros, scales, g_idx).
    state = load_file(str(quantized / "model.safetensors"))
    packed = sum(t.numel() * t.element_size() for n, t in state.items()
                 if n.rpartition(".")[2] in ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale",
                                             "weight_zero_point", "weight_shape"))
    held = sum(m.gguf_weight.nbytes for m in layers)
    assert held <= 1.2 * packed, (held, packed)
    # Agreement: greedy tokens teacher-forced on the dequantized path's continuation, and their logprobs.
    top, lp = _forced(llm, tokens)
    assert sum(top) / len(top) >= 0.95
    diff = (torch.tensor(lp) - torch.tensor(dense_lp)).abs()
    assert float(diff.max()) < 0.02 and float(diff.mean()) < 0.005, diff  # measured: max 0.0026, mean 0.0009


def test_env_and_flag_force_the_dequantized_path(checkpoint, monkeypatch):
    quantized, _ = checkpoint(AWQ)
    with_flag = LLM(model=str(quantized), quantization="awq", **ENGINE_KW)  # the method's name: the default path
    assert _model(with_flag).model.layers[0].mlp.down_proj.gguf_weight is not None
    del with_flag
    monkeypatch.setenv(DEFAULT_ENV, "none")
    llm = LLM(model=str(quantized), **ENGINE_KW)
    assert _model(llm).model.layers[0].mlp.down_proj.gguf_weight is None
    monkeypatch.setenv(DEFAULT_ENV, "q4")
    with pytest.raises(ValueError, match=f"{DEFAULT_ENV} must be 'blocks' or 'none', got 'q4'"):
        LLM(model=str(quantized), **ENGINE_KW)


# --------------------------------------------------------------------------------------------
# Errors


def _with_config(src: Path, dst: Path, qc: dict | None) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if qc is not None:
        cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _ct(weights: dict, fmt: str = "pack-quantized", **group) -> dict:
    base = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
    return {"quant_method": "compressed-tensors", "format": fmt,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": base | weights, **group}}}


UNSUPPORTED = [
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"GPTQ checkpoints with bits=3 are not supported.*4 or 8"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, r"checkpoint_format='marlin'"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {r"+:.*down": {"bits": 8}}}, r"'dynamic' per-module overrides"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, r"AWQ version 'gemv'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, r"AWQ checkpoints with bits=8.*4-bit"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, r"zero_point=false"),
    (_ct({}, "marlin-24"), r"format\(s\) \['marlin-24'\].*'pack-quantized'"),
    (_ct({}, "int-quantized"), r"format\(s\) \['int-quantized'\]"),
    (_ct({"num_bits": 2}), r"compressed-tensors checkpoints with bits=2"),
    (_ct({"strategy": "tensor_group"}), r"weight strategy 'tensor_group'"),
    (_ct({}, input_activations={"num_bits": 8, "type": "int"}), r"quantizes input activations \(8-bit int\).*W4A16"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method='bitsandbytes'.*Supported: .*'gptq'"),
]


@pytest.mark.parametrize("qc, message", UNSUPPORTED, ids=[m for _, m in UNSUPPORTED])
def test_unsupported_variants_are_refused_by_name(qc, message):
    class Config:
        quantization_config = qc

    with pytest.raises(ValueError, match=message):
        detect_int_weight_checkpoint(Config())


def test_an_unsupported_variant_is_refused_before_loading(sources, tmp_path):
    d = _with_config(sources["llama"], tmp_path / "m", {"quant_method": "gptq", "bits": 2, "group_size": 128})
    with pytest.raises(ValueError, match=r"GPTQ checkpoints with bits=2 are not supported"):
        LLM(model=str(d), **ENGINE_KW)


def test_flags_that_do_not_match_the_checkpoint_are_refused(checkpoint, sources):
    quantized, _ = checkpoint(GPTQ_SYM)
    with pytest.raises(ValueError, match=r"quantization='awq' does not match the checkpoint, whose config.json has "
                                         r"quant_method='gptq'"):
        LLM(model=str(quantized), quantization="awq", **ENGINE_KW)
    with pytest.raises(ValueError, match=r"quantization='gguf' does not apply to this checkpoint, whose weights are "
                                         r"gptq integers"):
        LLM(model=str(quantized), quantization="gguf", **ENGINE_KW)
    with pytest.raises(ValueError, match=r"quantization='compressed-tensors' does not match the checkpoint, whose "
                                         r"config.json has no quantization_config"):
        LLM(model=str(sources["llama"]), quantization="compressed-tensors", **ENGINE_KW)
    with pytest.raises(ValueError, match=r"quantization must be one of .*'gptq', 'awq', 'compressed-tensors'"):
        LLM(model=str(quantized), quantization="gptq_marlin", **ENGINE_KW)


def test_a_config_without_the_packed_tensors_is_refused(sources, tmp_path):
    d = _with_config(sources["llama"], tmp_path / "m", quantization_config(GPTQ_SYM))
    with pytest.raises(ValueError, match=r"says the weights are gptq-quantized, but the checkpoint holds no gptq "
                                         r"layer tensors \(qweight, qzeros, scales\)"):
        LLM(model=str(d), **ENGINE_KW)


def test_inconsistent_layers_are_refused(checkpoint, tmp_path):
    quantized, _ = checkpoint(GPTQ_ASYM_V2)
    state = load_file(str(quantized / "model.safetensors"))
    fmt = IntWeightFormat("gptq", 4, 64, False, checkpoint_format="gptq_v2")
    p = "model.layers.0.mlp.down_proj"
    no_zeros = {k: v for k, v in state.items() if k != f"{p}.qzeros"}
    with pytest.raises(ValueError, match=rf"{p}: the checkpoint holds \['g_idx', 'qweight', 'scales'\] of this gptq "
                                         r"layer but not \['qzeros'\]"):
        list(int_weight_checkpoint_weights(no_zeros.items(), fmt))
    wrong_groups = {**state, f"{p}.scales": state[f"{p}.scales"][:3]}
    with pytest.raises(ValueError, match=rf"{p}: scales with 3 groups over 512 input columns do not match the "
                                         r"config's group_size 64"):
        list(int_weight_checkpoint_weights(wrong_groups.items(), fmt))
    d = tmp_path / "bad"
    shutil.copytree(quantized, d)
    save_file({**state, f"{p}.qweight": state[f"{p}.qweight"].to(torch.int64)}, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{p}.qweight is torch.int64"):
        LLM(model=str(d), **ENGINE_KW)


def test_a_symmetric_schemes_stored_zero_points_are_ignored_wherever_they_come(checkpoint):
    """Older compressed-tensors writers also save a symmetric scheme's (zero) zero points, which sort after the
    layer's other tensors: they are dropped, and the weights are the same."""
    quantized, twin = checkpoint(CT_SYM)
    state = load_file(str(quantized / "model.safetensors"))
    fmt = detect_int_weight_checkpoint(type("C", (), {"quantization_config": quantization_config(CT_SYM)})())
    p = "model.layers.0.mlp.down_proj"
    groups = state[f"{p}.weight_scale"].shape[1]
    zeros = torch.zeros(256 // 8, groups, dtype=torch.int32)
    with_zeros = sorted(state.items()) + [(f"{p}.weight_zero_point", zeros)]
    got = dict(int_weight_checkpoint_weights(with_zeros, fmt))
    assert torch.equal(got[f"{p}.weight"], load_file(str(twin / "model.safetensors"))[f"{p}.weight"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", [GPTQ_SYM, GPTQ_ASYM_V1, AWQ, CT_ASYM], ids=lambda k: k.name)
def test_cuda_runs_the_dequantized_weights_and_matches_transformers(kind, checkpoint):
    """On CUDA the integer weights are dequantized at load (no GGUF blocks) and run through the GPU's kernels and
    graphs: transformers' greedy tokens from the dequantized twin."""
    quantized, twin = checkpoint(kind)
    llm = LLM(model=str(quantized), **{**ENGINE_KW, "device": "cuda"})
    assert not any(getattr(m, "gguf_weight", None) is not None for m in _model(llm).modules())
    assert _greedy(llm) == tiny_hf_greedy(twin)
