"""OLMoE, Cohere (Command-R), GPTBigCode (StarCoder 1 / SantaCoder), GPT-J, GLM / GLM-4 and Falcon, loaded from
directories transformers wrote, must generate what transformers generates (greedy, float32, eager attention), as the
families of test_models_hf.py.

The tiny configs make every knob bite: OLMoE's q/k/v clipping and top-k renormalisation, Cohere's logit scale, per-head
q/k LayerNorms and biases, GPTBigCode's multi-query and per-head fused c_attn, GPT-J's interleaved RoPE on 8 of 16
dims, GLM's interleaved partial RoPE and GLM-4's sandwich norms, Falcon's three layouts (new decoder architecture with
GQA and two or one LayerNorms, 7B's multi-query parallel block, sequential blocks).
test_knobs_change_transformers_outputs checks that each knob moves transformers' own log-probs, so parity is not by
accident. Where the native CPU kernels load, the families the CPU direct forward describes run on it, and on the module
path (the one CUDA runs) in test_module_path_parity; the MoE and GPT-2-style families run the module path throughout.
LoRA adapters go through each family's checkpoint mapping: test_lora_adapter_matches_peft.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import transformers
from test_models_hf import (
    ENGINE_KW,
    PROMPT_LENS,
    SMALL_POOL,
    Built,
    Family,
    _assert_logprobs_match,
    _greedy,
    _model,
    _random_model,
    build_from_model,
    greedy_on_cpu_path,
)
from test_models_hf_layernorm_families import _check_parity, _hf_logprobs

from pagedllm import LLM, LoRARequest
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.cpu_kernels import load_cpu_kernels
from pagedllm.model.cpu_direct_forward import DIRECT_FORWARD_ENV, direct_forward_enabled
from pagedllm.model.layers.linear import restore_dense_weights
from pagedllm.model.models.registry import get_model_class

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=128, attn_implementation="eager", bos_token_id=0, eos_token_id=2,
              pad_token_id=0)
_GQA = {**_SHAPE, "num_key_value_heads": 2}
_GPT2_LIKE = dict(n_embd=64, n_layer=3, n_head=4, n_positions=128, attn_implementation="eager", bos_token_id=0,
                  eos_token_id=2)
_OLMOE = {**_GQA, "intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
_FALCON = {**_SHAPE, "num_kv_heads": None, "num_attention_heads": 4}

FAMILIES: dict[str, Family] = {
    # Top-2 of 4 experts, not renormalized; whole-projection q/k RMSNorms; GQA.
    "olmoe": Family("OlmoeConfig", "OlmoeForCausalLM", {**_OLMOE, "norm_topk_prob": False}, "OlmoeForCausalLM"),
    # q, k and v clamped to ±0.3 (|q| reaches ~1 here), top-k renormalized, biases on q/k/v/o.
    "olmoe-clip": Family("OlmoeConfig", "OlmoeForCausalLM", {
        **_OLMOE, "norm_topk_prob": True, "clip_qkv": 0.3, "attention_bias": True}, "OlmoeForCausalLM"),
    # Parallel block under one bias-free LayerNorm, interleaved RoPE, logits × 0.5, tied head.
    "cohere": Family("CohereConfig", "CohereForCausalLM", {**_GQA, "logit_scale": 0.5}, "CohereForCausalLM"),
    # Per-head q/k LayerNorms, biases on q/k/v/o, untied head, logits × 2.
    "cohere-qk-norm": Family("CohereConfig", "CohereForCausalLM", {
        **_GQA, "logit_scale": 2.0, "use_qk_norm": True, "attention_bias": True, "tie_word_embeddings": False},
        "CohereForCausalLM"),
    # Multi-query: one K/V head for 4 query heads, learned positions, tied head.
    "gpt-bigcode": Family("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {**_GPT2_LIKE, "multi_query": True},
                          "GPTBigCodeForCausalLM"),
    # One K/V head per query head: c_attn's rows per head [q, k, v].
    "gpt-bigcode-mha": Family("GPTBigCodeConfig", "GPTBigCodeForCausalLM", {**_GPT2_LIKE, "multi_query": False},
                              "GPTBigCodeForCausalLM"),
    # Interleaved RoPE on 8 of 16 dims, one LayerNorm for attention and MLP, LM head bias.
    "gpt-j": Family("GPTJConfig", "GPTJForCausalLM", {**_GPT2_LIKE, "rotary_dim": 8}, "GPTJForCausalLM"),
    # Interleaved RoPE on half of each head, q/k/v biases, GQA.
    "glm": Family("GlmConfig", "GlmForCausalLM", {**_GQA, "head_dim": 16}, "GlmForCausalLM"),
    # GLM-4's four norms per layer, partial RoPE on a quarter of each head, a head_dim wider than hidden / heads.
    "glm4": Family("Glm4Config", "Glm4ForCausalLM", {**_GQA, "head_dim": 32, "partial_rotary_factor": 0.25},
                   "Glm4ForCausalLM"),
    # Falcon-40B's layout: GQA groups in the fused query_key_value, ln_attn and ln_mlp, no biases.
    "falcon-new": Family("FalconConfig", "FalconForCausalLM", {
        **_FALCON, "new_decoder_architecture": True, "num_kv_heads": 2, "bias": False}, "FalconForCausalLM"),
    # Falcon-7B's layout: multi-query, one LayerNorm feeding attention and MLP in parallel; biases.
    "falcon-7b": Family("FalconConfig", "FalconForCausalLM", {
        **_FALCON, "new_decoder_architecture": False, "multi_query": True, "parallel_attn": True, "bias": True},
        "FalconForCausalLM"),
    # Sequential blocks, one K/V head per query head (per-head [q, k, v] rows), biases.
    "falcon-sequential": Family("FalconConfig", "FalconForCausalLM", {
        **_FALCON, "new_decoder_architecture": False, "multi_query": False, "parallel_attn": False, "bias": True},
        "FalconForCausalLM"),
}
# Families the CPU direct forward does not describe (MoE blocks, GPT-2's learned positions): the module path runs them.
MODULE_PATH_ONLY = {"olmoe", "olmoe-clip", "gpt-bigcode", "gpt-bigcode-mha"}


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            cache[name] = build_from_model(_random_model(FAMILIES[name]), path, PROMPT_LENS)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_parity_with_preemption(name: str, build) -> None:
    family = FAMILIES[name]
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=SMALL_POOL, block_size=4, **ENGINE_KW)
    assert type(_model(llm)).__name__ == family.ours
    direct = name not in MODULE_PATH_ONLY and load_cpu_kernels() is not None and direct_forward_enabled()
    _check_parity(name, built, greedy_on_cpu_path(llm, built.prompts, direct))
    stats = llm.stats()
    assert stats["num_preemptions"] > 0, "the small pool should have forced preemption"
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == SMALL_POOL


@pytest.mark.parametrize("name", [n for n in FAMILIES if n not in MODULE_PATH_ONLY])
def test_module_path_parity(name: str, build, monkeypatch) -> None:
    """The module path (the one CUDA runs) of the families the parity test above ran on the CPU direct forward."""
    monkeypatch.setenv(DIRECT_FORWARD_ENV, "0")
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=SMALL_POOL, block_size=4, **ENGINE_KW)
    _check_parity(name, built, greedy_on_cpu_path(llm, built.prompts, direct=False))


@pytest.mark.parametrize("name,targets", [
    ("gpt-j", ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"]),
    ("glm4", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]),
    ("falcon-new", ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]),
    ("gpt-bigcode", ["c_attn", "c_proj", "c_fc"]),
])
def test_lora_adapter_matches_peft(name: str, targets: list[str], build, tmp_path) -> None:
    """A PEFT adapter on every module the family serves: its q/k B rows reordered as the weights' (interleaved RoPE);
    GLM-4's gate_up_proj, Falcon's grouped query_key_value and GPTBigCode's multi-query c_attn B split as theirs.
    Tokens with the adapter equal transformers + peft's, a request without it in the same batch the base model's."""
    pytest.importorskip("peft")
    from test_lora_more_families import ENGINE, _generate, _make_adapter, _reference

    built = build(name)
    hf = _random_model(FAMILIES[name])
    peft_model = _make_adapter(hf, tmp_path / "adapter", seed=11, targets=targets)
    prompts = built.prompts[2:5]
    want = [_reference(peft_model, p) for p in prompts]
    llm = LLM(str(built.path), **ENGINE)
    lora = LoRARequest(f"{name}-adapter", 1, str(tmp_path / "adapter"))
    outs = _generate(llm, prompts + prompts, [lora] * len(prompts) + [None] * len(prompts))
    assert [list(o.outputs[0].token_ids) for o in outs[:len(prompts)]] == want
    base = [list(o.outputs[0].token_ids) for o in outs[len(prompts):]]
    assert base == [ref[:len(base[0])] for ref in built.reference[2:5]] != want


@pytest.mark.parametrize("name,change", [
    ("olmoe-clip", dict(clip_qkv=None)),
    ("olmoe-clip", dict(norm_topk_prob=False)),
    ("cohere", dict(logit_scale=1.0)),
    ("cohere-qk-norm", dict(use_qk_norm=False)),
    ("gpt-j", dict(rotary_dim=16)),
    ("glm", dict(partial_rotary_factor=1.0)),
    ("glm4", dict(partial_rotary_factor=0.5)),
    ("falcon-new", dict(num_ln_in_parallel_attn=1)),
    ("falcon-7b", dict(parallel_attn=False)),
])
def test_knobs_change_transformers_outputs(name: str, change: dict, build) -> None:
    """Each knob the parity tests exercise moves transformers' own log-probs: an engine ignoring it would fail."""
    built = build(name)
    family = FAMILIES[name]
    same = _hf_logprobs(family, built)
    assert (same - built.logprobs[-1]).abs().max() < 1e-4  # the rebuilt model is the saved one
    assert (_hf_logprobs(family, built, **change) - built.logprobs[-1]).abs().max() > 1e-3, change


@pytest.mark.parametrize("name,kv_heads_per_rank", [("olmoe-clip", 1), ("cohere-qk-norm", 1), ("gpt-bigcode", 1),
                                                   ("gpt-j", 2), ("glm4", 1), ("falcon-new", 1)])
def test_tensor_parallel_tp2_matches_hf(name: str, kv_heads_per_rank: int, build) -> None:
    """tp=2 (real processes, gloo): each rank holds half the query heads (GPTBigCode's one K/V head replicated), its
    rows of the reordered q/k and of the split fused tensors, its heads' Cohere q/k norms and OLMoE's slices of the
    whole-projection norms, half of every expert."""
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=SMALL_POOL, block_size=4, tensor_parallel_size=2,
              distributed_executor_backend="mp", **ENGINE_KW)
    executor = llm.llm_engine.executor
    try:
        assert executor.driver.worker.cache_engine.gpu_cache[0][0].shape[2] == kv_heads_per_rank
        outs = _greedy(llm, built.prompts, logprobs=3)
    finally:
        executor.shutdown()
    _check_parity(name, built, outs)


def test_weights_loaded_exactly(build) -> None:
    """GPT-J's q and k rows reordered within the rotated dims of each head, v as stored; Falcon-40B's grouped
    query_key_value split; GLM-4's norms renamed onto the sandwich layer and its gate_up_proj kept whole."""
    gptj = build("gpt-j")
    m = _model(LLM(model=str(gptj.path), num_gpu_blocks_override=8, **ENGINE_KW))
    restore_dense_weights(m)
    order = [0, 2, 4, 6, 1, 3, 5, 7, *range(8, 16)]
    q, k, v = m.model.layers[1].self_attn.qkv_proj.weight.split(64)
    theirs = "transformer.h.1.attn.{}_proj.weight"
    for ours, proj in ((q, "q"), (k, "k")):
        want = gptj.state[theirs.format(proj)].view(4, 16, 64)[:, order].reshape(64, 64)
        torch.testing.assert_close(ours, want, rtol=0, atol=0)
    torch.testing.assert_close(v, gptj.state[theirs.format("v")], rtol=0, atol=0)
    torch.testing.assert_close(m.lm_head.bias, gptj.state["lm_head.bias"], rtol=0, atol=0)
    assert m.model.layers[0].self_attn.rotary_emb.rotary_dim == 8

    falcon = build("falcon-new")
    m = _model(LLM(model=str(falcon.path), num_gpu_blocks_override=8, **ENGINE_KW))
    restore_dense_weights(m)
    fused = falcon.state["transformer.h.2.self_attention.query_key_value.weight"].view(2, 4, 16, 64)
    want = torch.cat([fused[:, :2].reshape(64, 64), fused[:, 2].reshape(32, 64), fused[:, 3].reshape(32, 64)])
    torch.testing.assert_close(m.model.layers[2].self_attn.qkv_proj.weight, want, rtol=0, atol=0)
    assert m.lm_head.weight is m.model.embed_tokens.weight

    glm4 = build("glm4")
    m = _model(LLM(model=str(glm4.path), num_gpu_blocks_override=8, **ENGINE_KW))
    restore_dense_weights(m)
    layer, prefix = m.model.layers[0], "model.layers.0."
    for ours, theirs in [("post_attention_layernorm", "post_self_attn_layernorm"),
                         ("pre_feedforward_layernorm", "post_attention_layernorm"),
                         ("post_feedforward_layernorm", "post_mlp_layernorm")]:
        torch.testing.assert_close(getattr(layer, ours).weight, glm4.state[f"{prefix}{theirs}.weight"], rtol=0, atol=0)
    torch.testing.assert_close(layer.mlp.gate_up_proj.weight, glm4.state[f"{prefix}mlp.gate_up_proj.weight"],
                               rtol=0, atol=0)
    assert layer.self_attn.rotary_emb.rotary_dim == 8


def test_registry_by_architecture_and_model_type() -> None:
    for family in FAMILIES.values():
        config = getattr(transformers, family.config_cls)(**family.kwargs)
        assert get_model_class(config).__name__ == family.ours
        config.architectures = None  # by model_type alone
        assert get_model_class(config).__name__ == family.ours


@pytest.mark.parametrize("config_cls,kwargs,match", [
    ("FalconConfig", dict(alibi=True), "alibi=True"),
    ("FalconConfig", dict(new_decoder_architecture=True, parallel_attn=False), "parallel_attn=False"),
    ("GPTJConfig", dict(rotary_dim=7), "even rotary_dim"),
    ("CohereConfig", dict(hidden_act="gelu"), "hidden_act='silu' only"),
])
def test_unsupported_configs_are_refused(config_cls: str, kwargs: dict, match: str) -> None:
    """Config values these modules do not implement fail at construction with a ValueError naming the value."""
    base = {"FalconConfig": _FALCON, "GPTJConfig": _GPT2_LIKE}.get(config_cls, _GQA)
    config = getattr(transformers, config_cls)(**{**base, **kwargs})
    with pytest.raises(ValueError, match=match), torch.device("meta"):
        get_model_class(config)(config, TensorParallelGroup(), torch.float32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_cuda_greedy_parity(name: str, build) -> None:
    """The GPU's kernels (Triton attention, fused norms and rotate-half RoPE on the reordered q/k rows, fused MoE,
    CUDA graphs) in float32: transformers' greedy tokens, its log-probs to float32-on-GPU noise."""
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=64, **{**ENGINE_KW, "device": "cuda"})
    outs = _greedy(llm, built.prompts, logprobs=3)
    assert [list(o.outputs[0].token_ids) for o in outs] == built.reference, name
    _assert_logprobs_match(outs, built, atol=2e-3)
