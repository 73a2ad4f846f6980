"""FP8 checkpoints (issue 21: "checkpoints already in FP8 load as such"): compressed-tensors and quant_method
"fp8" directories load on the CPU as exactly their dequantized weights and generate what transformers generates
from those; the e4m3 values and per-row scales a CUDA engine keeps are the checkpoint's bit for bit; unsupported
quantization configs and inconsistent checkpoints get errors that say what is wrong and what is supported."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_checkpoints import KINDS, ct_config, write_fp8_checkpoint
from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model import loader
from pagedllm.model.fp8_checkpoint import (
    build_for_fp8_checkpoint,
    detect_fp8_checkpoint,
    finish_fp8_checkpoint,
    fp8_checkpoint_weights,
    prepare_for_fp8_checkpoint,
)
from pagedllm.model.layers.linear import restore_dense_weights
from pagedllm.model.models.llama import LlamaForCausalLM
from tiny_models import TINY_ENGINE_KW as ENGINE_KW, TINY_MAX_TOKENS as MAX_TOKENS, TINY_PROMPTS as PROMPTS
from tiny_models import save_tiny_llama, tiny_hf_greedy



@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return Path(save_tiny_llama(tmp_path_factory.mktemp("fp8src") / "llama"))


@pytest.fixture(scope="module")
def checkpoints(source: Path, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("fp8ckpt")
    return {kind: (root / kind, write_fp8_checkpoint(source, root / kind, kind)) for kind in KINDS}


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]



@pytest.mark.parametrize("kind", KINDS)
def test_fp8_checkpoint_loads_as_its_dequantized_weights_and_matches_transformers(kind, checkpoints, caplog):
    fp8_dir, twin = checkpoints[kind]
    with caplog.at_level("INFO", logger="pagedllm"):
        llm = LLM(model=str(fp8_dir), **ENGINE_KW)
    log = caplog.text
    assert "FP8 checkpoint (" in log
    if kind == "fp8-block":  # 3 layers × 7 checkpoint linears dequantized while loading; 12 layers as loaded
        assert "0 kept in e4m3" in log and "12 in torch.float32 as loaded" in log and "21 tensors)" in log
    else:  # the CPU has no FP8 GEMM: 3 layers × (qkv, o, gate_up, down) dequantized after loading
        assert "0 kept in e4m3" in log and "12 dequantized to torch.float32" in log
    if kind in ("ct-tensor", "autofp8-static"):
        assert "input_scale" in log and "not used" in log
    model = llm.llm_engine.executor.driver_worker.model
    restore_dense_weights(model)
    want = load_file(str(twin / "model.safetensors"))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    p = "model.layers.1."
    cases = {
        "qkv": (attn.qkv_proj.weight, torch.cat([want[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])),
        "o": (attn.o_proj.weight, want[p + "self_attn.o_proj.weight"]),
        "gate_up": (mlp.gate_up_proj.weight, torch.cat([want[p + f"mlp.{x}_proj.weight"] for x in ("gate", "up")])),
        "down": (mlp.down_proj.weight, want[p + "mlp.down_proj.weight"]),
        "lm_head": (model.lm_head.weight, want["lm_head.weight"]),
    }
    for name, (got, expect) in cases.items():
        torch.testing.assert_close(got, expect, rtol=0, atol=0, msg=f"{kind}: {name}")
    assert all(not hasattr(m, "weight_scale") for m in model.modules())  # the per-row scales were folded in
    assert _greedy(llm) == tiny_hf_greedy(twin)


def test_tied_embeddings_stay_one_parameter_through_the_meta_build(tmp_path):
    """The bundled model's shape (LM head tied to the embeddings), as a channel-scaled FP8 checkpoint: the tie
    survives the meta-device build, and the engine generates what transformers does on the dequantized twin."""
    save_tiny_llama(tmp_path / "src", tie_word_embeddings=True)
    twin = write_fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", "ct-channel")
    llm = LLM(model=str(tmp_path / "fp8"), **ENGINE_KW)
    model = llm.llm_engine.executor.driver_worker.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert _greedy(llm) == tiny_hf_greedy(twin)


def test_kept_layers_hold_the_checkpoints_e4m3_bytes_and_scales(checkpoints):
    """What a CUDA engine keeps (keep_fp8=True; _scaled_mm itself is not called here): q/k/v stacked, per-channel
    bf16 scales and per-tensor scales expanded to rows, the values bit for bit."""
    for kind in ("ct-channel", "ct-tensor"):
        fp8_dir, _ = checkpoints[kind]
        hf_config = loader.load_config(fp8_dir)
        fmt = detect_fp8_checkpoint(hf_config)
        assert fmt is not None and fmt.weight_strategy == kind.split("-")[1]
        model = build_for_fp8_checkpoint(lambda: LlamaForCausalLM(hf_config, TensorParallelGroup(), torch.bfloat16),
                                         torch.device("cpu"), fmt, keep_fp8=True)
        # Built on the meta device, then the linears' weights allocated in e4m3: never their bf16 size.
        assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
        assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.bfloat16
        assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
        prepare_for_fp8_checkpoint(model)
        model.load_weights(fp8_checkpoint_weights(loader.iterate_weights(fp8_dir), fmt))
        counts = finish_fp8_checkpoint(model, keep_fp8=True)
        assert counts == {"fp8": 12}  # 3 layers × qkv, o, gate_up, down
        state = load_file(str(fp8_dir / "model.safetensors"))
        qkv = model.model.layers[2].self_attn.qkv_proj
        names = [f"model.layers.2.self_attn.{x}_proj" for x in "qkv"]
        expect = torch.cat([state[n + ".weight"] for n in names])
        assert qkv.fp8_weight.dtype == torch.float8_e4m3fn and qkv.weight.numel() == 0
        assert torch.equal(qkv.fp8_weight.view(torch.uint8), expect.view(torch.uint8))
        rows = torch.cat([state[n + ".weight_scale"].float().reshape(-1).expand(state[n + ".weight"].shape[0])
                          for n in names])
        assert torch.equal(qkv.fp8_scale, rows[None, :])
        assert model.lm_head.fp8_weight is None and model.lm_head.weight.dtype == torch.bfloat16


def test_a_layer_stored_unquantized_loads_in_the_model_dtype_beside_e4m3_ones(checkpoints, tmp_path):
    fp8_dir, _ = checkpoints["ct-channel"]
    state = load_file(str(fp8_dir / "model.safetensors"))
    down = "model.layers.1.mlp.down_proj"
    plain = torch.randn(state[down + ".weight"].shape) * 0.05
    state = {k: v for k, v in state.items() if k != down + ".weight_scale"} | {down + ".weight": plain}
    d = tmp_path / "mixed"
    shutil.copytree(fp8_dir, d)
    save_file(state, str(d / "model.safetensors"))
    hf_config = loader.load_config(d)
    fmt = detect_fp8_checkpoint(hf_config)
    model = build_for_fp8_checkpoint(lambda: LlamaForCausalLM(hf_config, TensorParallelGroup(), torch.bfloat16),
                                     torch.device("cpu"), fmt, keep_fp8=True)
    prepare_for_fp8_checkpoint(model)
    model.load_weights(fp8_checkpoint_weights(loader.iterate_weights(d), fmt))
    assert finish_fp8_checkpoint(model, keep_fp8=True) == {"fp8": 11, "plain": 1}
    layer = model.model.layers[1].mlp.down_proj
    assert layer.fp8_weight is None and torch.equal(layer.weight, plain.to(torch.bfloat16))
    assert model.model.layers[1].self_attn.o_proj.fp8_weight is not None


def test_tensor_parallel_ranks_keep_their_rows_of_weights_and_scales(checkpoints):
    fp8_dir, _ = checkpoints["ct-channel"]
    hf_config = loader.load_config(fp8_dir)
    state = load_file(str(fp8_dir / "model.safetensors"))
    fmt = detect_fp8_checkpoint(hf_config)
    for rank in (0, 1):
        model = build_for_fp8_checkpoint(
            lambda: LlamaForCausalLM(hf_config, TensorParallelGroup(rank=rank, size=2), torch.bfloat16),
            torch.device("cpu"), fmt, keep_fp8=True)
        prepare_for_fp8_checkpoint(model)
        model.load_weights(fp8_checkpoint_weights(loader.iterate_weights(fp8_dir), fmt))
        finish_fp8_checkpoint(model, keep_fp8=True)
        gate_up = model.model.layers[0].mlp.gate_up_proj
        half = 256  # intermediate 512 split over 2 ranks
        names = [f"model.layers.0.mlp.{x}_proj" for x in ("gate", "up")]
        expect = torch.cat([state[n + ".weight"][rank * half:(rank + 1) * half] for n in names])
        assert torch.equal(gate_up.fp8_weight.view(torch.uint8), expect.view(torch.uint8))
        scales = torch.cat([state[n + ".weight_scale"].float().reshape(-1)[rank * half:(rank + 1) * half]
                            for n in names])
        assert torch.equal(gate_up.fp8_scale[0], scales)
        down = model.model.layers[0].mlp.down_proj  # row-parallel: columns split, every row's scale kept
        columns = state["model.layers.0.mlp.down_proj.weight"][:, rank * half:(rank + 1) * half]
        assert torch.equal(down.fp8_weight.view(torch.uint8), columns.view(torch.uint8))


def _with_config(src: Path, dst: Path, quantization_config: dict) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("qc, message", [
    # (GPTQ, AWQ and pack-quantized integer weights load since tests/test_int4_checkpoints.py)
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     r"quant_method='bitsandbytes'.*Supported: quant_method 'fp8'"),
    ({"quant_method": "compressed-tensors", "format": "marlin-24",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}}, r"format\(s\) \['marlin-24'\]"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}}}, r"stores 4-bit float weights"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, r"two positive ints"),
])
def test_unsupported_quantization_configs_are_refused_by_name(qc, message, source, tmp_path):
    with pytest.raises(ValueError, match=message):
        LLM(model=str(_with_config(source, tmp_path / "m", qc)), **ENGINE_KW)


def test_inconsistent_fp8_checkpoints_are_refused(checkpoints, tmp_path):
    fp8_dir, _ = checkpoints["ct-channel"]
    state = load_file(str(fp8_dir / "model.safetensors"))
    cases = {
        "no scale": ({k: v for k, v in state.items() if k != "model.layers.0.mlp.down_proj.weight_scale"},
                     r"down_proj.weight is float8_e4m3fn but the checkpoint has no .*down_proj.weight_scale"),
        "scale of a float weight": ({**state, "model.layers.0.mlp.down_proj.weight":
                                     state["model.layers.0.mlp.down_proj.weight"].float()},
                                    r"a scale for model.layers.0.mlp.down_proj but no float8_e4m3fn"),
        "half a fused layer": ({**state, "model.layers.1.self_attn.k_proj.weight":
                                state["model.layers.1.self_attn.k_proj.weight"].float()},
                               r"stores 2 of the 3 projections fused into one layer"),
    }
    for name, (tensors, message) in cases.items():
        if name == "half a fused layer":
            tensors = {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.weight_scale"}
        d = tmp_path / name.replace(" ", "_")
        shutil.copytree(fp8_dir, d)
        save_file(tensors, str(d / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            LLM(model=str(d), **ENGINE_KW)


def test_dummy_weights_ignore_the_quantization_config(checkpoints):
    fp8_dir, _ = checkpoints["ct-channel"]
    llm = LLM(model=str(fp8_dir), load_format="dummy", **ENGINE_KW)
    assert len(_greedy(llm)[0]) == MAX_TOKENS


@pytest.mark.cuda
def test_fp8_checkpoint_on_cuda_equals_quantization_fp8_of_the_same_values(source, tmp_path):
    """On CUDA the checkpoint's layers run as FP8: a checkpoint written with the engine's own per-channel recipe
    (fp8_linear.quantize_weight of the bf16 weights) gives the same e4m3 bytes, scales and greedy tokens as
    --quantization fp8 on the bf16 model."""
    from pagedllm.kernels import fp8_linear

    state = load_file(str(source / "model.safetensors"))
    fp8_state = {}
    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix.rpartition(".")[2] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"):
            # On the device the engine quantizes on: CPU and CUDA round a few values differently.
            q, s = fp8_linear.quantize_weight(t.to("cuda", torch.bfloat16))
            fp8_state[name], fp8_state[prefix + ".weight_scale"] = q.cpu(), s.reshape(-1, 1).cpu()
        else:
            fp8_state[name] = t
    d = tmp_path / "ours"
    shutil.copytree(source, d)
    save_file(fp8_state, str(d / "model.safetensors"))
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = ct_config("channel", static=False)
    (d / "config.json").write_text(json.dumps(cfg))
    kw = dict(skip_tokenizer_init=True, dtype="bfloat16", device="cuda", num_gpu_blocks_override=256,
              gpu_memory_utilization=0.3)
    from_ckpt = LLM(model=str(d), **kw)
    requant = LLM(model=str(source), quantization="fp8", **kw)
    a = from_ckpt.llm_engine.executor.driver_worker.model.model.layers[0].mlp.gate_up_proj
    b = requant.llm_engine.executor.driver_worker.model.model.layers[0].mlp.gate_up_proj
    assert torch.equal(a.fp8_weight.view(torch.uint8), b.fp8_weight.view(torch.uint8))
    assert torch.equal(a.fp8_scale, b.fp8_scale)
    assert _greedy(from_ckpt) == _greedy(requant)
    # The checkpoint's linears are allocated in e4m3 (meta-device build): loading never holds their bf16 copies,
    # which --quantization fp8 holds until it quantizes.
    ckpt_worker = from_ckpt.llm_engine.executor.driver_worker
    requant_worker = requant.llm_engine.executor.driver_worker
    assert ckpt_worker.model_memory_bytes == requant_worker.model_memory_bytes
    assert ckpt_worker.model_load_peak_bytes < requant_worker.model_load_peak_bytes
    with pytest.raises(ValueError, match="outputs are bfloat16: use dtype='bfloat16'"):
        LLM(model=str(source), quantization="fp8", **{**kw, "dtype": "float16"})
