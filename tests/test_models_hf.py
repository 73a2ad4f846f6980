"""The paper's model families (Llama, OPT, GPT-2) plus Qwen2, Qwen3 and Mistral, loaded from Hugging Face
directories written by `transformers` itself, must generate exactly what `transformers` generates.

Each family is a tiny random-weight model built from its transformers config class and saved with
`save_pretrained(safe_serialization=True)`; the directory has no tokenizer, so the engine runs with
`skip_tokenizer_init=True` on token-id prompts. The KV pool is small enough to force preemption.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.model.layers.linear import restore_dense_weights
from pagedllm.model.models.registry import get_model_class, get_model_max_len, get_sliding_window
from pagedllm.worker.worker import kv_geometry

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
VOCAB = 1000
PROMPT_LENS = (1, 3, 5, 8, 12, 17, 23, 30)
MAX_TOKENS = 16
INIT_STD = 0.1
SMALL_POOL = 24  # blocks of 4 tokens: 96 slots for 8 sequences needing ~240 → preemption
ENGINE_KW: dict[str, Any] = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", swap_space=0.01)
_LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=128)


@dataclass(frozen=True)
class Family:
    config_cls: str
    model_cls: str
    kwargs: dict = field(default_factory=dict)
    ours: str = ""  # our class name the registry must pick


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM", _LLAMA_LIKE, "LlamaForCausalLM"),
    # attention_bias: q, k, v and o biased (as transformers' Llama; it once biased o alone and failed to load)
    "llama-biases": Family("LlamaConfig", "LlamaForCausalLM", {**_LLAMA_LIKE, "attention_bias": True, "mlp_bias": True},
                           "LlamaForCausalLM"),
    "opt": Family("OPTConfig", "OPTForCausalLM", dict(
        hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
    ), "OPTForCausalLM"),
    # OPT-350m's shape: post-LayerNorm blocks and project_in/project_out around a narrower embedding.
    "opt-350m-style": Family("OPTConfig", "OPTForCausalLM", dict(
        hidden_size=64, ffn_dim=128, num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=128,
        word_embed_proj_dim=32, do_layer_norm_before=False,
    ), "OPTForCausalLM"),
    "opt-no-bias-no-affine": Family("OPTConfig", "OPTForCausalLM", dict(
        hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
        enable_bias=False, layer_norm_elementwise_affine=False,
    ), "OPTForCausalLM"),
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=3, n_head=4, n_positions=128,
                                                             bos_token_id=0, eos_token_id=VOCAB - 1),
                   "GPT2LMHeadModel"),
    "gpt2-layer-scaled": Family("GPT2Config", "GPT2LMHeadModel", dict(
        n_embd=64, n_layer=3, n_head=4, n_positions=128, bos_token_id=0, eos_token_id=VOCAB - 1,
        scale_attn_by_inverse_layer_idx=True,
    ), "GPT2LMHeadModel"),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM", _LLAMA_LIKE, "Qwen2ForCausalLM"),
    # YaRN context extension (Qwen2.5 / Qwen3 long-context configs): sequences pass the original 32 positions.
    "qwen2-yarn": Family("Qwen2Config", "Qwen2ForCausalLM", {**_LLAMA_LIKE, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}, "Qwen2ForCausalLM"),
    # Per-head q/k RMSNorms, and a head_dim wider than hidden / heads (as Qwen3's 128 with 16 heads of 1024).
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM", {**_LLAMA_LIKE, "head_dim": 32}, "Qwen3ForCausalLM"),
    # A window wider than every sequence here: full attention is exact, so parity must hold.
    "mistral": Family("MistralConfig", "MistralForCausalLM",
                      {**_LLAMA_LIKE, "max_position_embeddings": 256, "sliding_window": 96}, "LlamaForCausalLM"),
    # Mixture of experts: every layer routes each token to 2 of 4 experts (top-k renormalized).
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", {**_LLAMA_LIKE, "num_local_experts": 4,
                                                              "num_experts_per_tok": 2}, "MixtralForCausalLM"),
    # Qwen3's attention, 8 experts of width 32, top-2 renormalized; layer 1 keeps a dense MLP (mlp_only_layers).
    "qwen3-moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        **_LLAMA_LIKE, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "mlp_only_layers": [1]}, "Qwen3MoeForCausalLM"),
    # Qwen2's biased q/k/v, top-2 of 4 experts without renormalizing, and a sigmoid-gated shared expert.
    "qwen2-moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        **_LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": False}, "Qwen2MoeForCausalLM"),
}


@dataclass
class Built:
    path: Path
    prompts: list[list[int]]
    reference: list[list[int]]  # transformers' greedy continuation of each prompt
    logprobs: list[torch.Tensor]  # transformers' log-softmax at each generated step, [MAX_TOKENS, VOCAB]
    state: dict[str, torch.Tensor]


def _random_model(family: Family) -> torch.nn.Module:
    """transformers' own init (wider than its 0.02 default, so top-2 logit margins are ≥ 4e-4 rather than
    ~1e-6 and small numeric mistakes show in the logprobs), then biases and norm weights moved off 0/1."""
    config_cls = getattr(transformers, family.config_cls)
    std_key = "init_std" if family.config_cls == "OPTConfig" else "initializer_range"
    config = config_cls(vocab_size=VOCAB, **{std_key: INIT_STD, **family.kwargs})
    torch.manual_seed(0)
    model = getattr(transformers, family.model_cls)(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def hf_greedy_reference(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int = MAX_TOKENS
                        ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers' greedy tokens and its log-softmax at each generated step, one prompt at a time (no padding)."""
    reference, logprobs = [], []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
            reference.append(out.sequences[0, len(p):].tolist())
            logprobs.append(torch.log_softmax(torch.cat(out.logits).float(), dim=-1))
    return reference, logprobs


def random_checkpoints(tmp_path_factory: pytest.TempPathFactory,
                       families: dict[str, Family]) -> Callable[[str], Path]:
    """name → a directory holding transformers' tiny random model of `families[name]` (safetensors, no tokenizer),
    written once per factory."""
    paths: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in paths:
            paths[name] = tmp_path_factory.mktemp(name)
            _random_model(families[name]).save_pretrained(paths[name], safe_serialization=True)
        return paths[name]

    return get


def build_from_model(model: torch.nn.Module, path: Path, prompt_lens: Sequence[int]) -> Built:
    """Save `model` to `path` and record transformers' greedy outputs on seeded random prompts of `prompt_lens`."""
    model.save_pretrained(path, safe_serialization=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in prompt_lens]
    model.generation_config.eos_token_id = None  # ignore_eos on our side: never stop early here either
    reference, logprobs = hf_greedy_reference(model, prompts)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return Built(path, prompts, reference, logprobs, state)


def _build(family: Family, path: Path) -> Built:
    return build_from_model(_random_model(family), path, PROMPT_LENS)


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Built]:
    cache: dict[str, Built] = {}

    def get(name: str) -> Built:
        if name not in cache:
            cache[name] = _build(FAMILIES[name], tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def _greedy(llm: LLM, prompts: list[list[int]], ignore_eos: bool = True, logprobs: int | None = None) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def greedy_on_cpu_path(llm: LLM, prompts: list[list[int]], direct: bool) -> list:
    """`_greedy` with 3 logprobs, checking the step path: every step took the CPU direct forward where `direct`, else
    the eager module path (the engine was built with it, or without it, accordingly)."""
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert (runner.direct_forward is not None) == direct
    stats = runner.enable_step_stats()
    try:
        outs = _greedy(llm, prompts, logprobs=3)
    finally:
        runner.step_stats = None
    assert {path for _, path, *_ in stats.records} == {"direct" if direct else "eager"}
    return outs


def _assert_logprobs_match(outs: list, built: Built, atol: float = 2e-5) -> None:
    """Every returned top-k logprob equals transformers' log-softmax at that step (float32 noise ≈ 1e-6)."""
    for out, ref in zip(outs, built.logprobs):
        steps = out.outputs[0].logprobs
        assert len(steps) == MAX_TOKENS
        for step, top in enumerate(steps):
            assert len(top) >= 3
            for token, logprob in top.items():
                assert abs(logprob.logprob - ref[step, token].item()) < atol, (step, token)


def _model(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.executor.driver_worker.model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_parity_with_preemption(name: str, build) -> None:
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=SMALL_POOL, block_size=4, **ENGINE_KW)
    assert type(_model(llm)).__name__ == FAMILIES[name].ours
    assert llm.get_tokenizer() is None
    outs = _greedy(llm, built.prompts, logprobs=3)
    got = [list(o.outputs[0].token_ids) for o in outs]
    for prompt, ref, tokens in zip(built.prompts, built.reference, got):
        assert tokens == ref, f"{name}: prompt of {len(prompt)} tokens diverged"
    _assert_logprobs_match(outs, built)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert all(o.prompt_token_ids == p for o, p in zip(outs, built.prompts))
    stats = llm.stats()
    assert stats["num_preemptions"] > 0, "the small pool should have forced preemption"
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == SMALL_POOL
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("name", ["opt-350m-style", "gpt2"])
def test_parity_with_swap_preemption_and_block_size_8(name: str, build) -> None:
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=12, block_size=8, preemption_mode="swap", **ENGINE_KW)
    outs = _greedy(llm, built.prompts, logprobs=3)
    assert [list(o.outputs[0].token_ids) for o in outs] == built.reference
    _assert_logprobs_match(outs, built)
    stats = llm.stats()
    assert stats["num_swap_preemptions"] > 0 and stats["num_swap_ins"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_cpu_blocks_free"] == stats["num_cpu_blocks_total"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen2-yarn", "qwen3", "mixtral", "qwen3-moe", "qwen2-moe"])
def test_cuda_greedy_parity(name: str, build) -> None:
    """The Llama-stack families on the GPU's kernels (Triton attention, fused norms and RoPE, CUDA graphs) in
    float32: transformers' greedy tokens, its log-probs to float32-on-GPU noise."""
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=64, **{**ENGINE_KW, "device": "cuda"})
    assert type(_model(llm)).__name__ == FAMILIES[name].ours
    outs = _greedy(llm, built.prompts, logprobs=3)
    assert [list(o.outputs[0].token_ids) for o in outs] == built.reference
    _assert_logprobs_match(outs, built, atol=2e-3)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_weights_leave_moe_routers_and_experts_in_bf16(build) -> None:
    """--quantization fp8 on an MoE model: attention projections in e4m3, routers and experts in bf16 (as vLLM); the
    engine runs its graphs and returns every token."""
    built = build("mixtral")
    llm = LLM(model=str(built.path), num_gpu_blocks_override=64, quantization="fp8",
              **{**ENGINE_KW, "device": "cuda", "dtype": "bfloat16"})
    layer = _model(llm).model.layers[0]
    assert layer.self_attn.qkv_proj.fp8_weight is not None
    assert layer.mlp.gate.fp8_weight is None and layer.mlp.gate.weight.dtype == torch.bfloat16
    assert layer.mlp.experts.w13_weight.dtype == torch.bfloat16
    outs = _greedy(llm, built.prompts)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)


@pytest.mark.parametrize("name,kv_heads_per_rank", [("opt-350m-style", 2), ("gpt2", 2), ("qwen3", 1),
                                                   ("qwen2-moe", 1), ("mixtral", 1)])
def test_tensor_parallel_tp2_matches_hf(name: str, kv_heads_per_rank: int, build) -> None:
    """The families use the TP layers: at tp=2 (real processes, gloo) each rank holds half the heads (Qwen3's
    per-head q/k norms run on each rank's own heads)."""
    built = build(name)
    llm = LLM(model=str(built.path), num_gpu_blocks_override=SMALL_POOL, block_size=4, tensor_parallel_size=2,
              distributed_executor_backend="mp", **ENGINE_KW)
    executor = llm.llm_engine.executor
    try:
        worker = executor.driver.worker
        assert worker.cache_engine.gpu_cache[0][0].shape[2] == kv_heads_per_rank  # half the KV heads
        outs = _greedy(llm, built.prompts, logprobs=3)
        stats = llm.stats()
    finally:
        executor.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == built.reference
    _assert_logprobs_match(outs, built)
    assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("name", ["opt", "gpt2"])
def test_original_hub_checkpoint_names(name: str, build, tmp_path: Path) -> None:
    """facebook/opt-* omit "model.", openai-community/gpt2 omits "transformer." and stores mask buffers."""
    from safetensors.torch import save_file

    built = build(name)
    prefix = {"opt": "model.", "gpt2": "transformer."}[name]
    state = {k[len(prefix):] if k.startswith(prefix) else k: v.contiguous() for k, v in built.state.items()}
    state.pop("lm_head.weight", None)
    if name == "gpt2":
        for i in range(FAMILIES[name].kwargs["n_layer"]):
            state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
            state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    path = tmp_path / name
    path.mkdir()
    shutil.copy(built.path / "config.json", path / "config.json")
    save_file(state, str(path / "model.safetensors"))
    llm = LLM(model=str(path), num_gpu_blocks_override=SMALL_POOL, block_size=4, **ENGINE_KW)
    assert [list(o.outputs[0].token_ids) for o in _greedy(llm, built.prompts)] == built.reference


def test_weights_loaded_exactly(build) -> None:
    """Spot-check the layout conversions: GPT-2's transposed Conv1D, OPT's merged q/k/v, Qwen2's biases. (float32
    linears on the CPU release their dense copy after packing; `restore_dense_weights` rebuilds it exactly.)"""
    gpt2 = build("gpt2")
    m = _model(LLM(model=str(gpt2.path), num_gpu_blocks_override=4, **ENGINE_KW))
    restore_dense_weights(m)
    c_attn = gpt2.state["transformer.h.1.attn.c_attn.weight"]  # [in, 3·out]
    torch.testing.assert_close(m.transformer.h[1].attn.c_attn.weight, c_attn.t(), rtol=0, atol=0)
    torch.testing.assert_close(m.transformer.h[1].mlp.c_fc.weight, gpt2.state["transformer.h.1.mlp.c_fc.weight"].t(),
                               rtol=0, atol=0)
    assert m.lm_head.weight is m.transformer.wte.weight

    opt = build("opt-350m-style")
    m = _model(LLM(model=str(opt.path), num_gpu_blocks_override=4, **ENGINE_KW))
    restore_dense_weights(m)
    layer = "model.decoder.layers.2.self_attn."
    expect = torch.cat([opt.state[layer + f"{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(m.model.decoder.layers[2].self_attn.qkv_proj.weight, expect, rtol=0, atol=0)
    assert m.model.decoder.project_in.weight.shape == (64, 32)
    assert m.model.decoder.final_layer_norm is None  # post-LN OPT has none

    qwen = build("qwen2")
    m = _model(LLM(model=str(qwen.path), num_gpu_blocks_override=4, **ENGINE_KW))
    bias = torch.cat([qwen.state[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert bias.abs().sum() > 0
    torch.testing.assert_close(m.model.layers[0].self_attn.qkv_proj.bias, bias, rtol=0, atol=0)

    qwen3 = build("qwen3")
    m = _model(LLM(model=str(qwen3.path), num_gpu_blocks_override=4, **ENGINE_KW))
    for kind in "qk":
        want = qwen3.state[f"model.layers.1.self_attn.{kind}_norm.weight"]
        assert want.shape == (32,) and (want - 1).abs().sum() > 0  # moved off 1 by _random_model
        torch.testing.assert_close(getattr(m.model.layers[1].self_attn, f"{kind}_norm").weight, want, rtol=0, atol=0)
    assert m.model.layers[0].self_attn.qkv_proj.bias is None


@pytest.mark.parametrize("name", list(FAMILIES))
def test_dummy_load_format(name: str, build) -> None:
    built = build(name)
    llm = LLM(model=str(built.path), load_format="dummy", num_gpu_blocks_override=32, block_size=8, **ENGINE_KW)
    model = _model(llm)
    for mod_name, mod in model.named_modules():
        if type(mod).__name__.endswith("Norm") and getattr(mod, "weight", None) is not None:
            assert torch.all(mod.weight == 1), f"{mod_name}: dummy norm weights should be 1"
    emb = next(p for n, p in model.named_parameters() if "embed_tokens" in n or "wte" in n)
    saved = next(v for k, v in built.state.items() if k.endswith(("embed_tokens.weight", "wte.weight")))
    assert not torch.equal(emb, saved), "dummy weights must not come from the checkpoint"
    outs = _greedy(llm, built.prompts[:3])
    for o in outs:
        assert len(o.outputs[0].token_ids) == MAX_TOKENS
        assert all(0 <= t < VOCAB for t in o.outputs[0].token_ids)


def test_generation_config_eos_ids_stop_generation(build, tmp_path: Path) -> None:
    """eos ids from generation_config.json apply (as in vLLM), even without a tokenizer."""
    built = build("gpt2")
    path = tmp_path / "gpt2-eos"
    shutil.copytree(built.path, path)
    # Two eos ids that greedy decoding reaches mid-way for some prompts.
    eos = sorted({built.reference[3][5], built.reference[6][9]})
    gen_cfg = json.loads((path / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = eos
    (path / "generation_config.json").write_text(json.dumps(gen_cfg))
    llm = LLM(model=str(path), num_gpu_blocks_override=SMALL_POOL, block_size=4, **ENGINE_KW)
    assert set(eos) <= set(llm.llm_engine.eos_token_ids)
    outs = _greedy(llm, built.prompts, ignore_eos=False)
    stopped = 0
    for ref, out in zip(built.reference, outs):
        cut = next((i for i, t in enumerate(ref) if t in eos), None)
        expect = ref if cut is None else ref[: cut + 1]
        assert list(out.outputs[0].token_ids) == expect
        assert out.outputs[0].finish_reason == ("length" if cut is None else "stop")
        stopped += cut is not None
    assert stopped >= 2


def test_text_prompt_without_tokenizer_is_rejected(build) -> None:
    llm = LLM(model=str(build("opt").path), num_gpu_blocks_override=8, **ENGINE_KW)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate("hello", use_tqdm=False)


def test_multi_shard_and_broken_shards(build, tmp_path: Path) -> None:
    """A GPT-2 saved in many shards loads and matches; a missing or corrupt shard is a clear error."""
    built = build("gpt2")
    model = _random_model(FAMILIES["gpt2"])
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="100KB")
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) >= 3 and (sharded / "model.safetensors.index.json").is_file()
    llm = LLM(model=str(sharded), num_gpu_blocks_override=SMALL_POOL, block_size=4, **ENGINE_KW)
    assert [list(o.outputs[0].token_ids) for o in _greedy(llm, built.prompts)] == built.reference

    missing = tmp_path / "missing"
    shutil.copytree(sharded, missing)
    (missing / shards[1].name).unlink()
    with pytest.raises(FileNotFoundError, match=shards[1].name):
        LLM(model=str(missing), num_gpu_blocks_override=4, **ENGINE_KW)

    corrupt = tmp_path / "corrupt"
    shutil.copytree(sharded, corrupt)
    data = (corrupt / shards[1].name).read_bytes()
    (corrupt / shards[1].name).write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match=shards[1].name):
        LLM(model=str(corrupt), num_gpu_blocks_override=4, **ENGINE_KW)


def test_unsupported_architecture_lists_supported(tmp_path: Path) -> None:
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=1, n_head=4)
    config.architectures = ["BloomForCausalLM"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="BloomForCausalLM.*not supported.*GPT2LMHeadModel.*OPTForCausalLM"):
        LLM(model=str(tmp_path), load_format="dummy", num_gpu_blocks_override=4, **ENGINE_KW)


def test_registry_by_architecture_and_model_type() -> None:
    for cfg_cls, ours in [("OPTConfig", "OPTForCausalLM"), ("GPT2Config", "GPT2LMHeadModel"),
                          ("Qwen2Config", "Qwen2ForCausalLM"), ("Qwen3Config", "Qwen3ForCausalLM"),
                          ("MistralConfig", "LlamaForCausalLM")]:
        config = getattr(transformers, cfg_cls)()  # no `architectures`: model_type decides
        assert get_model_class(config).__name__ == ours


@pytest.mark.parametrize("name", list(FAMILIES))
def test_model_construction_draws_no_random_numbers(name: str) -> None:
    """Parameters start as torch.empty: no wasted init at 13B shape, and no RNG use on CUDA, where a
    draw during model construction can collide with CUDA-graph RNG state."""
    from pagedllm.distributed.parallel_state import TensorParallelGroup

    family = FAMILIES[name]
    config = getattr(transformers, family.config_cls)(vocab_size=VOCAB, **family.kwargs)
    cls = get_model_class(config)
    state = torch.get_rng_state()
    model = cls(config, TensorParallelGroup(), torch.float32)
    assert torch.equal(torch.get_rng_state(), state)
    assert type(model).__name__ == family.ours


def test_kv_geometry_reads_gpt2_and_opt_configs() -> None:
    """GPT-2 names its fields n_layer/n_head/n_embd/n_positions; transformers' attribute_map aliases them."""
    gpt2 = transformers.GPT2Config(n_embd=96, n_layer=5, n_head=6, n_positions=77)
    assert kv_geometry(gpt2, 1) == (5, 6, 16)
    assert kv_geometry(gpt2, 2) == (5, 3, 16)
    assert get_model_max_len(gpt2) == 77
    opt = transformers.OPTConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=8, ffn_dim=128,
                                 max_position_embeddings=99)
    assert kv_geometry(opt, 1) == (3, 8, 8)
    assert get_model_max_len(opt) == 99


def test_sliding_window_does_not_cap_max_model_len(build) -> None:
    """Sliding windows are implemented (each query reads its last `sliding_window` keys), so the context is the
    config's position limit, window or not."""
    mistral = transformers.MistralConfig(max_position_embeddings=1024, sliding_window=256)
    assert get_sliding_window(mistral) == 256
    assert get_model_max_len(mistral) == 1024
    assert get_model_max_len(mistral, 512) == 1024  # the ceiling; the engine applies the user's 512
    assert get_model_max_len(transformers.MistralConfig(max_position_embeddings=1024, sliding_window=None)) == 1024
    assert get_model_max_len(transformers.MistralConfig(max_position_embeddings=128, sliding_window=4096)) == 128
    assert get_sliding_window(transformers.Qwen2Config(use_sliding_window=False, sliding_window=64)) is None

    path = str(build("mistral").path)  # max_position_embeddings=256, sliding_window=96
    llm = LLM(model=path, num_gpu_blocks_override=8, **ENGINE_KW)
    assert llm.llm_engine.config.scheduler_config.max_model_len == 256
    llm = LLM(model=path, max_model_len=200, num_gpu_blocks_override=8, **ENGINE_KW)
    assert llm.llm_engine.config.scheduler_config.max_model_len == 200
