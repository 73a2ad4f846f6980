"""llama.cpp's gpt-oss GGUF files: a random GPT-OSS written as llama.cpp's converter writes it (sinks, biased router
and experts, gate and up de-interleaved, experts as MXFP4 blocks), served with transformers' greedy tokens on the same
(MXFP4-rounded) weights; on the CPU the MXFP4 experts are served from their blocks by default."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gguf_writing import ENGINE_KW, add_shape_metadata, gguf, hf_greedy, ours_greedy, round_to, teacher_forced_ranks, \
    write_gguf
from pagedllm import LLM, SamplingParams
from pagedllm.model.gguf_loader import get_or_convert_gguf
from safetensors import safe_open

from test_gpt_oss import _random_model

PROMPTS = [[5, 9, 3, 17, 22, 40, 7, 8, 11, 12, 13, 60], [3, 4], list(range(3, 30)), [99, 98, 97, 96, 95, 94, 93]]
MAX_TOKENS = 10


def _metadata(cfg, scaling: bool = True):
    def write(w) -> None:
        add_shape_metadata(w, cfg)
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_sliding_window(cfg.sliding_window)
        rope = cfg.rope_parameters
        if scaling:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    return write


def _write_gpt_oss(model: torch.nn.Module, path: Path, experts_type: str | None = "MXFP4",
                   fused_gate_up: bool = False, sinks: bool = True) -> Path:
    """``model`` as convert_hf_to_gguf.py's GptOssModel stores it: gate / up rows de-interleaved from gate_up_proj
    (or fused, gate rows then up), experts [E, out, in] as ``experts_type`` blocks, biases and sinks F32."""
    cfg = model.config
    state = {k: v for k, v in model.state_dict().items() if ".experts." not in k and not k.endswith(".sinks")}
    extra: list[tuple[str, np.ndarray]] = []
    for i in range(cfg.num_hidden_layers):
        prefix, blk = f"model.layers.{i}", f"blk.{i}"
        experts = model.model.layers[i].mlp.experts
        gate_up = experts.gate_up_proj.detach().transpose(1, 2).numpy()  # [E, 2I, H], gate / up rows interleaved
        bias = experts.gate_up_proj_bias.detach().numpy()
        down = np.ascontiguousarray(experts.down_proj.detach().transpose(1, 2).numpy())  # [E, H, I]
        gate, up = np.ascontiguousarray(gate_up[:, 0::2]), np.ascontiguousarray(gate_up[:, 1::2])
        if fused_gate_up:
            extra += [(f"{blk}.ffn_gate_up_exps.weight", np.concatenate([gate, up], axis=1)),
                      (f"{blk}.ffn_gate_up_exps.bias", np.concatenate([bias[:, 0::2], bias[:, 1::2]], axis=1))]
        else:
            extra += [(f"{blk}.ffn_gate_exps.weight", gate), (f"{blk}.ffn_up_exps.weight", up),
                      (f"{blk}.ffn_gate_exps.bias", np.ascontiguousarray(bias[:, 0::2])),
                      (f"{blk}.ffn_up_exps.bias", np.ascontiguousarray(bias[:, 1::2]))]
        extra += [(f"{blk}.ffn_down_exps.weight", down),
                  (f"{blk}.ffn_down_exps.bias", experts.down_proj_bias.detach().numpy())]
        if sinks:
            sink = model.get_parameter(f"{prefix}.self_attn.sinks").detach().numpy()
            extra.append((f"{blk}.attn_sinks.weight", sink))
    return write_gguf(model, "gpt-oss", path, _metadata(cfg), state_dict=state, extra_tensors=extra,
                      experts_type=experts_type)


def _rounded(model: torch.nn.Module, experts_type: str) -> torch.nn.Module:
    """``model`` with its expert matrices as a file of ``experts_type`` stores them (rows [out, in] quantized)."""
    with torch.no_grad():
        for layer in model.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                rows = p.detach().transpose(1, 2).contiguous().numpy()
                p.copy_(torch.from_numpy(round_to(rows, experts_type)).transpose(1, 2))
    return model


def _cache_tensor_names(src: Path) -> list[str]:
    names: list[str] = []
    for f in get_or_convert_gguf(src).glob("*.safetensors"):
        with safe_open(str(f), "pt") as handle:
            names += list(handle.keys())
    return names


def _experts(llm: LLM) -> list:
    model = llm.llm_engine.executor.driver_worker.model
    return [m for m in model.modules() if type(m).__name__ == "FusedMoE"]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """transformers' greedy tokens on the MXFP4-rounded experts (what every file below stores)."""
    return hf_greedy(_rounded(_random_model(), "MXFP4"), PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("fused_gate_up", [False, True])
def test_gpt_oss_gguf_float_load_matches_transformers(fused_gate_up: bool, reference, tmp_path: Path) -> None:
    """quantization='none': the converted config (sinks, window, YaRN, biases) and the MXFP4 experts dequantized
    give transformers' tokens."""
    src = _write_gpt_oss(_random_model(), tmp_path / "gpt-oss.gguf", fused_gate_up=fused_gate_up)
    cfg = json.loads((get_or_convert_gguf(src) / "config.json").read_text())
    assert cfg["architectures"] == ["GptOssForCausalLM"] and cfg["sliding_window"] == 8
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert cfg["rope_parameters"]["rope_type"] == "yarn" and cfg["rope_parameters"]["factor"] == 4.0
    assert cfg["quantization_config"] == {"quant_method": "mxfp4"}  # (all experts MXFP4: kept MXFP4 on CUDA)
    assert ours_greedy(src, PROMPTS, MAX_TOKENS, quantization="none") == reference


def test_gpt_oss_gguf_float_experts(tmp_path: Path) -> None:
    """A file with float experts (F32) loads as the model itself."""
    model = _random_model()
    want = hf_greedy(model, PROMPTS, MAX_TOKENS)
    src = _write_gpt_oss(model, tmp_path / "gpt-oss-f32.gguf", experts_type=None)
    assert "quantization_config" not in json.loads((get_or_convert_gguf(src) / "config.json").read_text())
    assert ours_greedy(src, PROMPTS, MAX_TOKENS) == want


def test_gpt_oss_gguf_mxfp4_experts_served_from_blocks(reference, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU default for a quantized GGUF (quantization='gguf'; the suite's conftest turns it off): the MXFP4
    experts stay the file's blocks (no float copy in the cache nor in memory) and run in the int8 kernels; their
    tokens are transformers' top choice nearly always (activations rounded to int8)."""
    monkeypatch.setenv("PAGEDLLM_GGUF_QUANTIZATION", "gguf")
    src = _write_gpt_oss(_random_model(), tmp_path / "gpt-oss.gguf")
    llm = LLM(model=str(src), **ENGINE_KW)
    assert not [n for n in _cache_tensor_names(src) if ".experts." in n and n.endswith(".weight")]
    experts = _experts(llm)
    assert experts and all(m.w13_gguf and m.w2_gguf and m.w13_weight.numel() == 0 for m in experts)
    assert {w.type_name for m in experts for w in m.w13_gguf + m.w2_gguf} == {"MXFP4"}
    ranks = teacher_forced_ranks(llm, PROMPTS, reference)
    assert sum(r == 1 for r in ranks) >= 0.9 * len(ranks), ranks


@pytest.mark.parametrize("fused_gate_up", [False, True])
def test_gpt_oss_gguf_experts_held_as_mxfp4(fused_gate_up: bool, tmp_path: Path) -> None:
    """quantization='mxfp4' (what CUDA does by default for such a file): the experts go from the file's blocks into
    the MXFP4 bytes and scales the released checkpoints load into (never dequantized); on the CPU those then run the
    same int8 kernels as quantization='gguf' on the same bytes: the same tokens, log-probabilities within float32
    rounding (the dense layers' GEMMs differ: packed panels here, F.linear beside GGUF blocks)."""
    src = _write_gpt_oss(_random_model(), tmp_path / "gpt-oss.gguf", fused_gate_up=fused_gate_up)
    params = dict(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)

    runs = []
    for quantization in ("mxfp4", "gguf"):
        llm = LLM(model=str(src), quantization=quantization, **ENGINE_KW)
        assert all(m.w13_gguf and m.w13_weight.numel() == 0 for m in _experts(llm))
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**params), use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(*runs):
        assert tokens == want_tokens
        for got, want in zip(logprobs, want_logprobs):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)


def test_gpt_oss_gguf_without_sinks_is_refused(tmp_path: Path) -> None:
    src = _write_gpt_oss(_random_model(), tmp_path / "no-sinks.gguf", sinks=False)
    with pytest.raises(ValueError, match="attention sinks"):
        LLM(model=str(src), **ENGINE_KW)


def test_benchmark_file_serves_text_with_its_tokenizer(tmp_path: Path) -> None:
    """benchmarks/gpt_oss_gguf.py's file (MXFP4 experts, Q8_0 attention, the bundled tokenizer's keys): the
    tokenizer and chat template come from the file, and a chat request runs on the quantized default."""
    import importlib.util


    spec = importlib.util.spec_from_file_location("gpt_oss_gguf", Path(__file__).parents[1] / "benchmarks" /
                                                  "gpt_oss_gguf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    src = module.write(tmp_path / "bench.gguf", hidden=128, layers=2, experts=4, used=2, width=64, kv_heads=1, seed=0)
    llm = LLM(model=str(src), quantization="gguf", num_gpu_blocks_override=32, max_model_len=128, device="cpu")
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                   use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 6 and out.text == llm.get_tokenizer().decode(out.token_ids)
    assert all(m.w13_gguf for m in _experts(llm))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gpt_oss_gguf_keeps_mxfp4_experts(reference, tmp_path: Path) -> None:
    """On the GPU the file's MXFP4 experts stay MXFP4 by default (the fused-MoE kernel decodes them): transformers'
    tokens on the MXFP4 values, float32."""
    src = _write_gpt_oss(_random_model(), tmp_path / "gpt-oss.gguf")
    llm = LLM(model=str(src), **{**ENGINE_KW, "device": "cuda", "dtype": "float32", "num_gpu_blocks_override": 256})
    assert all(m.w13_blocks is not None and m.w13_weight.numel() == 0 for m in _experts(llm))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
