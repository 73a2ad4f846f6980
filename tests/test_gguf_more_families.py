"""GGUF files of llama.cpp's `granite`, `olmo2` (OLMo 2, and OLMo 3 where the file names a window) and `smollm3`
architectures: tiny random-weight transformers models written in llama.cpp's layout (tests/gguf_writing.py: gguf-py's
tensor names; q/k rows permuted where llama.cpp's converter permutes them, Granite's and SmolLM3's, which subclass its
Llama converter; the metadata keys each converter writes). pagedllm serving the file must generate what transformers
generates from the original weights, greedy tokens and log-probs, in float32. transformers 5.25 cannot read these
architectures' GGUF files itself, so the layout's independent check is gguf-py's own name map and the converter's
permutation, reproduced here.

Every knob bites (test_features_change_the_outputs): Granite's four multipliers far from 1 (and from head_dim**-0.5),
q/k/v/o and MLP biases (permuted q/k biases too); OLMo 2's randomized post-norms and whole-projection q/k norms;
OLMo 3's window of 8 under prompts of up to 30 and its two RoPE settings; SmolLM3's NoPE layer (layer 3 of 5, as
llama.cpp hard-codes every fourth).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import transformers
from gguf_writing import ENGINE_KW as _GGUF_ENGINE_KW
from gguf_writing import add_shape_metadata, gguf, teacher_forced_ranks, write_gguf
from gguf_writing import own_cache  # noqa: F401 (autouse fixture: a cache directory per test)
from test_models_hf import hf_greedy_reference

from pagedllm import LLM, SamplingParams
from pagedllm.model.gguf_config import build_config
from pagedllm.model.gguf_loader import map_tensor_name, open_gguf

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


@dataclass(frozen=True)
class Case:
    arch: str  # llama.cpp's architecture name
    config_cls: str
    model_cls: str
    kwargs: dict
    metadata: Callable[[Any, Any], None]
    permute_qk: bool = False


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
                      **kw)


def _prompts(lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens]


def _ours(llm: LLM, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _model(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.executor.driver_worker.model


def _assert_matches(outs: list, tokens: list[list[int]], logprobs: list[torch.Tensor]) -> None:
    for out, want, ref in zip(outs, tokens, logprobs):
        assert list(out.outputs[0].token_ids) == want
        for step, top in enumerate(out.outputs[0].logprobs):
            for token, lp in top.items():
                assert abs(lp.logprob - ref[step, token].item()) < LOGPROB_ATOL, (step, token)


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_generates_what_transformers_does(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    model = _hf_model(case)
    prompts = _prompts()
    want, logprobs = hf_greedy_reference(model, prompts, MAX_TOKENS)
    src = _write(model, case, tmp_path / f"{name}.gguf")
    llm = LLM(model=str(src), **ENGINE_KW, quantization="none", block_size=4)
    ours = _model(llm)
    assert type(ours).__name__ == case.model_cls
    assert type(ours).direct_forward_supported is False
    assert llm.llm_engine.executor.driver_worker.model_runner.direct_forward is None  # the module path
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


def test_features_change_the_outputs() -> None:
    """Each setting the GGUF metadata carries changes transformers' own log-probs on these prompts, so the parity
    above holds because pagedllm read it from the file, not by accident."""
    changes = [("granite", {key: 1.0}) for key in _GRANITE_MULTIPLIERS]
    changes += [("granite", {"attention_multiplier": 0.25})]  # head_dim**-0.5, llama.cpp's default
    changes += [("olmo3", {"sliding_window": 4096}),
                ("olmo3", {"rope_parameters": {**_OLMO3_ROPE, "sliding_attention": _OLMO3_ROPE["full_attention"]}}),
                ("smollm3", {"no_rope_layers": [1] * 5})]
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


@pytest.mark.parametrize("name", ["granite", "granite-tied", "olmo3", "smollm3"])
def test_q8_linears_run_quantized(name: str, tmp_path: Path) -> None:
    """Q8_0 projections (and tied Granite's Q8_0 embedding, which its head shares) are served as int8 blocks, q/k rows
    un-permuted block row by block row. Int8 activations are not bit-exact, so the check is teacher-forced: fed the
    dequantized path's greedy continuation, the quantized model ranks that path's token first at nearly every
    position."""
    case = CASES[name]
    prompts = _prompts()
    tied = name == "granite-tied"
    src = _write(_hf_model(case), case, tmp_path / f"{name}-q8.gguf", q8_linears=True, q8_embedding=tied)
    dense = [list(o.outputs[0].token_ids)
             for o in _ours(LLM(model=str(src), **ENGINE_KW, quantization="none"), prompts)]
    llm = LLM(model=str(src), **ENGINE_KW, quantization="gguf")  # the suite's default is "none" (conftest.py)
    model = _model(llm)
    assert type(model).__name__ == case.model_cls
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.gguf_weight is not None and layer.mlp.gate_up_proj.gguf_weight is not None
    assert layer.self_attn.o_proj.gguf_weight is not None and layer.mlp.down_proj.gguf_weight is not None
    if tied:
        assert model.lm_head.gguf_weight is model.model.embed_tokens.gguf_weight is not None
    ranks = teacher_forced_ranks(llm, prompts, dense)
    assert len(ranks) == len(prompts) * MAX_TOKENS
    assert sum(r == 1 for r in ranks) >= 0.9 * len(ranks), ranks


# -- metadata llama.cpp hard-codes or reads, and clear errors -------------------------------------------------------

def _metadata_only(path: Path, arch: str, meta: Callable[[Any], None], n_layers: int = 4,
                   extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A GGUF with the metadata and the token embedding only (enough for build_config)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-6)
    meta(w)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, 64), dtype=np.float32))
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _config(path: Path) -> dict[str, Any]:
    return build_config(open_gguf(path), path).config


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


def test_tensor_names_per_architecture() -> None:
    """OLMo 2's post-norms (llama.cpp's post_attention_norm / post_ffw_norm) and whole-projection q/k norms; tensors
    an architecture does not have (OLMo 2's pre-norms, a bias on SmolLM3 or OLMo 2, q/k norms on Granite) fail naming
    the tensor and the ones the architecture has."""
    assert map_tensor_name("blk.2.post_attention_norm.weight", "olmo2") == \
        "model.layers.2.post_attention_layernorm.weight"
    assert map_tensor_name("blk.2.post_ffw_norm.weight", "olmo2") == "model.layers.2.post_feedforward_layernorm.weight"
    assert map_tensor_name("blk.0.attn_k_norm.weight", "olmo2") == "model.layers.0.self_attn.k_norm.weight"
    assert map_tensor_name("blk.1.attn_q.bias", "granite") == "model.layers.1.self_attn.q_proj.bias"
    assert map_tensor_name("blk.1.ffn_norm.weight", "smollm3") == "model.layers.1.post_attention_layernorm.weight"
    for name, arch in [("blk.0.attn_norm.weight", "olmo2"), ("blk.0.attn_q.bias", "smollm3"),
                       ("blk.0.attn_output.bias", "olmo2"), ("blk.0.attn_q_norm.weight", "granite")]:
        with pytest.raises(ValueError, match=f"Unsupported tensor '{name}' .* architecture '{arch}'"):
            map_tensor_name(name, arch)
