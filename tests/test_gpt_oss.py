"""GPT-OSS: attention sinks, alternating sliding-window / full layers, YaRN RoPE, biased experts with the clamped
"swigluoai" activation, and MXFP4 expert checkpoints — greedy tokens equal to transformers' on the same random
weights (CPU, float32), batched and chunked; the MXFP4 dequantization equal to transformers' own."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.model.mxfp4 import dequantize_mxfp4, quantize_mxfp4

MAX_TOKENS = 12
PROMPTS = [[5, 9, 3, 17, 22, 40, 7, 8, 11, 12, 13, 60], [3, 4], list(range(3, 30)), [99, 98, 97, 96, 95, 94, 93]]
ENGINE_KW = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", block_size=4, max_model_len=128)


def _config() -> transformers.GptOssConfig:
    # window 8 < the longest context (39 tokens): the sliding layers drop keys
    return transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        layer_types=["sliding_attention", "full_attention"] * 2, attn_implementation="eager",
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 150000.0})


def _random_model(sink_scale: float = 1.0) -> transformers.GptOssForCausalLM:
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(_config()).eval()
    with torch.no_grad():  # wide enough that greedy margins are not ties and the experts' clamps bite
        for name, p in model.named_parameters():
            big = "sinks" in name or "embed" in name or "norm" in name
            p.normal_(0, 1.0 if big else 0.2 if p.dim() == 1 else 0.3)
            if "sinks" in name:
                p.mul_(sink_scale)
    return model


def _hf_greedy(model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = list(p)
            for _ in range(MAX_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    model = _random_model()
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path, safe_serialization=True)
    return path, _hf_greedy(model, PROMPTS)


def test_sinks_change_the_reference_tokens(dense) -> None:
    """The test model's sinks matter: without them (-1e4) transformers picks other tokens, so a path that dropped
    them could not match the tokens below."""
    _, want = dense
    assert _hf_greedy(_random_model(sink_scale=-1e4), PROMPTS) != want


def test_greedy_matches_transformers_batched_and_chunked(dense) -> None:
    path, want = dense
    assert _greedy(LLM(str(path), **ENGINE_KW), PROMPTS) == want
    # 8-token steps: long prompts prefill over several steps beside other sequences' decodes
    llm = LLM(str(path), max_num_batched_tokens=8, max_num_seqs=4, enable_prefix_caching=True, **ENGINE_KW)
    for _ in range(2):  # the second pass reads the first's cached prefix blocks
        assert _greedy(llm, PROMPTS) == want
    bm = llm.llm_engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks


def test_mxfp4_quantization_round_trips_representable_values() -> None:
    """Values that are E2M1 codes times a group's power of two come back exactly; others to the nearest code."""
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (5, 4, 16), dtype=torch.uint8, generator=gen)
    blocks[:, :, 0] |= 0x07  # each group's largest magnitude is 6 (code 7): the scale it is quantized with
    scales = torch.randint(115, 130, (5, 4), dtype=torch.uint8, generator=gen)
    exact = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(exact), torch.float32), exact)
    w = torch.randn(3, 64, generator=gen)
    err = (dequantize_mxfp4(*quantize_mxfp4(w), torch.float32) - w).abs()
    # a group's scale 2^e has its largest magnitude in [4, 8)·2^e; rounding (and the clamp at 6) err by 2·2^e at most
    assert 0 < err.max() <= w.abs().max() / 2


def test_mxfp4_dequantization_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (3, 8, 4), dtype=torch.uint8, generator=gen)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, rows]: their param layout
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), theirs.transpose(1, 2))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :3])


@pytest.fixture(scope="module")
def mxfp4(dense, tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """The dense model's experts as MXFP4 (as the released gpt-oss files), and transformers' tokens on the MXFP4
    values."""
    path, _ = dense
    out = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    state = load_file(str(path / "model.safetensors"))
    ref = _random_model()
    for name in list(state):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = state.pop(name).transpose(1, 2).contiguous()  # [E, out, in], the MXFP4 files' layout
            state[name + "_blocks"], state[name + "_scales"] = quantize_mxfp4(rows)
            dense_rows = dequantize_mxfp4(state[name + "_blocks"], state[name + "_scales"], torch.float32)
            ref.get_parameter(name).data.copy_(dense_rows.transpose(1, 2))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                          "model.layers.*.mlp.router",
                                                                                          "model.embed_tokens",
                                                                                          "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out, _hf_greedy(ref, PROMPTS)


def _experts(llm: LLM) -> list:
    model = llm.llm_engine.executor.driver_worker.model
    return [m for m in model.modules() if type(m).__name__ == "FusedMoE"]


def test_mxfp4_checkpoint_loads_as_its_dequantized_weights(mxfp4) -> None:
    """quantization='none': an MXFP4 checkpoint's experts are dequantized at load (float32 experts): transformers'
    tokens on the MXFP4 values."""
    path, want = mxfp4
    llm = LLM(str(path), quantization="none", **ENGINE_KW)
    assert all(m.w13_blocks is None and m.w13_gguf is None and m.w13_weight.numel() > 0 for m in _experts(llm))
    assert _greedy(llm, PROMPTS) == want


@pytest.mark.parametrize("quantization", [None, "mxfp4"])
def test_mxfp4_experts_held_as_mxfp4(mxfp4, quantization) -> None:
    """On the CPU in float32, by default and with quantization='mxfp4': the experts stay MXFP4 (no float copy), as
    GGML MXFP4 weights on the quantized linears' int8 kernels (activations rounded to int8 per 32: transformers' top
    choice nearly always)."""
    from gguf_writing import teacher_forced_ranks

    path, want = mxfp4
    llm = LLM(str(path), quantization=quantization, **ENGINE_KW)
    experts = _experts(llm)
    assert experts and all(m.w13_weight.numel() == 0 and m.w2_weight.numel() == 0 for m in experts)
    assert all(m.w13_blocks is None and len(m.w13_gguf) == len(m.w2_gguf) == 4 for m in experts)
    assert {(w.type_name, w.out_features, w.in_features) for m in experts for w in m.w13_gguf} == {("MXFP4", 64, 64)}
    assert {(w.out_features, w.in_features) for m in experts for w in m.w2_gguf} == {(64, 32)}
    ranks = teacher_forced_ranks(llm, PROMPTS, want)
    assert sum(r == 1 for r in ranks) >= 0.9 * len(ranks), ranks


def test_mxfp4_bfloat16_on_the_cpu_dequantizes_by_default(mxfp4) -> None:
    """The int8 kernels take float32 rows: in bfloat16 the default dequantizes at load, and quantization='mxfp4'
    keeps the bytes, dequantizing an expert per product."""
    path, _ = mxfp4
    kw = {**ENGINE_KW, "dtype": "bfloat16"}
    assert all(m.w13_blocks is None and m.w13_weight.numel() > 0 for m in _experts(LLM(str(path), **kw)))
    held = _experts(LLM(str(path), quantization="mxfp4", **kw))
    assert all(m.w13_blocks is not None and m.w13_gguf is None and m.w13_weight.numel() == 0 for m in held)


def test_mxfp4_rows_in_ggml_blocks_are_the_same_values() -> None:
    """to_ggml_blocks (checkpoint layout → llama.cpp's type 39) keeps every value: gguf-py reads them back equal,
    and from_ggml_blocks gives back the checkpoint's bytes."""
    import gguf

    from pagedllm.model.mxfp4 import from_ggml_blocks, to_ggml_blocks

    gen = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (6, 3, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 140, (6, 3), dtype=torch.uint8, generator=gen)
    ggml = to_ggml_blocks(blocks.reshape(6, 48), scales)
    assert ggml.shape == (6, 3 * 17)
    theirs = gguf.quants.dequantize(ggml.numpy(), gguf.GGMLQuantizationType.MXFP4)
    assert torch.equal(torch.from_numpy(theirs), dequantize_mxfp4(blocks, scales, torch.float32).reshape(6, 96))
    with pytest.raises(ValueError, match="do not match"):
        to_ggml_blocks(blocks.reshape(6, 48), scales[:, :2])
    back_blocks, back_scales = from_ggml_blocks(ggml)
    assert torch.equal(back_blocks, blocks) and torch.equal(back_scales, scales)


def test_mxfp4_quantization_needs_an_mxfp4_checkpoint(dense) -> None:
    with pytest.raises(ValueError, match="quantization='mxfp4' serves the MXFP4 experts"):
        LLM(str(dense[0]), quantization="mxfp4", **ENGINE_KW)


def test_mxfp4_needs_whole_groups_per_rank(mxfp4) -> None:
    """tp=2 would split down's 32 inputs into 16-value shares of one MXFP4 group: refused, naming the fix."""
    with pytest.raises(ValueError, match="multiples of 32.*quantization='none'"):
        LLM(str(mxfp4[0]), quantization="mxfp4", tensor_parallel_size=2, num_gpu_blocks_override=64, **ENGINE_KW)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_greedy_matches_transformers(dense) -> None:
    """On the GPU: the Triton attention kernels with sinks and windows (decode graphs, piecewise graphs, split
    decodes), the fused MoE kernels with the experts' biases and swigluoai, float32."""
    path, want = dense
    kw = {**ENGINE_KW, "device": "cuda"}
    llm = LLM(str(path), num_gpu_blocks_override=256, **kw)
    assert _greedy(llm, PROMPTS) == want
    llm = LLM(str(path), num_gpu_blocks_override=256, max_num_batched_tokens=8, max_num_seqs=4, **kw)
    assert _greedy(llm, PROMPTS) == want
    assert not llm.llm_engine.executor.driver_worker.model_runner.compile_watch.events


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_mxfp4_experts_by_default(mxfp4) -> None:
    """On the GPU an MXFP4 checkpoint's experts stay MXFP4 by default, decoded in the fused-MoE kernel's tiles (also
    inside the captured graphs): transformers' tokens on the MXFP4 values; the warm start built every variant."""
    path, want = mxfp4
    llm = LLM(str(path), num_gpu_blocks_override=256, **{**ENGINE_KW, "device": "cuda"})
    assert all(m.w13_blocks is not None and m.w13_weight.numel() == 0 for m in _experts(llm))
    assert _greedy(llm, PROMPTS) == want
    assert not llm.llm_engine.executor.driver_worker.model_runner.compile_watch.events


def test_tensor_parallel_tp2_matches_transformers(dense) -> None:
    """tp=2 (two processes, gloo): each rank holds 2 of the 4 query heads (and their sinks), 1 of the 2 KV heads,
    half of every expert's width; the experts' down bias is added on one rank only."""
    path, want = dense
    llm = LLM(str(path), tensor_parallel_size=2, num_gpu_blocks_override=64, **ENGINE_KW)
    try:
        assert _greedy(llm, PROMPTS) == want
    finally:
        llm.llm_engine.executor.shutdown()
