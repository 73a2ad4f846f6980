"""GPT-NeoX (Pythia), Phi (phi-1.5 / phi-2), StableLM and StarCoder2, loaded from directories transformers wrote,
must generate what transformers generates (greedy, float32, eager attention), as the families of test_models_hf.py.

The tiny configs make every knob bite: RoPE on a quarter or half of each head, parallel and sequential residual
blocks (GPT-NeoX with two norms, Phi and StableLM with one), biases on (and off) the projections and Phi's LM head,
Phi's shared and StableLM's per-head q/k LayerNorms, GQA, and StarCoder2's window of 8 tokens under prompts of up to
30 (plus 16 generated). test_knobs_change_transformers_outputs checks that each knob moves transformers' own
log-probs, so parity is not by accident.

Where the native CPU kernels load, every family runs the CPU direct forward (model/cpu_direct_forward_layernorm.py):
the parity tests run on it, and test_direct_forward_matches_the_module_path checks it against the module path bit for
bit (dense float32 linears, and Q8_0 GGUF ones).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from test_models_hf import (
    ENGINE_KW,
    MAX_TOKENS,
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

from pagedllm import LLM
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.cpu_kernels import load_cpu_kernels
from pagedllm.model.cpu_direct_forward import direct_forward_enabled
from pagedllm.model.layers.linear import restore_dense_weights
from pagedllm.model.models.registry import get_model_class, layer_sliding_windows

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

WINDOW = 8
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=128, attn_implementation="eager", bos_token_id=0, eos_token_id=2)
_GQA = {**_SHAPE, "num_key_value_heads": 2}

FAMILIES: dict[str, Family] = {
    # Parallel residual with two LayerNorms, RoPE on 4 of 16 dims, interleaved fused query_key_value, untied head.
    "gpt-neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", {
        **_SHAPE, "rotary_pct": 0.25, "use_parallel_residual": True}, "GPTNeoXForCausalLM"),
    # Sequential residual, no attention biases, RoPE on 8 of 16 dims, gelu_new.
    "gpt-neox-sequential": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", {
        **_SHAPE, "rotary_pct": 0.5, "use_parallel_residual": False, "attention_bias": False,
        "hidden_act": "gelu_new"}, "GPTNeoXForCausalLM"),
    # One LayerNorm feeding attention and MLP, GQA, RoPE on 8 of 16 dims, biased dense and LM head.
    "phi": Family("PhiConfig", "PhiForCausalLM", {**_GQA, "partial_rotary_factor": 0.5}, "PhiForCausalLM"),
    # A LayerNorm (weight and bias) over each head's q and k, RoPE on 4 dims, head tied to the embedding.
    "phi-qk-layernorm": Family("PhiConfig", "PhiForCausalLM", {
        **_GQA, "partial_rotary_factor": 0.25, "qk_layernorm": True, "tie_word_embeddings": True},
        "PhiForCausalLM"),
    # Sequential blocks, q/k/v biases, GQA, RoPE on 4 dims, SwiGLU.
    "stablelm": Family("StableLmConfig", "StableLmForCausalLM", {
        **_GQA, "partial_rotary_factor": 0.25, "use_qkv_bias": True, "use_parallel_residual": False},
        "StableLmForCausalLM"),
    # Parallel blocks (one norm), one LayerNorm weight per q head and per KV head, tied head.
    "stablelm-parallel-qk-norm": Family("StableLmConfig", "StableLmForCausalLM", {
        **_GQA, "partial_rotary_factor": 0.5, "use_parallel_residual": True, "qk_layernorm": True,
        "tie_word_embeddings": True}, "StableLmForCausalLM"),
    # A window of 8 on every layer, biases everywhere, GQA, whole-head RoPE, tied head (the default).
    "starcoder2": Family("Starcoder2Config", "Starcoder2ForCausalLM", {
        **_GQA, "sliding_window": WINDOW, "use_bias": True, "norm_epsilon": 1e-4}, "Starcoder2ForCausalLM"),
    # No biases, no window, untied head.
    "starcoder2-no-bias": Family("Starcoder2Config", "Starcoder2ForCausalLM", {
        **_GQA, "sliding_window": None, "use_bias": False, "tie_word_embeddings": False},
        "Starcoder2ForCausalLM"),
}


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            path = tmp_path_factory.mktemp(name)
            cache[name] = build_from_model(_random_model(FAMILIES[name]), path, PROMPT_LENS)
        return cache[name]

    return get


def _check_parity(name: str, built: Built, outs: list) -> None:
    for prompt, ref, out in zip(built.prompts, built.reference, outs):
        assert list(out.outputs[0].token_ids) == ref, f"{name}: prompt of {len(prompt)} tokens diverged"
    _assert_logprobs_match(outs, built)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_parity_with_preemption(name: str, build) -> None:
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=SMALL_POOL, block_size=4, **ENGINE_KW)
    assert type(_model(llm)).__name__ == FAMILIES[name].ours
    # The CPU direct forward where the native kernels are loaded (and PAGEDLLM_CPU_DIRECT_FORWARD is not 0).
    direct = load_cpu_kernels() is not None and direct_forward_enabled()
    outs = greedy_on_cpu_path(llm, built.prompts, direct)
    _check_parity(name, built, outs)
    stats = llm.stats()
    if name != "starcoder2":  # its window frees blocks as sequences grow
        assert stats["num_preemptions"] > 0, "the small pool should have forced preemption"
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == SMALL_POOL


@pytest.mark.parametrize("name", ["gpt-neox", "starcoder2"])
def test_parity_with_swap_preemption_and_block_size_8(name: str, build) -> None:
    """Swapped-out and swapped-in sequences keep their K/V (StarCoder2's freed blocks behind the window too)."""
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=12, block_size=8, preemption_mode="swap", **ENGINE_KW)
    _check_parity(name, built, _greedy(llm, built.prompts, logprobs=3))
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_cpu_blocks_free"] == stats["num_cpu_blocks_total"]
    if name == "gpt-neox":
        assert stats["num_swap_preemptions"] > 0 and stats["num_swap_ins"] > 0


# name → (parallel residual, a second norm, the MLP's activation: None for StableLM's SwiGLU, q/k norms)
_LAYOUTS = {
    "gpt-neox": (True, True, "gelu", False),
    "gpt-neox-sequential": (False, True, "gelu_new", False),
    "phi": (True, False, "gelu_new", False),
    "phi-qk-layernorm": (True, False, "gelu_new", True),
    "stablelm": (False, True, None, False),
    "stablelm-parallel-qk-norm": (True, False, None, True),
    "starcoder2": (False, True, "gelu_pytorch_tanh", False),
    "starcoder2-no-bias": (False, True, "gelu_pytorch_tanh", False),
}


@pytest.mark.skipif(load_cpu_kernels() is None, reason="no C compiler: the CPU path runs torch")
@pytest.mark.parametrize("weights", ["float32", "q8_0"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_direct_forward_matches_the_module_path(name: str, weights: str, build) -> None:
    """Prefills, mixed steps and decodes of up to 4 sequences (StarCoder2's past its window): every step runs the
    direct forward, and its sampled tokens, their log-probs and the prompt log-probs equal the module path's exactly,
    with dense float32 linears and with Q8_0 GGUF ones (their biases added after the C GEMM)."""
    from test_cpu_direct_forward import (
        _assert_direct_equals_module_path,
        attach_q8_0_linears,
    )

    from pagedllm.model.cpu_direct_forward import DirectForward
    from pagedllm.model.cpu_direct_forward_layernorm import LayerNormDirectForward

    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=48, block_size=4, max_num_seqs=4, **ENGINE_KW)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    if weights == "q8_0":
        assert attach_q8_0_linears(runner.model) == 8
        runner.direct_forward = DirectForward.build(runner.model, runner.attn_backend)
        assert runner.direct_forward.gemm_method != "dense"
    direct = _assert_direct_equals_module_path(llm, [{"prompt_token_ids": p} for p in built.prompts])
    assert isinstance(direct, LayerNormDirectForward)
    parallel, two_norms, act, qk_norms = _LAYOUTS[name]
    assert direct.gated == (act is None)
    for lyr, mod in zip(direct.layers, runner.model.model.layers):
        assert (lyr.parallel, lyr.ln2 is not None, lyr.q_norm is not None) == (parallel, two_norms, qk_norms)
        assert lyr.act is (None if act is None else mod.mlp.act)
        assert lyr.window == (WINDOW if name == "starcoder2" else 0)
        assert lyr.rotary_dim == mod.self_attn.rotary_emb.rotary_dim


def test_direct_forward_left_to_the_module_path_where_it_does_not_apply(build, monkeypatch) -> None:
    """A layer whose forward is not LayerNormDecoderLayer's, and `direct_forward_supported = False`, keep the
    module path."""
    from pagedllm.model.cpu_direct_forward import DirectForward
    from pagedllm.model.layers.attention import NativeCpuAttentionBackend

    llm = LLM(model=str(build("phi").path), num_gpu_blocks_override=8, **ENGINE_KW)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    model, backend = runner.model, runner.attn_backend
    if not isinstance(backend, NativeCpuAttentionBackend):
        pytest.skip("no native CPU kernels")
    assert DirectForward.build(model, backend) is not None
    layer = model.model.layers[1]

    class OwnForward(type(layer)):  # a family's layer with a forward of its own
        def forward(self, *args):
            return super().forward(*args)

    monkeypatch.setattr(layer, "__class__", OwnForward)
    assert DirectForward.build(model, backend) is None
    monkeypatch.undo()
    monkeypatch.setattr(model, "direct_forward_supported", False, raising=False)
    assert DirectForward.build(model, backend) is None


def _hf_logprobs(family: Family, built: Built, **change) -> torch.Tensor:
    """transformers' log-probs over the last prompt's generated steps from `family` with `change`d config values
    (the same seed, so the same weights where the shapes agree)."""
    model = _random_model(Family(family.config_cls, family.model_cls, {**family.kwargs, **change}))
    ids = torch.tensor([built.prompts[-1] + built.reference[-1]])
    with torch.inference_mode():
        return torch.log_softmax(model(ids).logits[0, -MAX_TOKENS - 1:-1].float(), dim=-1)


@pytest.mark.parametrize("name,change", [
    ("gpt-neox", dict(use_parallel_residual=False)),
    ("gpt-neox", dict(rotary_pct=1.0)),
    ("gpt-neox-sequential", dict(use_parallel_residual=True)),
    ("phi", dict(partial_rotary_factor=1.0)),
    ("stablelm", dict(use_parallel_residual=True)),
    ("stablelm", dict(partial_rotary_factor=0.5)),
    ("starcoder2", dict(sliding_window=None)),
])
def test_knobs_change_transformers_outputs(name: str, change: dict, build) -> None:
    """Each knob the parity tests exercise moves transformers' own log-probs: an engine ignoring it would fail."""
    built = build(name)
    same = _hf_logprobs(FAMILIES[name], built)
    assert (same - built.logprobs[-1]).abs().max() < 1e-4  # the rebuilt model is the saved one
    assert (_hf_logprobs(FAMILIES[name], built, **change) - built.logprobs[-1]).abs().max() > 1e-3, change


@pytest.mark.parametrize("name,kv_heads_per_rank", [("gpt-neox", 2), ("phi-qk-layernorm", 1),
                                                   ("stablelm-parallel-qk-norm", 1)])
def test_tensor_parallel_tp2_matches_hf(name: str, kv_heads_per_rank: int, build) -> None:
    """tp=2 (real processes, gloo): each rank holds half the heads, its rows of GPT-NeoX's interleaved q/k/v, its own
    heads' StableLM norms, its vocabulary slice of Phi's LM head bias."""
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
    """GPT-NeoX's per-head [q, k, v] rows de-interleaved; StableLM's per-head norms stacked; Phi's head bias; the
    tied and untied heads; StarCoder2's window on every layer."""
    neox = build("gpt-neox")
    m = _model(LLM(model=str(neox.path), num_gpu_blocks_override=8, **ENGINE_KW))
    restore_dense_weights(m)
    fused = neox.state["gpt_neox.layers.1.attention.query_key_value.weight"].view(4, 3, 16, 64)
    want = torch.cat([fused[:, i].reshape(64, 64) for i in range(3)])
    torch.testing.assert_close(m.model.layers[1].self_attn.qkv_proj.weight, want, rtol=0, atol=0)
    torch.testing.assert_close(m.lm_head.weight, neox.state["lm_head.weight"], rtol=0, atol=0)
    assert m.lm_head.weight is not m.model.embed_tokens.weight
    assert m.model.layers[0].self_attn.rotary_emb.rotary_dim == 4

    stablelm = build("stablelm-parallel-qk-norm")
    m = _model(LLM(model=str(stablelm.path), num_gpu_blocks_override=8, **ENGINE_KW))
    attn = m.model.layers[1].self_attn
    for ours, theirs, heads in [(attn.q_norm, "q_layernorm", 4), (attn.k_norm, "k_layernorm", 2)]:
        want = torch.stack([stablelm.state[f"model.layers.1.self_attn.{theirs}.norms.{h}.weight"]
                            for h in range(heads)])
        torch.testing.assert_close(ours.weight, want, rtol=0, atol=0)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert m.model.layers[0].post_attention_layernorm is None

    phi = build("phi")
    m = _model(LLM(model=str(phi.path), num_gpu_blocks_override=8, **ENGINE_KW))
    torch.testing.assert_close(m.lm_head.bias, phi.state["lm_head.bias"], rtol=0, atol=0)

    starcoder2 = build("starcoder2")
    m = _model(LLM(model=str(starcoder2.path), num_gpu_blocks_override=16, **ENGINE_KW))
    assert [layer.self_attn.attn.sliding_window for layer in m.model.layers] == [WINDOW, WINDOW]
    assert layer_sliding_windows(m.config) == [WINDOW, WINDOW]
    assert m.model.layers[0].self_attn.rotary_emb.rotary_dim == 16


def test_old_pythia_checkpoint_names(build, tmp_path: Path) -> None:
    """EleutherAI's Pythia checkpoints: the head as `embed_out`, causal-mask buffers and RoPE inv_freq per layer,
    the config's `rotary_pct` / `rotary_emb_base` rather than `rope_parameters`."""
    from safetensors.torch import save_file

    built = build("gpt-neox")
    state = {k: v.contiguous() for k, v in built.state.items()}
    state["embed_out.weight"] = state.pop("lm_head.weight")
    for i in range(FAMILIES["gpt-neox"].kwargs["num_hidden_layers"]):
        state[f"gpt_neox.layers.{i}.attention.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
        state[f"gpt_neox.layers.{i}.attention.masked_bias"] = torch.tensor(-1e9)
        state[f"gpt_neox.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(2)
    path = tmp_path / "pythia"
    path.mkdir()
    config = json.loads((built.path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rotary_pct=rope["partial_rotary_factor"], rotary_emb_base=rope["rope_theta"])
    (path / "config.json").write_text(json.dumps(config))
    save_file(state, str(path / "model.safetensors"))
    llm = LLM(model=str(path), num_gpu_blocks_override=SMALL_POOL, block_size=4, **ENGINE_KW)
    assert [list(o.outputs[0].token_ids) for o in _greedy(llm, built.prompts)] == built.reference


def test_registry_by_architecture_and_model_type() -> None:
    for family in FAMILIES.values():
        config = getattr(transformers, family.config_cls)(**family.kwargs)
        assert get_model_class(config).__name__ == family.ours
        config.architectures = None  # by model_type alone
        assert get_model_class(config).__name__ == family.ours


@pytest.mark.parametrize("config_cls,kwargs,match", [
    ("GPTNeoXConfig", dict(hidden_act="quick_gelu"), "activation 'quick_gelu' is not supported"),
    ("StableLmConfig", dict(hidden_act="gelu"), "hidden_act='silu' only"),
    ("StableLmConfig", dict(partial_rotary_factor=0.2), "rotates 3 of head_dim 16"),  # int(16 · 0.2): odd
    ("Starcoder2Config", dict(hidden_act="relu6"), "activation 'relu6' is not supported"),
])
def test_unsupported_configs_are_refused(config_cls: str, kwargs: dict, match: str) -> None:
    """Config values these modules do not implement fail at construction with a ValueError naming the value."""
    config = getattr(transformers, config_cls)(**{**(_SHAPE if config_cls == "GPTNeoXConfig" else _GQA), **kwargs})
    with pytest.raises(ValueError, match=match), torch.device("meta"):
        get_model_class(config)(config, TensorParallelGroup(), torch.float32)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_cuda_greedy_parity(name: str, build) -> None:
    """The GPU's kernels (Triton attention, fused norms and partial RoPE, CUDA graphs) in float32: transformers'
    greedy tokens, its log-probs to float32-on-GPU noise."""
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=64, **{**ENGINE_KW, "device": "cuda"})
    outs = _greedy(llm, built.prompts, logprobs=3)
    assert [list(o.outputs[0].token_ids) for o in outs] == built.reference, name
    _assert_logprobs_match(outs, built, atol=2e-3)
