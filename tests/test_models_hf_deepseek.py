"""DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention, shared + routed experts), loaded from directories
transformers wrote, must generate what transformers generates (greedy, float32), as the families of test_models_hf.py.

Three tiny random models: V2-Lite's shape (q_proj, greedy softmax routing), V2's (q_a_proj → q_b_proj, YaRN with
mscale_all_dim, group-limited routing, routed_scaling_factor 2, attention biases) and V3's (sigmoid routing with a
randomized e_score_correction_bias and grouped top-k, norm_topk_prob, routed_scaling_factor 2.5, YaRN with
mscale ≠ mscale_all_dim).
Every layer after the first is an MoE block. The KV cache holds MLA's latent, one row [c_kv; k_pe] of
kv_lora_rank + qk_rope_head_dim (32 + 8) per token and layer, with kv_b_proj absorbed into q and the output.
test_knobs_change_transformers_outputs shows each knob changes transformers' own outputs, so parity is no
accident; test_routers_match_transformers compares the routers' choices directly.
"""
from __future__ import annotations

import random
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
    hf_greedy_reference,
)

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.fused_moe import FusedMoE
from pagedllm.model.models.deepseek_v2 import DeepseekV2MoE, DeepseekV2TopkRouter, yarn_mscale
from pagedllm.model.models.llama import LlamaMLP
from pagedllm.model.models.registry import get_model_class
from pagedllm.worker.cache_engine import CacheEngine
from pagedllm.worker.worker import kv_geometry

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

_MLA = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            first_k_dense_replace=1, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            max_position_embeddings=128, attn_implementation="eager")
QK_HEAD_DIM = 24  # qk_nope + qk_rope: the softmax scale's head dim
LATENT_DIM = 40  # kv_lora_rank + qk_rope_head_dim: the one cached row per token and layer
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
    assert tuple(cache.shape[2:]) == (1, LATENT_DIM)  # the latent row, one "head" for all query heads


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


def test_fp8_checkpoint_kv_b_proj_is_dequantized(build) -> None:
    """kv_b_proj is absorbed, not run as a linear: an FP8 checkpoint's per-row-scaled e4m3 kv_b_proj (as
    model/fp8_checkpoint.py hands it over: the weight, then its weight_scale) loads dequantized."""
    built = build("deepseek-v2-lite")
    saved = load_file(str(built.path / "model.safetensors"))
    name = "model.layers.1.self_attn.kv_b_proj"
    weight = saved.pop(f"{name}.weight")
    scale = weight.abs().amax(dim=1) / 448.0
    e4m3 = (weight / scale[:, None]).to(torch.float8_e4m3fn)
    model = _construct(transformers.AutoConfig.from_pretrained(built.path))
    model.load_weights(list(saved.items()) + [(f"{name}.weight", e4m3), (f"{name}.weight_scale", scale)])
    loaded = model.model.layers[1].self_attn.kv_b_proj.weight
    torch.testing.assert_close(loaded, e4m3.float() * scale[:, None], rtol=0, atol=0)
    with pytest.raises(ValueError, match="without their weight_scale"):
        _construct(transformers.AutoConfig.from_pretrained(built.path)).load_weights(
            list(saved.items()) + [(f"{name}.weight", e4m3)])


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
    assert (attn.attn.num_heads, attn.attn.num_kv_heads, attn.attn.head_dim) == (4, 1, LATENT_DIM)
    assert attn.attn.scale == QK_HEAD_DIM**-0.5  # the original q·k head dim's, not the latent's
    assert attn.kv_b_proj.W_UK_T.shape == (4, 16, 32) and attn.kv_b_proj.W_UV.shape == (4, 32, 16)
    assert kv_geometry(config, 1) == (3, 1, LATENT_DIM) and kv_geometry(config, 2) == (3, 1, LATENT_DIM)

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
        assert tuple(worker.cache_engine.gpu_cache[0][0].shape[2:]) == (1, LATENT_DIM)  # the whole latent
        assert worker.model.model.layers[0].self_attn.kv_b_proj.W_UK_T.shape == (2, 16, 32)
        moe = next(m for m in worker.model.modules() if isinstance(m, FusedMoE))
        assert moe.w2_weight.shape == (8, 64, 16)
        outs = _greedy(llm, built.prompts, logprobs=3)
    finally:
        executor.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == built.reference
    _assert_logprobs_match(outs, built)


def _distinct_pools(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    return list({t.data_ptr(): t for pair in pairs for t in pair}.values())


def test_kv_pool_holds_the_latent_once(build) -> None:
    """Per layer one pool tensor, its key tensor also its value tensor (device and swap pools): a token costs
    num_layers × (kv_lora_rank + qk_rope_head_dim) × 4 bytes, and a fixed budget holds 4.8× the blocks of the
    expanded layout (K and padded V of every head: 2 × 4 × 24 per layer); sleep's release and reallocation keep it."""
    built = build("deepseek-v2-lite")
    budget, block_size, layers = 1 << 20, 4, 3
    llm = LLM(model=str(built.path), kv_cache_memory_bytes=budget, block_size=block_size, **ENGINE_KW)
    worker = llm.llm_engine.executor.driver_worker
    block_bytes = block_size * layers * LATENT_DIM * 4
    assert worker.cache_block_size_bytes() == block_bytes
    blocks = llm.stats()["kv_blocks_total"]
    assert blocks == budget // block_bytes
    expanded = CacheEngine.get_cache_block_size(layers, 4, QK_HEAD_DIM, block_size, torch.float32)
    assert expanded == block_bytes * 4.8 and blocks >= 4 * (budget // expanded)
    ce = worker.cache_engine
    for pools, num in ((ce.gpu_cache, blocks), (ce.cpu_cache, ce.num_blocks[1])):
        assert all(k is v for k, v in pools)
        distinct = _distinct_pools(pools)
        assert len(distinct) == layers
        assert sum(t.numel() * t.element_size() for t in distinct) == num * block_bytes
    assert ce.release() == (blocks + ce.num_blocks[1]) * block_bytes
    ce.reallocate()
    assert all(k is v for k, v in ce.gpu_cache + ce.cpu_cache)


_REAL_MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
REAL_SHAPES = {  # (config class, layers, heads) of the released models
    "DeepSeek-V2-Lite": ("DeepseekV2Config", 27, 16),
    "DeepSeek-V3": ("DeepseekV3Config", 61, 128),
}


@pytest.mark.parametrize("name", list(REAL_SHAPES))
def test_bytes_per_token_at_real_shapes(name: str) -> None:
    """kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per token and layer (bfloat16: 1152 bytes), on every
    tensor-parallel rank, against 2 × heads × 192 for the expanded K / V (10.7× on V2-Lite, 85.3× on V3)."""
    config_cls, layers, heads = REAL_SHAPES[name]
    config = getattr(transformers, config_cls)(num_hidden_layers=layers, num_attention_heads=heads,
                                               num_key_value_heads=heads, **_REAL_MLA)
    for tp in (1, 8):
        assert kv_geometry(config, tp) == (layers, 1, 576)
    per_token = CacheEngine.get_cache_block_size(*kv_geometry(config, 1), 1, torch.bfloat16, use_mla=True)
    assert per_token == layers * 576 * 2
    expanded = CacheEngine.get_cache_block_size(layers, heads, 192, 1, torch.bfloat16)
    assert expanded / per_token == pytest.approx(2 * heads * 192 / 576)


def test_fp8_kv_cache_is_refused(build) -> None:
    with pytest.raises(ValueError, match="not supported with MLA"):
        LLM(model=str(build("deepseek-v2").path), num_gpu_blocks_override=8, kv_cache_dtype="fp8", **ENGINE_KW)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_swap_preemption_and_copy_on_write_match_hf(build, kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small pool preempting by swapping (latent blocks out to the CPU pool and back), then n=2 on a 17-token
    prompt (its blocks shared, the partly filled last one copied on write; top_k=1: greedy rejects n > 1), on the
    native C kernel and on the torch fallback: transformers' tokens."""
    from pagedllm.kernels import cpu_kernels

    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, kernels)
    cpu_kernels.load_cpu_kernels.cache_clear()  # (cached per process: read the variable now, and after the test)
    try:
        _swap_and_fork(build("deepseek-v3"), "cpu-native" if kernels == "native" else "torch")
    finally:
        monkeypatch.undo()
        cpu_kernels.load_cpu_kernels.cache_clear()


def _swap_and_fork(built: Built, backend: str) -> None:
    llm = LLM(model=str(built.path), num_gpu_blocks_override=SMALL_POOL, block_size=4, preemption_mode="swap",
              **ENGINE_KW)
    assert llm.llm_engine.executor.driver_worker.model_runner.attn_backend.name == backend
    outs = _greedy(llm, built.prompts, logprobs=3)
    assert [list(o.outputs[0].token_ids) for o in outs] == built.reference
    _assert_logprobs_match(outs, built)
    pair = SamplingParams(n=2, temperature=1.0, top_k=1, seed=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    forked = llm.generate([{"prompt_token_ids": built.prompts[5]}], pair, use_tqdm=False)[0]
    assert [list(c.token_ids) for c in forked.outputs] == [built.reference[5]] * 2
    stats = llm.stats()
    assert stats["num_swap_preemptions"] > 0 and stats["num_swap_ins"] > 0, stats
    assert stats["num_cow_copies"] > 0, stats


def test_prefix_caching_matches_hf(build) -> None:
    """Prompts sharing a 20-token prefix, the first run alone: the later ones attend over its cached latent
    blocks and still give transformers' tokens."""
    built = build("deepseek-v2")
    shared = built.prompts[-1][:20]
    prompts = [shared + p[:3 + i] for i, p in enumerate(built.prompts[-4:])]
    hf = getattr(transformers, FAMILIES["deepseek-v2"].model_cls).from_pretrained(built.path).eval()
    reference, _ = hf_greedy_reference(hf, prompts)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=64, block_size=4, enable_prefix_caching=True,
              **ENGINE_KW)
    outs = _greedy(llm, prompts[:1]) + _greedy(llm, prompts[1:])
    assert [list(o.outputs[0].token_ids) for o in outs] == reference
    stats = llm.stats()
    assert stats["prefix_cache_hits"] >= 3 * (20 // 4), stats


@pytest.mark.parametrize("group", [16, 128])  # V2-Lite's heads; V3's (past the kernel's 16-row score vectors)
def test_cpu_kernel_reads_one_latent_pool_at_real_width(group: int) -> None:
    """The native C kernel at the real latent width (576) with one KV head, the pool passed as key and value
    cache: two decodes and a chunk with context (tile path) match the naive reference."""
    from pagedllm.kernels import cpu_kernels, reference

    kernels = cpu_kernels.load_cpu_kernels()
    if kernels is None:
        pytest.skip("no native CPU kernels here")
    gen = torch.Generator().manual_seed(group)
    cache = torch.randn(12, 16, 1, 576, generator=gen)
    tables, seq_lens, query_lens = [[3, 7], [0], [5, 1, 9, 2]], [20, 9, 60], [1, 1, 24]
    query = torch.randn(sum(query_lens), group, 576, generator=gen)
    bt = torch.tensor([t + [0] * (4 - len(t)) for t in tables], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2, 26], dtype=torch.int32)
    out = torch.empty_like(query)
    kernels.paged_attention(out, query, cache, cache, bt, torch.tensor(seq_lens, dtype=torch.int32), qsl, 0.05,
                            min_tile_query_len=16)
    want = reference.paged_attention_naive(query, cache, cache, tables, seq_lens, query_lens, 0.05)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head_dim, group, dtype", [
    (LATENT_DIM, 4, torch.float32), (576, 16, torch.float32),  # the tests' latent; V2-Lite's
    pytest.param(576, 16, torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="bf16 tiles: on CUDA (a served model's)"))])
def test_triton_kernels_read_one_latent_pool_as_keys_and_values(head_dim: int, group: int, dtype) -> None:
    """The CUDA path's kernels (compiled there; Triton's interpreter here) over MLA's cache: one KV head of the
    latent's width for `group` query heads, one tensor passed as key and value cache. The cache write (each row
    written as key and as value: the same bytes) equals the reference's, and the split-KV decode, prefill and
    unified kernels match the torch reference."""
    pytest.importorskip("triton")
    from test_triton_kernels import DEVICE, _make_batch, _ragged_step, _reference, _rel_err

    from pagedllm.kernels import reference, triton_attention, triton_cache_ops
    from pagedllm.kernels.triton_unified_attention import unified_attention

    rng = random.Random(head_dim + group)
    seq_lens, query_lens = _ragged_step(rng, 16, last_chunk=(1, 20))
    query, cache, _, meta = _make_batch(rng, dtype, 16, head_dim, 1, group, seq_lens, query_lens)
    rows = torch.randn(5, 1, head_dim, device=DEVICE, dtype=dtype)
    slots = torch.tensor([3, 17, -1, 40, 41], dtype=torch.int64, device=DEVICE)
    want = cache.clone()
    reference.reshape_and_cache(rows, rows, want, want, slots)
    triton_cache_ops.reshape_and_cache(rows, rows, cache, cache, slots)
    assert torch.equal(cache, want)
    ref = _reference(query, cache, cache, meta, head_dim**-0.5)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    out = triton_attention.paged_attention(query, cache, cache, meta, head_dim**-0.5, out=torch.empty_like(query))
    assert _rel_err(out, ref) < tol
    out = unified_attention(query, cache, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                            head_dim**-0.5, torch.empty_like(query))
    assert _rel_err(out, ref) < tol


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_cuda_greedy_parity(name: str, build) -> None:
    """The GPU's kernels (Triton attention over the latent: one KV head of 40 for 4 query heads, fused RoPE and
    norms, the Triton grouped-GEMM experts, CUDA graphs) in float32: transformers' greedy tokens, its log-probs to
    float32-on-GPU noise; the pool one tensor per layer."""
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=64, **{**ENGINE_KW, "device": "cuda"})
    assert all(k is v for k, v in llm.llm_engine.executor.driver_worker.cache_engine.gpu_cache)
    outs = _greedy(llm, built.prompts, logprobs=3)
    assert [list(o.outputs[0].token_ids) for o in outs] == built.reference, name
    _assert_logprobs_match(outs, built, atol=2e-3)


def _mla_decode_case(seed: int, dtype, latent: int, rope: int, heads: int, seq_lens: list[int], block_size: int = 4):
    """A decode batch over one latent pool (shuffled block tables) → (query, pool, meta, the torch reference)."""
    from test_triton_kernels import _make_batch, _reference

    query, pool, _, meta = _make_batch(random.Random(seed), dtype, block_size, latent + rope, 1, heads, seq_lens,
                                       [1] * len(seq_lens))
    return query, pool, meta, _reference(query, pool, pool, meta, (latent + rope) ** -0.5)


_MLA_DECODE_CASES = [  # (latent, rope, query heads, context lengths, forced split count: None = the default)
    (32, 8, 4, [1, 7, 40, 23], 3),  # the tests' latent, several splits (more than some contexts' tiles)
    (32, 8, 4, [5, 33, 12], 1),
    (32, 8, 20, [17, 9], 2),  # two head blocks, the second partial (20 = 16 + 4)
    (512, 64, 16, [21], 2),  # DeepSeek-V2/V3's row: 512 + 64
]


@pytest.mark.parametrize("latent, rope, heads, seq_lens, splits", _MLA_DECODE_CASES)
@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16: on CUDA"))])
def test_mla_decode_kernel_matches_reference(latent: int, rope: int, heads: int, seq_lens: list[int],
                                             splits: int | None, dtype) -> None:
    """The MLA decode kernel (two dots per key tile, the values the keys' c_kv part, BLOCK_H heads per program,
    split-KV merged by a second kernel) equals the torch reference over the latent pool in each head's first
    `latent` output values, whatever the split count, and writes none of the last `rope`."""
    pytest.importorskip("triton")
    from test_triton_kernels import _rel_err

    from pagedllm.kernels import triton_attention
    from pagedllm.kernels.triton_mla_decode import mla_decode_attention

    query, pool, meta, ref = _mla_decode_case(latent + heads, dtype, latent, rope, heads, seq_lens)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    ws = triton_attention.DecodeWorkspace.allocate(query.device)
    for n, preload in ((splits, False), (None, None)):  # the block-table row loaded per tile, then preloaded
        out = torch.full_like(query, 7.0)
        mla_decode_attention(query, pool, meta.block_tables, meta.seq_lens, (latent + rope) ** -0.5, max(seq_lens),
                             latent, out=out, num_splits=n, workspace=ws, preload_table=preload)
        assert _rel_err(out[..., :latent], ref[..., :latent]) < tol
        assert bool((out[..., latent:] == 7.0).all())
    # Through paged_attention (the Triton backend's call): the decodes take the MLA kernel.
    out = triton_attention.paged_attention(query, pool, pool, meta, (latent + rope) ** -0.5, workspace=ws,
                                           latent_dim=latent)
    assert _rel_err(out[..., :latent], ref[..., :latent]) < tol


def test_mla_decode_refuses_what_it_lacks() -> None:
    """FP8 pools, sliding windows, soft caps, separate K/V caches and a latent_dim outside the row: ValueErrors."""
    pytest.importorskip("triton")
    from pagedllm.kernels import triton_attention
    from pagedllm.kernels.triton_mla_decode import mla_decode_attention
    from pagedllm.model.layers.attention import Attention

    query, pool, meta, _ = _mla_decode_case(0, torch.float32, 32, 8, 4, [5, 9])
    with pytest.raises(ValueError, match="FP8"):
        mla_decode_attention(query, pool.to(torch.float8_e4m3fn), meta.block_tables, meta.seq_lens, 0.1, 9, 32)
    with pytest.raises(ValueError, match="latent_dim"):
        mla_decode_attention(query, pool, meta.block_tables, meta.seq_lens, 0.1, 9, 40)
    with pytest.raises(ValueError, match="sliding window"):
        triton_attention.paged_attention(query, pool, pool, meta, 0.1, latent_dim=32, sliding_window=4)
    with pytest.raises(ValueError, match="one tensor"):
        triton_attention.paged_attention(query, pool, pool.clone(), meta, 0.1, latent_dim=32)
    with pytest.raises(ValueError, match="one KV head"):
        Attention(4, 40, 2, latent_dim=32)


def test_mla_layers_hand_latent_dim_to_the_backend() -> None:
    """DeepSeek's attention layers carry kv_lora_rank as latent_dim (what the Triton backend's decode reads), and the
    warm start compiles the MLA decode for it (attention_variants)."""
    from pagedllm.kernels.triton_warmup import attention_variants
    from pagedllm.model.layers.attention import Attention

    model = _construct(_config("deepseek-v2-lite"))
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert layers and all(m.latent_dim == _MLA["kv_lora_rank"] for m in layers)
    assert attention_variants(model) == [(None, None, _MLA["kv_lora_rank"])]


def test_warm_up_compiles_the_mla_decode() -> None:
    """An MLA model's warm start runs the MLA decode (one split and several) instead of the generic decode variants
    (every decode of an MLA layer takes it, piecewise replays too), and its mixed steps through the backend with
    latent_dim (the MLA decode then prefill chunks)."""
    pytest.importorskip("triton")
    from triton_setup import DEVICE

    from pagedllm.kernels.triton_warmup import (
        MLA_WARMUP_SPLITS,
        WARMUP_NUM_DECODES,
        warm_up_attention,
    )
    from pagedllm.model.layers.attention import TritonAttentionBackend

    rows, heads, latent, rope = 16, 4, 32, 8
    qkv = torch.zeros(rows, (heads + 2) * (latent + rope), device=DEVICE)
    q, k, v = (t.view(rows, -1, latent + rope) for t in qkv.split([heads * (latent + rope)] + [latent + rope] * 2, -1))
    pool = torch.zeros(4, 8, 1, latent + rope, device=DEVICE)
    done = warm_up_attention(TritonAttentionBackend(), (pool, pool), q, k, v, torch.zeros_like(q), 2, 0.125,
                             variants=[(None, None, latent)])
    assert len(done) == len(MLA_WARMUP_SPLITS) + len(WARMUP_NUM_DECODES)
    assert sum(d.startswith("mla decode") for d in done) == len(MLA_WARMUP_SPLITS)


def test_piecewise_capture_hands_latent_dim_to_the_replayed_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """A piecewise-graph capture records an MLA layer's latent_dim with its attention call (the recorder takes it),
    so the replay's decodes take the MLA decode kernel, not the generic one."""
    from types import SimpleNamespace

    from pagedllm.worker import piecewise_graph
    from pagedllm.worker.piecewise_graph import _SplitRecorder

    monkeypatch.setattr(piecewise_graph, "non_owning_view", lambda t: t)  # a CUDA array view; CPU tensors here

    pool = torch.zeros(4, 8, 1, 40)
    cache = (pool, pool)
    runner = SimpleNamespace(kv_caches=[cache], static_out=torch.zeros(3, 4 * 40))
    recorder = _SplitRecorder(runner, 3, capturing=False)
    assert recorder.takes_latent_dim
    q = torch.zeros(3, 4, 40)
    recorder.forward(q, q[:, :1], q[:, :1], cache, SimpleNamespace(kv_cache_group=0), 0.1, latent_dim=32)
    recorder.forward(q, q[:, :1], q[:, :1], cache, SimpleNamespace(kv_cache_group=0), 0.1)
    assert [site.latent_dim for site in recorder.sites] == [32, None]
