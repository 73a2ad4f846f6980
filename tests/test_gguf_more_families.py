"""GGUF files of llama.cpp's `granite`, `olmo2` (OLMo 2, and OLMo 3 where the file names a window), `smollm3`,
`gptneox`, `phi2`, `stablelm` and `starcoder2` architectures: tiny random-weight transformers models written in
llama.cpp's layout (tests/gguf_writing.py: gguf-py's tensor names; q/k rows and biases permuted where llama.cpp's
converter permutes them, Granite's and SmolLM3's, which subclass its Llama converter; GPT-NeoX's query_key_value
reordered to q | k | v and StableLM's per-head norms stacked, as their converters do; the metadata keys each
converter writes). pagedllm serving the file must generate what transformers generates from the original weights,
greedy tokens and log-probs, in float32. transformers 5.25 reads only the stablelm and starcoder2 files itself (the
second, independent check of the layout there); elsewhere the check is gguf-py's own name map and the converters'
tensor transforms, reproduced here.

Every knob bites (test_features_change_the_outputs): Granite's four multipliers far from 1 (and from head_dim**-0.5),
q/k/v/o and MLP biases (permuted q/k biases too); OLMo 2's randomized post-norms and whole-projection q/k norms;
OLMo 3's window of 8 under prompts of up to 30 and its two RoPE settings; SmolLM3's NoPE layer (layer 3 of 5, as
llama.cpp hard-codes every fourth); the LayerNorm families' rotated fractions of each head, GPT-NeoX's parallel and
sequential residuals, StableLM's per-head q/k norms and parallel blocks, StarCoder2's RoPE base.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import transformers
from gguf_writing import ENGINE_KW as _GGUF_ENGINE_KW
from gguf_writing import add_shape_metadata, gguf, hf_greedy, teacher_forced_ranks, write_gguf
from gguf_writing import own_cache  # noqa: F401 (autouse fixture: a cache directory per test)
from test_gguf_gemma_phi3 import _assert_matches, _config, _model, _ours  # same MAX_TOKENS and LOGPROB_ATOL
from test_gguf_gemma_phi3 import _metadata_only as _gemma_phi3_metadata_only
from test_models_hf import hf_greedy_reference

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.cpu_kernels import load_cpu_kernels
from pagedllm.model.cpu_direct_forward import direct_forward_enabled
from pagedllm.model.gguf_config import build_config
from pagedllm.model.gguf_loader import map_tensor_name, open_gguf, transformers_dense_gguf_kwargs

# OLMo 3's hybrid KV cache counts blocks of one group's layers: a pool of more of them.
ENGINE_KW = {**_GGUF_ENGINE_KW, "num_gpu_blocks_override": 128}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

VOCAB = 512
MAX_TOKENS = 10
WINDOW = 8
PROMPT_LENS = (3, 11, 19, 30)
LOGPROB_ATOL = 2e-5
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, rms_norm_eps=1e-6, attn_implementation="eager")
# As tests/test_models_hf_llama_variants.py: Granite 3's are 12 / 0.22 / 1/128 / 8; these stay as far from 1 (and from
# head_dim**-0.5 = 0.25) while keeping the top-2 logit margins well above float32 noise.
_GRANITE_MULTIPLIERS = dict(embedding_multiplier=4.0, residual_multiplier=0.4, attention_multiplier=0.09,
                            logits_scaling=2.5)
# The LayerNorm families' shape (biases, the tokens in the vocabulary); untied heads where llama.cpp requires one.
_LN_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, attn_implementation="eager", pad_token_id=0,
                 bos_token_id=1, eos_token_id=2)
_OLMO3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}


# -- what each llama.cpp converter writes (conversion/granite.py, olmo.py, llama.py) --------------------------------

def _llama_converter_meta(w, cfg) -> None:
    """LlamaModel.set_gguf_parameters: the shape keys (no head length: these configs have no head_dim), the
    vocabulary size and RoPE on whole heads."""
    add_shape_metadata(w, cfg, head_dim=False)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)


def _granite_meta(w, cfg) -> None:
    _llama_converter_meta(w, cfg)
    w.add_attention_scale(cfg.attention_multiplier)
    w.add_embedding_scale(cfg.embedding_multiplier)
    w.add_residual_scale(cfg.residual_multiplier)
    w.add_logit_scale(cfg.logits_scaling)


def _olmo2_meta(w, cfg) -> None:
    """TextModel.set_gguf_parameters (the global RoPE base and scaling, the local base), and OLMo 3's window with a
    flag per layer."""
    add_shape_metadata(w, cfg, head_dim=False)
    params = cfg.rope_parameters
    full = params.get("full_attention", params)
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if "sliding_attention" in params:
        w.add_rope_freq_base_swa(params["sliding_attention"]["rope_theta"])
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])


def _rotary_dims(cfg) -> int:
    """Each head's rotated dimensions: int(partial_rotary_factor · head_dim), as the converters compute it."""
    return int(cfg.rope_parameters.get("partial_rotary_factor", 1.0) * (cfg.hidden_size // cfg.num_attention_heads))


def _layernorm_shape_meta(w, cfg, ffn: int | None = None) -> None:
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size if ffn is None else ffn)
    w.add_head_count(cfg.num_attention_heads)


def _gptneox_meta(w, cfg) -> None:
    """GPTNeoXModel.set_gguf_parameters: no KV head count (one per head), no RoPE base (llama.cpp's 10 000)."""
    _layernorm_shape_meta(w, cfg)
    w.add_rope_dimension_count(_rotary_dims(cfg))
    w.add_parallel_residual(cfg.use_parallel_residual)
    w.add_layer_norm_eps(cfg.layer_norm_eps)


def _phi2_meta(w, cfg) -> None:
    """Phi2Model.set_gguf_parameters: the MLP width written as 4 · hidden, as many KV heads as heads, no RoPE base."""
    _layernorm_shape_meta(w, cfg, ffn=4 * cfg.hidden_size)
    w.add_head_count_kv(cfg.num_attention_heads)
    w.add_layer_norm_eps(cfg.layer_norm_eps)
    w.add_rope_dimension_count(_rotary_dims(cfg))
    w.add_add_bos_token(False)


def _stablelm_meta(w, cfg) -> None:
    """StableLMModel.set_gguf_parameters (no RoPE base; llama.cpp tells the residual from ffn_norm's presence)."""
    _layernorm_shape_meta(w, cfg)
    w.add_rope_dimension_count(_rotary_dims(cfg))
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_parallel_residual(cfg.use_parallel_residual)
    w.add_layer_norm_eps(cfg.layer_norm_eps)


def _starcoder2_meta(w, cfg) -> None:
    """TextModel.set_gguf_parameters: the shape keys, the RoPE base, the LayerNorm epsilon (no window key)."""
    _layernorm_shape_meta(w, cfg)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_eps(cfg.norm_epsilon)


def _gptneox_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """GPTNeoXModel.modify_tensors: each query_key_value from HF's per-head (q, k, v) rows to q | k | v."""
    cfg = model.config
    n_head, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    out = {}
    for name, t in model.state_dict().items():
        if ".query_key_value." in name:
            t = t.reshape(n_head, 3, head_dim, *t.shape[1:]).transpose(0, 1).reshape(t.shape)
        out[name] = t
    return out


def _phi2_fused_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Older Phi-2 files' fused attn_qkv (q | k | v rows; gguf-py maps `self_attn.qkv_proj` to it)."""
    state = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if ".self_attn.q_proj." in name:
            parts = [state[name.replace("q_proj", proj)] for proj in ("q_proj", "k_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(parts)
        elif ".self_attn.k_proj." not in name and ".self_attn.v_proj." not in name:
            out[name] = t
    return out


def _stablelm_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """StableLMModel._stack_qk_norm: each layer's per-head q/k LayerNorm weights stacked into one [heads, head_dim]."""
    state = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if ".norms." not in name:
            out[name] = t
        elif name.endswith(".norms.0.weight"):
            prefix = name[: -len(".norms.0.weight")]
            heads = sorted(int(k.split(".")[-2]) for k in state if k.startswith(f"{prefix}.norms."))
            out[f"{prefix}.weight"] = torch.stack([state[f"{prefix}.norms.{h}.weight"] for h in heads])
    return out


@dataclass(frozen=True)
class Case:
    arch: str  # llama.cpp's architecture name
    config_cls: str
    model_cls: str
    kwargs: dict
    metadata: Callable[[Any, Any], None]
    permute_qk: bool = False
    #: the tensors the converter writes under HF names (None: the model's own)
    tensors: Callable[[torch.nn.Module], dict[str, torch.Tensor]] | None = None
    #: config fields transformers' GGUF reader does not take from the file (None: it cannot read the architecture)
    transformers_overrides: dict | None = None


CASES: dict[str, Case] = {
    # The four multipliers, q/k/v/o and MLP biases, q/k rows and biases permuted, an untied head.
    "granite": Case("granite", "GraniteConfig", "GraniteForCausalLM", {
        **_SHAPE, **_GRANITE_MULTIPLIERS, "num_hidden_layers": 3, "attention_bias": True, "mlp_bias": True,
        "tie_word_embeddings": False}, _granite_meta, permute_qk=True),
    # Granite 3's tied head (no output.weight), no biases. (A random model whose tied head reads a residual stream
    # scaled ×4 at the embedding repeats a token: its greedy tokens say little, its log-probs are checked all the same.)
    "granite-tied": Case("granite", "GraniteConfig", "GraniteForCausalLM", {
        **_SHAPE, **_GRANITE_MULTIPLIERS, "num_hidden_layers": 2, "tie_word_embeddings": True}, _granite_meta,
        permute_qk=True),
    # Post-norms, whole-projection q/k norms, an untied head (llama.cpp requires output.weight).
    "olmo2": Case("olmo2", "Olmo2Config", "Olmo2ForCausalLM", {**_SHAPE, "num_hidden_layers": 3}, _olmo2_meta),
    # OLMo 2's layers; local (window 8) / global / local, RoPE base 10 000 locally, 10⁶ linearly scaled ×2 globally.
    "olmo3": Case("olmo2", "Olmo3Config", "Olmo3ForCausalLM", {
        **_SHAPE, "num_hidden_layers": 3, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "rope_parameters": _OLMO3_ROPE},
        _olmo2_meta),
    # Five layers: the fourth without RoPE (transformers' default interval 4 = llama.cpp's hard-coded step), tied head.
    "smollm3": Case("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", {
        **_SHAPE, "num_hidden_layers": 5, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}, _llama_converter_meta, permute_qk=True),
    # Parallel residual, RoPE on 4 of 16 dims, fused attn_qkv (reordered from HF's per-head interleaving), biases,
    # llama.cpp's tanh GELU.
    "gptneox": Case("gptneox", "GPTNeoXConfig", "GPTNeoXForCausalLM", {
        **_LN_SHAPE, "num_key_value_heads": 4, "rotary_pct": 0.25, "use_parallel_residual": True,
        "hidden_act": "gelu_new"}, _gptneox_meta, tensors=_gptneox_tensors),
    # Sequential residual, RoPE on 8 of 16 dims.
    "gptneox-sequential": Case("gptneox", "GPTNeoXConfig", "GPTNeoXForCausalLM", {
        **_LN_SHAPE, "num_key_value_heads": 4, "rotary_pct": 0.5, "use_parallel_residual": False,
        "hidden_act": "gelu_new"}, _gptneox_meta, tensors=_gptneox_tensors),
    # One LayerNorm feeding attention and MLP, RoPE on 8 of 16 dims, biased q/k/v/dense/fc and LM head; MHA and an
    # MLP 4 × hidden wide (the converter writes those, whatever the config says), an untied head (llama.cpp's phi2
    # requires output.weight and output.bias).
    "phi2": Case("phi2", "PhiConfig", "PhiForCausalLM", {
        **_LN_SHAPE, "intermediate_size": 256, "num_key_value_heads": 4, "partial_rotary_factor": 0.5},
        _phi2_meta),
    # The same with q/k/v fused into one attn_qkv (older Phi-2 files).
    "phi2-fused-qkv": Case("phi2", "PhiConfig", "PhiForCausalLM", {
        **_LN_SHAPE, "intermediate_size": 256, "num_key_value_heads": 4, "partial_rotary_factor": 0.5},
        _phi2_meta, tensors=_phi2_fused_tensors),
    # Sequential blocks, q/k/v biases, GQA, RoPE on 4 of 16 dims, SwiGLU.
    "stablelm": Case("stablelm", "StableLmConfig", "StableLmForCausalLM", {
        **_LN_SHAPE, "partial_rotary_factor": 0.25, "use_qkv_bias": True, "use_parallel_residual": False},
        _stablelm_meta, transformers_overrides={"partial_rotary_factor": 0.25}),
    # Parallel blocks (no ffn_norm), one LayerNorm weight per q head and per KV head (StableLM 2 12B). transformers'
    # GGUF reader leaves those stacked norms unread (its per-head norms.H keep their init): no second check here.
    "stablelm-parallel-qk-norm": Case("stablelm", "StableLmConfig", "StableLmForCausalLM", {
        **_LN_SHAPE, "partial_rotary_factor": 0.5, "use_parallel_residual": True, "qk_layernorm": True},
        _stablelm_meta, tensors=_stablelm_tensors),
    # Biases everywhere, GQA, whole-head RoPE, tied head (the default), no window (the file names none).
    "starcoder2": Case("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", {
        **_LN_SHAPE, "sliding_window": None, "use_bias": True, "norm_epsilon": 1e-4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}, _starcoder2_meta,
        transformers_overrides={"sliding_window": None}),
}


def _hf_model(case: Case) -> torch.nn.Module:
    """transformers' init at std 0.1 (clear top-2 margins), then 1-D weights (biases, norms) moved off 0 / 1."""
    config = getattr(transformers, case.config_cls)(vocab_size=VOCAB, initializer_range=0.1, **case.kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, case.model_cls)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None
    return model


def _write(model: torch.nn.Module, case: Case, path: Path, **kw) -> Path:
    return write_gguf(model, case.arch, path, partial(case.metadata, cfg=model.config), permute_qk=case.permute_qk,
                      state_dict=None if case.tensors is None else case.tensors(model), **kw)


def _transformers_from_gguf(src: Path, overrides: dict[str, Any]) -> torch.nn.Module:
    """transformers reading ``src`` itself (float32, eager attention), with ``overrides`` set on the config it reads:
    the fields its GGUF reader does not take from the file."""
    config = transformers.AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, config=config, attn_implementation="eager",
        **transformers_dense_gguf_kwargs())
    return model.float().eval()


def _prompts(lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens]


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_generates_what_transformers_does(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    model = _hf_model(case)
    prompts = _prompts()
    want, logprobs = hf_greedy_reference(model, prompts, MAX_TOKENS)
    src = _write(model, case, tmp_path / f"{name}.gguf")
    if case.transformers_overrides is not None:  # transformers reads the file itself: the layout is llama.cpp's
        assert hf_greedy(_transformers_from_gguf(src, case.transformers_overrides), prompts, MAX_TOKENS) == want
    llm = LLM(model=str(src), **ENGINE_KW, quantization="none", block_size=4)
    ours = _model(llm)
    assert type(ours).__name__ == case.model_cls
    # The CPU direct forward (native kernels loaded) runs every family here: Granite, OLMo, SmolLM3 and the LayerNorm
    # ones.
    direct = load_cpu_kernels() is not None and direct_forward_enabled()
    assert (llm.llm_engine.executor.driver_worker.model_runner.direct_forward is not None) == direct
    _assert_matches(_ours(llm, prompts), want, logprobs)


def test_config_from_metadata(tmp_path: Path) -> None:
    """What build_config reads from each file: Granite's multipliers, OLMo 3's layer types and RoPE per layer type,
    SmolLM3's NoPE layers."""
    configs = {}
    for name in CASES:
        src = _write(_hf_model(CASES[name]), CASES[name], tmp_path / f"{name}.gguf")
        configs[name] = build_config(open_gguf(src), src).config
    granite = configs["granite"]
    assert {k: granite[k] for k in _GRANITE_MULTIPLIERS} == pytest.approx(_GRANITE_MULTIPLIERS)
    assert granite["attention_bias"] and granite["mlp_bias"] and not granite["tie_word_embeddings"]
    tied = configs["granite-tied"]
    assert tied["tie_word_embeddings"] and not tied["attention_bias"] and not tied["mlp_bias"]
    assert configs["olmo2"]["architectures"] == ["Olmo2ForCausalLM"] and not configs["olmo2"]["tie_word_embeddings"]
    olmo3 = configs["olmo3"]
    assert olmo3["architectures"] == ["Olmo3ForCausalLM"] and olmo3["model_type"] == "olmo3"
    assert olmo3["layer_types"] == CASES["olmo3"].kwargs["layer_types"] and olmo3["sliding_window"] == WINDOW
    assert olmo3["rope_parameters"] == _OLMO3_ROPE
    assert configs["smollm3"]["no_rope_layers"] == [1, 1, 1, 0, 1]
    assert configs["smollm3"]["tie_word_embeddings"]

    def rope(name: str) -> dict[str, Any]:
        return configs[name]["rope_parameters"]

    for name in ("gptneox", "gptneox-sequential", "phi2", "stablelm", "stablelm-parallel-qk-norm", "starcoder2"):
        assert "rms_norm_eps" not in configs[name] and "rope_theta" not in configs[name]
    neox, seq = configs["gptneox"], configs["gptneox-sequential"]
    assert neox["use_parallel_residual"] and not seq["use_parallel_residual"] and neox["attention_bias"]
    assert rope("gptneox")["partial_rotary_factor"] == 0.25 and rope("gptneox-sequential")["partial_rotary_factor"] == 0.5
    assert neox["hidden_act"] == "gelu_pytorch_tanh" and neox["layer_norm_eps"] == pytest.approx(1e-5)
    phi2 = configs["phi2"]
    assert rope("phi2") == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    assert phi2["hidden_act"] == "gelu_new" and not phi2["qk_layernorm"] and not phi2["tie_word_embeddings"]
    stablelm, parallel = configs["stablelm"], configs["stablelm-parallel-qk-norm"]
    assert (stablelm["use_qkv_bias"], stablelm["qk_layernorm"], stablelm["use_parallel_residual"]) == (True, False, False)
    assert (parallel["use_qkv_bias"], parallel["qk_layernorm"], parallel["use_parallel_residual"]) == (False, True, True)
    assert rope("stablelm")["partial_rotary_factor"] == 0.25
    starcoder2 = configs["starcoder2"]
    assert starcoder2["use_bias"] and starcoder2["tie_word_embeddings"] and starcoder2["sliding_window"] is None
    assert starcoder2["norm_epsilon"] == pytest.approx(1e-4) and rope("starcoder2")["rope_theta"] == 50000.0


def test_features_change_the_outputs() -> None:
    """Each setting the GGUF metadata carries changes transformers' own log-probs on these prompts, so the parity
    above holds because pagedllm read it from the file, not by accident."""
    changes = [("granite", {key: 1.0}) for key in _GRANITE_MULTIPLIERS]
    changes += [("granite", {"attention_multiplier": 0.25})]  # head_dim**-0.5, llama.cpp's default
    changes += [("olmo3", {"sliding_window": 4096}),
                ("olmo3", {"rope_parameters": {**_OLMO3_ROPE, "sliding_attention": _OLMO3_ROPE["full_attention"]}}),
                ("smollm3", {"no_rope_layers": [1] * 5}),
                ("gptneox", {"rotary_pct": 1.0}), ("gptneox", {"use_parallel_residual": False}),
                ("phi2", {"partial_rotary_factor": 1.0}), ("stablelm", {"partial_rotary_factor": 1.0}),
                ("starcoder2", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})]
    prompts = _prompts()[-1:]
    for name, off in changes:
        case = CASES[name]
        _, want = hf_greedy_reference(_hf_model(case), prompts, MAX_TOKENS)
        changed = Case(case.arch, case.config_cls, case.model_cls, {**case.kwargs, **off}, case.metadata)
        _, got = hf_greedy_reference(_hf_model(changed), prompts, MAX_TOKENS)
        assert (got[0] - want[0]).abs().max() > 1e-3, (name, off)


def test_permutation_is_needed(tmp_path: Path) -> None:
    """Granite's file stores q/k rows permuted (llama.cpp's interleaved RoPE): a file of unpermuted rows gives other
    log-probs, so the parity above checks the un-permutation."""
    case = CASES["granite"]
    model = _hf_model(case)
    prompts = _prompts()[-1:]
    _, want = hf_greedy_reference(model, prompts, MAX_TOKENS)
    src = write_gguf(model, "granite", tmp_path / "granite-unpermuted.gguf", partial(case.metadata, cfg=model.config))
    out = _ours(LLM(model=str(src), **ENGINE_KW, quantization="none"), prompts)[0].outputs[0]
    first = out.logprobs[0]
    assert max(abs(lp.logprob - want[0][0, token].item()) for token, lp in first.items()) > 1e-3


# Tied heads: their Q8_0 embedding serves the head too.
_Q8_TIED = ("granite-tied", "starcoder2")


@pytest.mark.parametrize("name", ["granite", "granite-tied", "olmo3", "smollm3", "gptneox", "phi2",
                                  "stablelm-parallel-qk-norm", "starcoder2"])
def test_q8_linears_run_quantized(name: str, tmp_path: Path) -> None:
    """Q8_0 projections (and a tied head's Q8_0 embedding, which the head shares) are served as int8 blocks: q/k rows
    un-permuted block row by block row (Granite, SmolLM3), GPT-NeoX's fused attn_qkv split by rows into q/k/v, the
    GELU MLPs' fc1 / fc2, Phi-2's biased head. Int8 activations are not bit-exact, so the check is teacher-forced: fed
    the dequantized path's greedy continuation, the quantized model ranks that path's token first at nearly every
    position."""
    from pagedllm.model.layers.linear import PackableGemm

    case = CASES[name]
    prompts = _prompts()
    tied = name in _Q8_TIED
    src = _write(_hf_model(case), case, tmp_path / f"{name}-q8.gguf", q8_linears=True, q8_embedding=tied)
    dense = [list(o.outputs[0].token_ids)
             for o in _ours(LLM(model=str(src), **ENGINE_KW, quantization="none"), prompts)]
    llm = LLM(model=str(src), **ENGINE_KW, quantization="gguf")  # the suite's default is "none" (conftest.py)
    model = _model(llm)
    assert type(model).__name__ == case.model_cls
    linears = {n: m for n, m in model.model.layers[0].named_modules() if isinstance(m, PackableGemm)}
    assert len(linears) == 4 and all(m.gguf_weight is not None for m in linears.values()), sorted(linears)
    if tied:
        assert model.lm_head.gguf_weight is model.model.embed_tokens.gguf_weight is not None
    ranks = teacher_forced_ranks(llm, prompts, dense)
    assert len(ranks) == len(prompts) * MAX_TOKENS
    assert sum(r == 1 for r in ranks) >= 0.9 * len(ranks), ranks


# -- metadata llama.cpp hard-codes or reads, and clear errors -------------------------------------------------------

# gemma/phi3's metadata-only writer, without the key/value length (the head size is then hidden / heads)
_metadata_only = partial(_gemma_phi3_metadata_only, head_dim=None)


def test_metadata_defaults_as_llama_cpp(tmp_path: Path) -> None:
    """Where a file is silent: Granite's attention scale is head_dim**-0.5 and its embedding and residual scales 1
    (a 0 means the same); SmolLM3 skips RoPE on every fourth layer whatever its depth; OLMo 2 with a window and no
    pattern is OLMo 3 with every fourth layer global, its local RoPE base the global one, unscaled."""
    granite = _config(_metadata_only(tmp_path / "g.gguf", "granite", lambda w: (
        w.add_logit_scale(8.0), w.add_residual_scale(0.0))))
    assert granite["attention_multiplier"] == pytest.approx(16 ** -0.5)
    assert (granite["embedding_multiplier"], granite["residual_multiplier"], granite["logits_scaling"]) == (1, 1, 8)
    smol = _config(_metadata_only(tmp_path / "s.gguf", "smollm3", lambda w: None, n_layers=9))
    assert smol["no_rope_layers"] == [1, 1, 1, 0, 1, 1, 1, 0, 1] and smol["use_sliding_window"] is False
    olmo3 = _config(_metadata_only(tmp_path / "o.gguf", "olmo2", lambda w: (
        w.add_sliding_window(16), w.add_rope_freq_base(5e5), w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
        w.add_rope_scaling_factor(8.0), w.add_rope_scaling_orig_ctx_len(64)), n_layers=8))
    assert olmo3["layer_types"] == (["sliding_attention"] * 3 + ["full_attention"]) * 2
    assert olmo3["rope_parameters"] == {
        "full_attention": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                           "rope_theta": 5e5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}
    assert "rope_theta" not in olmo3 and "rope_scaling" not in olmo3
    olmo2 = _config(_metadata_only(tmp_path / "o2.gguf", "olmo2", lambda w: None))
    assert olmo2["architectures"] == ["Olmo2ForCausalLM"] and "layer_types" not in olmo2


def test_unsupported_gguf_contents_are_clear_errors(tmp_path: Path) -> None:
    def fails(path: Path, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            _config(path)

    fails(_metadata_only(tmp_path / "a.gguf", "granite", lambda w: None),
          "missing metadata key 'granite.logit_scale'")
    fails(_metadata_only(tmp_path / "b.gguf", "granite", lambda w: w.add_logit_scale(0.0)),
          "granite.logit_scale is 0")
    fails(_metadata_only(tmp_path / "c.gguf", "granite", lambda w: (w.add_logit_scale(1.0),
                                                                   w.add_rope_scaling_finetuned(False))),
          "granite.rope.scaling.finetuned is false")
    fails(_metadata_only(tmp_path / "d.gguf", "smollm3", lambda w: w.add_rope_dimension_count(8)),
          "rotates 8 of each head's 16 dimensions")
    fails(_metadata_only(tmp_path / "e.gguf", "starcoder2", lambda w: (w.add_layer_norm_eps(1e-5),
                                                                      w.add_rope_dimension_count(8))),
          "rotates 8 of each head's 16 dimensions.*architecture 'starcoder2' must rotate whole heads")
    for arch in ("phi2", "stablelm", "starcoder2", "gptneox"):
        fails(_metadata_only(tmp_path / f"{arch}.gguf", arch, lambda w: w.add_parallel_residual(True)),
              f"missing metadata key '{arch}.attention.layer_norm_epsilon'")
    fails(_metadata_only(tmp_path / "f.gguf", "gptneox", lambda w: w.add_layer_norm_eps(1e-5)),
          "missing metadata key 'gptneox.use_parallel_residual'")
    fails(_metadata_only(tmp_path / "g.gguf", "gptneox", lambda w: (
        w.add_layer_norm_eps(1e-5), w.add_parallel_residual(True), w.add_head_count_kv(2))),
          "GPT-NeoX has one KV head per query head; gptneox.attention.head_count_kv = 2 of 4")
    fails(_metadata_only(tmp_path / "h.gguf", "phi2", lambda w: (w.add_layer_norm_eps(1e-5),
                                                                w.add_rope_dimension_count(5))),
          "phi2.rope.dimension_count = 5; it must be even")


def test_tensor_names_per_architecture() -> None:
    """OLMo 2's post-norms (llama.cpp's post_attention_norm / post_ffw_norm) and whole-projection q/k norms; the
    LayerNorm families under pagedllm's shared layout (fc1 / fc2, o_proj, norm biases, Phi-2's head bias); tensors an
    architecture does not have (OLMo 2's pre-norms, a bias on SmolLM3 or OLMo 2, q/k norms on Granite, Phi-2's
    ffn_norm, GPT-NeoX's unfused q, StarCoder2's gate) fail naming the tensor and the ones the architecture has."""
    assert map_tensor_name("blk.2.post_attention_norm.weight", "olmo2") == \
        "model.layers.2.post_attention_layernorm.weight"
    assert map_tensor_name("blk.2.post_ffw_norm.weight", "olmo2") == "model.layers.2.post_feedforward_layernorm.weight"
    assert map_tensor_name("blk.0.attn_k_norm.weight", "olmo2") == "model.layers.0.self_attn.k_norm.weight"
    assert map_tensor_name("blk.1.attn_q.bias", "granite") == "model.layers.1.self_attn.q_proj.bias"
    assert map_tensor_name("blk.1.ffn_norm.weight", "smollm3") == "model.layers.1.post_attention_layernorm.weight"
    assert map_tensor_name("blk.0.attn_qkv.bias", "gptneox") == "model.layers.0.self_attn.qkv_proj.bias"
    assert map_tensor_name("blk.0.ffn_up.weight", "gptneox") == "model.layers.0.mlp.fc1.weight"
    assert map_tensor_name("blk.0.ffn_norm.bias", "starcoder2") == "model.layers.0.post_attention_layernorm.bias"
    assert map_tensor_name("blk.0.attn_output.bias", "phi2") == "model.layers.0.self_attn.o_proj.bias"
    assert map_tensor_name("output.bias", "phi2") == "lm_head.bias"
    assert map_tensor_name("output_norm.bias", "stablelm") == "model.norm.bias"
    assert map_tensor_name("blk.0.attn_k_norm.weight", "stablelm") == "model.layers.0.self_attn.k_norm.weight"
    for name, arch in [("blk.0.attn_norm.weight", "olmo2"), ("blk.0.attn_q.bias", "smollm3"),
                       ("blk.0.attn_output.bias", "olmo2"), ("blk.0.attn_q_norm.weight", "granite"),
                       ("blk.0.ffn_norm.weight", "phi2"), ("blk.0.attn_q.weight", "gptneox"),
                       ("blk.0.ffn_gate.weight", "starcoder2")]:
        with pytest.raises(ValueError, match=f"Unsupported tensor '{name}' .* architecture '{arch}'"):
            map_tensor_name(name, arch)


def test_gguf_with_a_tokenizer_serves_text(tmp_path: Path) -> None:
    """A file's BPE tokenizer (here the bundled model's vocabulary and chat template, in a smollm3 file) is built
    from its metadata, though transformers cannot read the architecture's config from a GGUF: text prompts and chat
    run, and text encodes as the bundled tokenizer encodes it."""
    from gguf_writing import copy_tokenizer

    from pagedllm.model.loader import default_model_path

    name, case = "smollm3", CASES["smollm3"]
    config = getattr(transformers, case.config_cls)(vocab_size=49152, initializer_range=0.1, **case.kwargs)
    model = getattr(transformers, case.model_cls)(config).eval()
    src = _write(model, case, tmp_path / f"{name}-tok.gguf", tokenizer=partial(copy_tokenizer,
                                                                               source=default_model_path()))
    llm = LLM(model=str(src), num_gpu_blocks_override=32, max_model_len=128, device="cpu", swap_space=0.01)
    tok = llm.get_tokenizer()
    reference = LLM(num_gpu_blocks_override=4, max_model_len=64, device="cpu", swap_space=0.01).get_tokenizer()
    text = "The capital of France is Paris, and it is lovely in spring."
    assert tok.encode(text) == reference.encode(text)
    out = llm.generate([text], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode(text) and len(out.outputs[0].token_ids) == 4
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    want = reference.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert tok.decode(chat[0].prompt_token_ids) == want and "Hi" in want
