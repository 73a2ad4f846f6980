"""Granite, OLMo 2, OLMo 3 and SmolLM3 (Llama-derived families), loaded from directories transformers wrote, must
generate what transformers generates (greedy, float32), as the families of test_models_hf.py.

Every knob takes a value a wrong implementation would fail on: Granite's four multipliers far from 1 (and biases on
all four attention projections), OLMo's post-norms and whole-projection q/k norms with randomized weights, OLMo 3's
windows of 8 tokens under prompts of up to 30 (plus 16 generated) and its two RoPE settings, SmolLM3's NoPE layer and
window. test_knobs_change_transformers_outputs shows that turning a knob off changes transformers' own outputs.
The CPU direct forward (native kernels, no module dispatch) runs all four: Granite's multipliers, OLMo's post-norms and
whole-projection q/k norms, SmolLM3's NoPE layers. The parity test checks which path each family's steps take, and
test_direct_forward_matches_the_module_path compares the two paths' logits bit for bit.
"""
from __future__ import annotations

import threading
from typing import Callable

import pytest
import torch
import transformers
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

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache_groups import plan_kv_cache_groups
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.cpu_kernels import load_cpu_kernels
from pagedllm.model.cpu_direct_forward import direct_forward_enabled
from pagedllm.model.layers.norm import RMSNorm
from pagedllm.model.models.registry import get_model_class, layer_sliding_windows

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

WINDOW = 8
DIRECT_FORWARD_FAMILIES = ("granite", "olmo2", "olmo3", "smollm3")  # the CPU direct forward (dense MLPs) runs these
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, attn_implementation="eager")
_IN_VOCAB_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)  # SmolLM3's 128000s are past this vocab
# Granite 3's multipliers are 12 / 0.22 / 1/128 / 8; these stay as far from 1 (and from head_dim**-0.5 = 0.25)
# while keeping the random model's top-2 logit margins well above float32 noise.
_GRANITE_MULTIPLIERS = dict(embedding_multiplier=4.0, residual_multiplier=0.4, attention_multiplier=0.09,
                            logits_scaling=2.5)

FAMILIES: dict[str, Family] = {
    # The four multipliers; q/k/v/o and MLP biases; tied head (as Granite 3's checkpoints).
    "granite": Family("GraniteConfig", "GraniteForCausalLM", {
        **_SHAPE, **_GRANITE_MULTIPLIERS, "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
        "GraniteForCausalLM"),
    # Granite's multipliers over a routed MLP: 4 experts, top 2 (softmax over the top-k logits), fused in the checkpoint.
    "granitemoe": Family("GraniteMoeConfig", "GraniteMoeForCausalLM", {
        **_SHAPE, **_GRANITE_MULTIPLIERS, "intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2,
        "tie_word_embeddings": True}, "GraniteMoeForCausalLM"),
    # Post-norms, q/k norms over whole projections, biased q/k/v/o.
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", {**_SHAPE, "attention_bias": True}, "Olmo2ForCausalLM"),
    # OLMo 2's layers; local (window 8) / global / local, RoPE base 10 000 locally, 10⁶ linearly scaled ×2 globally.
    "olmo3": Family("Olmo3Config", "Olmo3ForCausalLM", {
        **_SHAPE, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}},
        "Olmo3ForCausalLM"),
    # Layer 1 without RoPE, and (use_sliding_window: transformers' default layer_types) windowed; biases; tied head.
    "smollm3": Family("SmolLM3Config", "SmolLM3ForCausalLM", {
        **_SHAPE, "no_rope_layers": [1, 0, 1], "use_sliding_window": True, "sliding_window": WINDOW,
        "attention_bias": True, "mlp_bias": True, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        **_IN_VOCAB_IDS}, "SmolLM3ForCausalLM"),
}


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            cache[name] = build_from_model(_random_model(FAMILIES[name]), tmp_path_factory.mktemp(name), PROMPT_LENS)
        return cache[name]

    return get


def _same_bytes(built: Built, blocks: int) -> int:
    """`blocks` one-table blocks' memory in blocks of the model's KV cache groups (as test_models_hf_gemma.py)."""
    windows = layer_sliding_windows(transformers.AutoConfig.from_pretrained(built.path))
    return blocks * len(windows) // plan_kv_cache_groups(windows).num_slots


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_parity_with_preemption(name: str, build) -> None:
    built = build(name)
    pool = _same_bytes(built, SMALL_POOL)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=pool, block_size=4, **ENGINE_KW)
    model = _model(llm)
    assert type(model).__name__ == FAMILIES[name].ours
    # Where the native kernels are loaded (and PAGEDLLM_CPU_DIRECT_FORWARD is not 0), the Llama family takes the
    # direct forward (every family here with dense MLPs: not Granite MoE's experts).
    direct = load_cpu_kernels() is not None and direct_forward_enabled() and name in DIRECT_FORWARD_FAMILIES
    outs = greedy_on_cpu_path(llm, built.prompts, direct)
    for prompt, ref, out in zip(built.prompts, built.reference, outs):
        assert list(out.outputs[0].token_ids) == ref, f"{name}: prompt of {len(prompt)} tokens diverged"
    _assert_logprobs_match(outs, built)
    stats = llm.stats()
    if name in ("granite", "granitemoe", "olmo2"):  # the windowed families free blocks as sequences grow
        assert stats["num_preemptions"] > 0, "the small pool should have forced preemption"
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == pool


@pytest.mark.skipif(load_cpu_kernels() is None, reason="no C compiler: the CPU path runs torch")
@pytest.mark.parametrize("name", DIRECT_FORWARD_FAMILIES)
def test_direct_forward_matches_the_module_path(name: str, build) -> None:
    """Prefills, mixed steps and decodes: every step of the family runs the direct forward, and its sampled tokens,
    their log-probs and the prompt log-probs equal the module path's exactly (OLMo: post-norms, whole q/k norms)."""
    from test_cpu_direct_forward import _assert_direct_equals_module_path

    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=_same_bytes(built, 48), block_size=4, max_num_seqs=4,
              **ENGINE_KW)
    direct = _assert_direct_equals_module_path(llm, [{"prompt_token_ids": p} for p in built.prompts])
    assert all((lyr.ln1 is None) == name.startswith("olmo") for lyr in direct.layers)
    assert all(lyr.qk_whole == name.startswith("olmo") for lyr in direct.layers)


def test_weights_loaded_exactly(build) -> None:
    """The families' own parameters: OLMo's whole-projection q/k norm weights, Granite's o_proj bias and tied head."""
    olmo = build("olmo2")
    attn = _model(LLM(model=str(olmo.path), num_gpu_blocks_override=4, **ENGINE_KW)).model.layers[1].self_attn
    for kind, width in (("q", 64), ("k", 32)):  # 4 heads · 16, 2 KV heads · 16
        want = olmo.state[f"model.layers.1.self_attn.{kind}_norm.weight"]
        assert want.shape == (width,) and (want - 1).abs().sum() > 0  # moved off 1 by _random_model
        torch.testing.assert_close(getattr(attn, f"{kind}_norm").weight, want, rtol=0, atol=0)
    granite = build("granite")
    model = _model(LLM(model=str(granite.path), num_gpu_blocks_override=4, **ENGINE_KW))
    want = granite.state["model.layers.0.self_attn.o_proj.bias"]
    assert want.abs().sum() > 0
    torch.testing.assert_close(model.model.layers[0].self_attn.o_proj.bias, want, rtol=0, atol=0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.attn.scale == _GRANITE_MULTIPLIERS["attention_multiplier"]


def test_structure_follows_the_config() -> None:
    """SmolLM3's NoPE layers (given, or transformers' default of every fourth), OLMo 3's windows and RoPE tables."""
    smol = transformers.SmolLM3Config(**{**FAMILIES["smollm3"].kwargs, "vocab_size": VOCAB})
    model = get_model_class(smol)(smol, TensorParallelGroup(), torch.float32)
    assert [layer.self_attn.rotary_emb is not None for layer in model.model.layers] == [True, False, True]
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [None, WINDOW, None]
    default = transformers.SmolLM3Config(**{**_SHAPE, **_IN_VOCAB_IDS, "vocab_size": VOCAB, "num_hidden_layers": 8})
    model = get_model_class(default)(default, TensorParallelGroup(), torch.float32)
    assert [layer.self_attn.rotary_emb is None for layer in model.model.layers] == [False, False, False, True] * 2
    from pagedllm.model.models.smollm3 import rope_layers

    default.no_rope_layers = None
    default.no_rope_layer_interval = 3
    assert rope_layers(default) == [True, True, False] * 2 + [True, True]

    olmo3 = transformers.Olmo3Config(**{**FAMILIES["olmo3"].kwargs, "vocab_size": VOCAB})
    model = get_model_class(olmo3)(olmo3, TensorParallelGroup(), torch.float32)
    layers = model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW, None, WINDOW]
    assert layers[0].self_attn.rotary_emb is layers[2].self_attn.rotary_emb
    assert not torch.equal(layers[0].self_attn.rotary_emb.cos_cache, layers[1].self_attn.rotary_emb.cos_cache)
    same = transformers.Olmo3Config(**{**_SHAPE, "vocab_size": VOCAB, "num_hidden_layers": 4})  # one RoPE setting
    layers = get_model_class(same)(same, TensorParallelGroup(), torch.float32).model.layers
    assert len({id(layer.self_attn.rotary_emb) for layer in layers}) == 1


def test_knobs_change_transformers_outputs(build) -> None:
    """With a knob at its neutral value transformers' own log-probs differ, so parity above is not by accident."""
    head_scale = (64 // 4) ** -0.5
    cases = [("granite", dict(embedding_multiplier=1.0)), ("granite", dict(residual_multiplier=1.0)),
             ("granite", dict(attention_multiplier=head_scale)), ("granite", dict(logits_scaling=1.0)),
             ("olmo3", dict(sliding_window=4096)), ("smollm3", dict(no_rope_layers=[1, 1, 1])),
             ("smollm3", dict(sliding_window=4096))]
    for name, off in cases:
        built = build(name)
        family = FAMILIES[name]
        config = transformers.AutoConfig.from_pretrained(built.path)
        for key, value in off.items():
            setattr(config, key, value)
        model = getattr(transformers, family.model_cls).from_pretrained(built.path, config=config).eval()
        ids = torch.tensor([built.prompts[-1] + built.reference[-1]])
        with torch.inference_mode():
            logits = torch.log_softmax(model(ids).logits[0, -MAX_TOKENS - 1:-1].float(), dim=-1)
        assert (logits - built.logprobs[-1]).abs().max() > 1e-3, (name, off)


def test_granite_prompt_embeds_are_scaled_as_transformers_inputs_embeds(build) -> None:
    """transformers' Granite multiplies `inputs_embeds` by embedding_multiplier inside the model; so must we."""
    built = build("granite")
    hf = transformers.GraniteForCausalLM.from_pretrained(built.path).eval()
    gen = torch.Generator().manual_seed(5)
    prompts = []
    with torch.inference_mode():
        for p in built.prompts[2:5]:
            rows = hf.get_input_embeddings()(torch.tensor(p))
            prompts.append(rows + 0.05 * torch.randn(rows.shape, generator=gen))
        ref = [hf.generate(inputs_embeds=e[None], attention_mask=torch.ones(1, len(e), dtype=torch.long),
                           do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=0)[0, -MAX_TOKENS:].tolist()
               for e in prompts]
    llm = LLM(model=str(built.path), enable_prompt_embeds=True, num_gpu_blocks_override=64, **ENGINE_KW)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_embeds": e} for e in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == ref


def test_registry_by_architecture_and_model_type() -> None:
    for cfg_cls, ours in [("GraniteConfig", "GraniteForCausalLM"), ("Olmo2Config", "Olmo2ForCausalLM"),
                          ("Olmo3Config", "Olmo3ForCausalLM"), ("SmolLM3Config", "SmolLM3ForCausalLM"),
                          ("GraniteMoeConfig", "GraniteMoeForCausalLM")]:
        config = getattr(transformers, cfg_cls)()  # no `architectures`: model_type decides
        assert get_model_class(config).__name__ == ours
        config.architectures = [ours]
        cls = get_model_class(config)
        assert cls.__name__ == ours
        assert getattr(cls, "direct_forward_supported", True)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_model_construction_draws_no_random_numbers(name: str) -> None:
    family = FAMILIES[name]
    config = getattr(transformers, family.config_cls)(vocab_size=VOCAB, **family.kwargs)
    state = torch.get_rng_state()
    model = get_model_class(config)(config, TensorParallelGroup(), torch.float32)
    assert torch.equal(torch.get_rng_state(), state)
    assert type(model).__name__ == family.ours


def test_granitemoe_checkpoint_experts_are_checked() -> None:
    """A Granite MoE checkpoint's fused expert tensors of a shape the config does not imply, or a block tensor it
    does not have, are clear errors (the parity test loads the right ones)."""
    family = FAMILIES["granitemoe"]
    config = getattr(transformers, family.config_cls)(vocab_size=VOCAB, **family.kwargs)
    model = get_model_class(config)(config, TensorParallelGroup(), torch.float32)
    block = "model.layers.0.block_sparse_moe."
    with pytest.raises(ValueError, match=r"input_linear.*\[experts, 96, 64\]"):
        list(model._per_expert([(block + "input_linear.weight", torch.zeros(4, 48, 64))]))
    with pytest.raises(ValueError, match="router.layer, input_linear and output_linear only"):
        list(model._per_expert([(block + "experts.0.w1.weight", torch.zeros(48, 64))]))


def test_unsupported_configs_are_clear_errors() -> None:
    def construct(cfg_cls: str, **overrides) -> None:
        config = getattr(transformers, cfg_cls)(**{**_SHAPE, **_IN_VOCAB_IDS, "vocab_size": VOCAB})
        for key, value in overrides.items():  # after __post_init__, which would derive or reject some
            setattr(config, key, value)
        get_model_class(config)(config, TensorParallelGroup(), torch.float32)

    with pytest.raises(ValueError, match="hidden_act='silu' only"):
        construct("GraniteConfig", hidden_act="gelu")
    with pytest.raises(ValueError, match="logits_scaling must be a finite non-zero"):
        construct("GraniteConfig", logits_scaling=0.0)
    with pytest.raises(ValueError, match="no_rope_layers must give 3 layers"):
        construct("SmolLM3Config", no_rope_layers=[1, 0])
    with pytest.raises(ValueError, match="no sliding_window"):
        construct("Olmo3Config", sliding_window=None)
    with pytest.raises(ValueError, match="layer_types must name 3 layers"):
        construct("Olmo3Config", layer_types=["full_attention"] * 2)


class _ThreadGroup:
    """A tensor-parallel group of threads (one per rank) whose all_reduce sums every rank's tensor."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size)
        self.parts: dict[int, torch.Tensor] = {}

    def rank(self, rank: int) -> "_ThreadRank":
        return _ThreadRank(self, rank)


class _ThreadRank:
    def __init__(self, group: _ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.group.parts[self.rank] = x.clone()
        self.group.barrier.wait()
        total = sum(self.group.parts[r] for r in range(self.size))
        self.group.barrier.wait()
        x.copy_(total)
        return x


@pytest.mark.parametrize("tp_size", [2, 4])  # 4 > 2 KV heads: each KV head replicated on two ranks
def test_olmo2_qk_norm_under_tensor_parallelism(tp_size: int) -> None:
    """Each rank normalises its own heads by the whole projection's mean square (one all-reduce of q's and k's sums
    of squares, KV replicas counted once per copy on both sides): its slice of the unsharded norm's output."""
    from pagedllm.model.models.olmo2 import Olmo2Attention

    config = transformers.Olmo2Config(**{**_SHAPE, "vocab_size": VOCAB})
    head_dim, tokens = 16, 5
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, 4 * head_dim, generator=gen) * 3
    k = torch.randn(tokens, 2 * head_dim, generator=gen) * 3
    weights = {kind: 1 + 0.1 * torch.randn(n, generator=gen) for kind, n in (("q", 64), ("k", 32))}
    full = {kind: RMSNorm(n, config.rms_norm_eps, torch.float32) for kind, n in (("q", 64), ("k", 32))}
    for kind, norm in full.items():
        norm.weight.data.copy_(weights[kind])
    want_q, want_k = full["q"].forward_native(q), full["k"].forward_native(k)

    group = _ThreadGroup(tp_size)
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            attn = Olmo2Attention(config, group.rank(rank), torch.float32, 0, None)
            for kind in "qk":
                norm = getattr(attn, f"{kind}_norm")
                norm.weight.weight_loader(norm.weight, weights[kind])
            heads = attn.qkv_proj.heads
            q_rows = slice(heads.q_start * head_dim, (heads.q_start + heads.num_q_heads) * head_dim)
            k_rows = slice(heads.kv_start * head_dim, (heads.kv_start + heads.num_kv_heads) * head_dim)
            results[rank] = (q_rows, k_rows, *attn.qk_norm(q[:, q_rows], k[:, k_rows]))
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for q_rows, k_rows, got_q, got_k in results.values():
        torch.testing.assert_close(got_q, want_q[:, q_rows], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_k, want_k[:, k_rows], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["olmo2", "granite", "granitemoe"])
def test_tensor_parallel_tp2_matches_hf(name: str, build) -> None:
    """End to end at tp=2 (real processes, gloo): each rank holds one KV head, and (OLMo 2) half of each q/k norm's
    weight, (Granite) its shards of the q/k/v biases, o_proj's bias added once after the reduction."""
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=_same_bytes(built, SMALL_POOL), block_size=4,
              tensor_parallel_size=2, distributed_executor_backend="mp", **ENGINE_KW)
    executor = llm.llm_engine.executor
    try:
        assert executor.driver.worker.cache_engine.gpu_cache[0][0].shape[2] == 1
        outs = _greedy(llm, built.prompts, logprobs=3)
    finally:
        executor.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == built.reference
    _assert_logprobs_match(outs, built)


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
