"""DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention, shared + routed experts), loaded from directories
transformers wrote, must generate what transformers generates (greedy, float32), as the families of test_models_hf.py.

Three tiny random models: V2-Lite's shape (q_proj, greedy softmax routing), V2's (q_a_proj → q_b_proj, YaRN with
mscale_all_dim, group-limited routing, routed_scaling_factor 2, attention biases) and V3's (sigmoid routing with a
randomized e_score_correction_bias and grouped top-k, norm_topk_prob, routed_scaling_factor 2.5, YaRN with
mscale ≠ mscale_all_dim).
Every layer after the first is an MoE block; v_head_dim (16) is narrower than q·k's 24, so V is zero-padded in the
cache. test_knobs_change_transformers_outputs shows each knob changes transformers' own outputs, so parity is no
accident; test_routers_match_transformers compares the routers' choices directly.
"""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_models_hf import (
    ENGINE_KW,
    MAX_TOKENS,
    PROMPT_LENS,
    SMALL_POOL,
    VOCAB,
    Built,
    Family,
    _assert_logprobs_match,
    _greedy,
    _model,
    _random_model,
    build_from_model,
    greedy_on_cpu_path,
)

from pagedllm import LLM
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.fused_moe import FusedMoE
from pagedllm.model.models.deepseek_v2 import DeepseekV2MoE, DeepseekV2TopkRouter, yarn_mscale
from pagedllm.model.models.llama import LlamaMLP
from pagedllm.model.models.registry import get_model_class
from pagedllm.worker.worker import kv_geometry

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

_MLA = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            max_position_embeddings=128, attn_implementation="eager")
QK_HEAD_DIM = 24  # qk_nope + qk_rope: the cache's head width (v_head_dim 16 is padded to it)
# Sequences of up to 30 + 16 tokens pass the original 32 positions.
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32)

FAMILIES: dict[str, Family] = {
    # DeepSeek-V2-Lite's layout: q_proj (no q LoRA), softmax top-2 of 8, two shared experts, plain RoPE.
    "deepseek-v2-lite": Family("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        **_MLA, "q_lora_rank": None, "topk_method": "greedy", "n_shared_experts": 2},
        "DeepseekV2ForCausalLM"),
    # DeepSeek-V2's: q LoRA, top-2 within the better of 2 groups (by its best expert; top-1 of 2 groups: with more
    # groups than experts chosen, group-limited top-2 would equal greedy), scaled weights, YaRN (mscale = all_dim),
    # attention_bias (q_a_proj, kv_a_proj_with_mqa and o_proj biased, as transformers).
    "deepseek-v2": Family("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        **_MLA, "q_lora_rank": 32, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 2.0, "n_shared_experts": 1, "attention_bias": True,
        "rope_parameters": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}}, "DeepseekV2ForCausalLM"),
    # DeepSeek-V3's: sigmoid scores, bias-corrected choice among the 2 best groups by top-2 sums, renormalized and
    # scaled weights, interleaved YaRN RoPE whose mscale differs from mscale_all_dim (cos/sin and softmax scaled).
    "deepseek-v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **_MLA, "q_lora_rank": 32, "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
        "routed_scaling_factor": 2.5, "n_shared_experts": 1,
        "rope_parameters": {**_YARN, "mscale": 1.0, "mscale_all_dim": 0.8}}, "DeepseekV3ForCausalLM"),
}


def _deepseek_model(family: Family) -> torch.nn.Module:
    """_random_model, and V3's e_score_correction_bias (a buffer, which it leaves at 0) randomized wide enough to
    change which experts are chosen."""
    model = _random_model(family)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.3)
    return model


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            cache[name] = build_from_model(_deepseek_model(FAMILIES[name]), tmp_path_factory.mktemp(name), PROMPT_LENS)
        return cache[name]

    return get


def _config(name: str, **overrides) -> transformers.PretrainedConfig:
    family = FAMILIES[name]
    config = getattr(transformers, family.config_cls)(vocab_size=VOCAB, **family.kwargs)
    for key, value in overrides.items():  # after __post_init__, which would derive or reject some
        setattr(config, key, value)
    return config


def _construct(config: transformers.PretrainedConfig, tp_size: int = 1) -> torch.nn.Module:
    return get_model_class(config)(config, TensorParallelGroup(rank=0, size=tp_size), torch.float32)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_parity_with_preemption(name: str, build) -> None:
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=SMALL_POOL, block_size=4, **ENGINE_KW)
    model = _model(llm)
    assert type(model).__name__ == FAMILIES[name].ours
    outs = greedy_on_cpu_path(llm, built.prompts, direct=False)  # MLA runs through its modules
    for prompt, ref, out in zip(built.prompts, built.reference, outs):
        assert list(out.outputs[0].token_ids) == ref, f"{name}: prompt of {len(prompt)} tokens diverged"
    _assert_logprobs_match(outs, built)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0, "the small pool should have forced preemption"
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == SMALL_POOL
    cache = llm.llm_engine.executor.driver_worker.cache_engine.gpu_cache[0][0]
    assert tuple(cache.shape[2:]) == (4, QK_HEAD_DIM)  # every head's K (and padded V)


def test_weights_loaded_exactly(build) -> None:
    """The router in float32 with V3's correction bias, the latent norms, per-expert stacking; the checkpoint's
    names are transformers' per-expert ones."""
    built = build("deepseek-v3")
    saved = load_file(str(built.path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in saved
    model = _model(LLM(model=str(built.path), num_gpu_blocks_override=4, **ENGINE_KW))
    mlp, attn = model.model.layers[2].mlp, model.model.layers[2].self_attn
    bias = saved["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert bias.abs().min() > 0
    torch.testing.assert_close(mlp.gate.e_score_correction_bias, bias, rtol=0, atol=0)
    assert mlp.gate.weight.dtype == torch.float32
    norm = saved["model.layers.2.self_attn.kv_a_layernorm.weight"]
    assert (norm - 1).abs().sum() > 0  # moved off 1 by _random_model
    torch.testing.assert_close(attn.kv_a_layernorm.weight, norm, rtol=0, atol=0)
    w13 = torch.cat([saved[f"model.layers.2.mlp.experts.5.{p}_proj.weight"] for p in ("gate", "up")])
    torch.testing.assert_close(mlp.experts.w13_weight[5], w13, rtol=0, atol=0)


def test_mtp_layers_are_skipped_and_unknown_tensors_rejected(build) -> None:
    """A V3 checkpoint's multi-token-prediction layer (past num_hidden_layers) is ignored, as vLLM does when not
    speculating with it; a tensor the model does not have is still an error."""
    built = build("deepseek-v3")
    saved = load_file(str(built.path / "model.safetensors"))
    model = _construct(transformers.AutoConfig.from_pretrained(built.path))
    mtp = {"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
           "model.layers.3.mlp.experts.0.gate_proj.weight": torch.zeros(32, 64),
           "model.layers.3.shared_head.head.weight": torch.zeros(VOCAB, 64)}
    model.load_weights(list(saved.items()) + list(mtp.items()))
    with pytest.raises(ValueError, match="no matching parameter"):
        model.load_weights(list(saved.items()) + [("model.layers.1.self_attn.k_proj.weight", torch.zeros(4, 4))])


def test_structure_follows_the_config() -> None:
    """Dense then MoE layers, q_proj or the q LoRA, the cache head width and softmax scale, no random draws."""
    config = _config("deepseek-v2-lite")
    state = torch.get_rng_state()
    model = _construct(config)
    assert torch.equal(torch.get_rng_state(), state)
    layers = model.model.layers
    assert [type(layer.mlp) for layer in layers] == [LlamaMLP, DeepseekV2MoE, DeepseekV2MoE]
    assert layers[1].mlp.shared_experts.down_proj.weight.shape == (64, 64)  # 2 shared experts of 32
    assert layers[1].mlp.gate.e_score_correction_bias is None
    attn = layers[0].self_attn
    assert attn.q_proj is not None and attn.q_a_proj is None and attn.rope_interleave
    assert attn.attn.head_dim == QK_HEAD_DIM and attn.attn.scale == QK_HEAD_DIM**-0.5
    assert kv_geometry(config, 1) == (3, 4, QK_HEAD_DIM) and kv_geometry(config, 2) == (3, 2, QK_HEAD_DIM)

    config = _config("deepseek-v3")
    layers = _construct(config).model.layers
    attn = layers[0].self_attn
    assert attn.q_proj is None and attn.q_b_proj.weight.shape == (4 * QK_HEAD_DIM, 32)
    assert attn.attn.scale == pytest.approx(QK_HEAD_DIM**-0.5 * yarn_mscale(4.0, 0.8) ** 2)
    assert layers[2].mlp.gate.e_score_correction_bias.shape == (8,)
    assert not _construct(_config("deepseek-v3", rope_interleave=False)).model.layers[0].self_attn.rope_interleave


def test_unsupported_configs_are_clear_errors() -> None:
    cases = [
        ("deepseek-v3", dict(num_key_value_heads=2), "num_key_value_heads must equal"),
        ("deepseek-v2-lite", dict(norm_topk_prob=True), "norm_topk_prob=True is not supported"),
        ("deepseek-v2-lite", dict(topk_method="noaux_tc"), "topk_method='noaux_tc' is not supported"),
        ("deepseek-v2-lite", dict(moe_layer_freq=2), "moe_layer_freq=2 is not supported"),
        ("deepseek-v2", dict(n_group=3), "n_group dividing n_routed_experts"),
        ("deepseek-v2", dict(n_group=8), "exceeds the 1 experts"),
        ("deepseek-v3", dict(n_group=8), "must be >= 2"),
        ("deepseek-v3", dict(scoring_func="softmax"), "scoring_func='sigmoid'"),
        ("deepseek-v3", dict(hidden_act="gelu"), "hidden_act='silu' only"),
    ]
    for name, overrides, match in cases:
        with pytest.raises(ValueError, match=match):
            _construct(_config(name, **overrides))
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        _construct(_config("deepseek-v3"), tp_size=3)


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v2", "deepseek-v3"])
def test_routers_match_transformers(name: str) -> None:
    """Our router's (weight, expert) pairs equal transformers' router's on the same logits' hidden states."""
    config = _config(name)
    hf_router = (transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter if name == "deepseek-v3"
                 else transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter)(config)
    ours = DeepseekV2TopkRouter(config, 8, sigmoid=name == "deepseek-v3")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(8, 64, generator=gen) * 0.3)
        hf_router.weight.copy_(ours.weight)
        if ours.e_score_correction_bias is not None:
            ours.e_score_correction_bias.copy_(torch.randn(8, generator=gen) * 0.3)
            hf_router.e_score_correction_bias.copy_(ours.e_score_correction_bias)
        x = torch.randn(64, 64, generator=gen)
        _, want_w, want_ids = hf_router(x)
        got_w, got_ids = ours.select_experts(ours(x))
    want_ids, order = want_ids.sort(dim=-1)
    got_ids, got_order = got_ids.sort(dim=-1)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w.gather(1, got_order), want_w.gather(1, order), rtol=0, atol=0)


def test_knobs_change_transformers_outputs(build) -> None:
    """Each knob off (or the bias zeroed) changes transformers' own log-probs, so parity above is not by accident."""
    cases = [("deepseek-v2", dict(topk_method="greedy")), ("deepseek-v2", dict(routed_scaling_factor=1.0)),
             ("deepseek-v2", dict(rope_parameters={**_YARN, "mscale": 0.707})),  # no mscale_all_dim: softmax scale
             ("deepseek-v3", dict(routed_scaling_factor=1.0)), ("deepseek-v3", dict(norm_topk_prob=False)),
             ("deepseek-v3", dict(rope_interleave=False)), ("deepseek-v3", dict(n_group=1, topk_group=1)),
             ("deepseek-v3", {"e_score_correction_bias": 0.0})]
    for name, off in cases:
        built = build(name)
        config = transformers.AutoConfig.from_pretrained(built.path)
        for key, value in off.items():
            if key != "e_score_correction_bias":
                setattr(config, key, value)
        model = getattr(transformers, FAMILIES[name].model_cls).from_pretrained(built.path, config=config).eval()
        if "e_score_correction_bias" in off:
            for module in model.modules():
                if getattr(module, "e_score_correction_bias", None) is not None:
                    module.e_score_correction_bias.zero_()
        ids = torch.tensor([built.prompts[-1] + built.reference[-1]])
        with torch.inference_mode():
            logits = torch.log_softmax(model(ids).logits[0, -MAX_TOKENS - 1:-1].float(), dim=-1)
        assert (logits - built.logprobs[-1]).abs().max() > 1e-3, (name, off)


def test_registry_by_architecture_and_model_type() -> None:
    for cfg_cls, ours in [("DeepseekV2Config", "DeepseekV2ForCausalLM"), ("DeepseekV3Config", "DeepseekV3ForCausalLM")]:
        config = getattr(transformers, cfg_cls)()  # no `architectures`: model_type decides
        assert get_model_class(config).__name__ == ours
        config.architectures = [ours]
        assert get_model_class(config).__name__ == ours


def test_tensor_parallel_tp2_matches_hf(build) -> None:
    """End to end at tp=2 (real processes, gloo): each rank holds 2 of the 4 heads (q_b_proj, kv_b_proj, o_proj rows
    or columns), half of every expert's and the shared experts' width, the latent projections and router whole."""
    built = build("deepseek-v3")
    llm = LLM(model=str(built.path), num_gpu_blocks_override=SMALL_POOL, block_size=4, tensor_parallel_size=2,
              distributed_executor_backend="mp", **ENGINE_KW)
    executor = llm.llm_engine.executor
    try:
        worker = executor.driver.worker
        assert tuple(worker.cache_engine.gpu_cache[0][0].shape[2:]) == (2, QK_HEAD_DIM)
        moe = next(m for m in worker.model.modules() if isinstance(m, FusedMoE))
        assert moe.w2_weight.shape == (8, 64, 16)
        outs = _greedy(llm, built.prompts, logprobs=3)
    finally:
        executor.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == built.reference
    _assert_logprobs_match(outs, built)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_cuda_greedy_parity(name: str, build) -> None:
    """The GPU's kernels (Triton attention at a head width of 24, fused RoPE and norms, the Triton grouped-GEMM
    experts, CUDA graphs) in float32: transformers' greedy tokens, its log-probs to float32-on-GPU noise."""
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=64, **{**ENGINE_KW, "device": "cuda"})
    outs = _greedy(llm, built.prompts, logprobs=3)
    assert [list(o.outputs[0].token_ids) for o in outs] == built.reference, name
    _assert_logprobs_match(outs, built, atol=2e-3)
