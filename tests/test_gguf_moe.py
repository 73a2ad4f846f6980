"""Mixture-of-experts GGUF files in llama.cpp's layout: Mixtral (architecture `llama` with `llama.expert_count`),
`qwen2moe` (with its sigmoid-gated shared expert), `qwen3moe` and `granitemoe` (Granite's multipliers far from 1).
Tiny random-weight transformers models are written as llama.cpp's converter writes them (tests/gguf_writing.py:
gguf-py's tensor names; each layer's experts merged into ffn_gate_exps / ffn_up_exps [experts, width, hidden] and
ffn_down_exps [experts, hidden, width]; Mixtral's and Granite's q/k rows permuted; Qwen2-MoE's shared-expert gate
squeezed to [hidden]; routers kept float32). pagedllm serving the file must generate what transformers generates
from the original weights, greedy tokens and log-probs, in float32. transformers 5.25 reads the qwen2moe and qwen3moe
files itself (not Mixtral's or Granite MoE's): the second, independent check of the layout there. Also served: Mixtral
files of one tensor per expert (before April 2024) and fused ffn_gate_up_exps (the converter's --fuse-gate-up-exps).

Q8_0 experts are dequantized at load (FusedMoE has no quantized kernel yet): a Q8_0 file served with
quantization="none" matches transformers on the dequantized weights; with quantization="gguf" its dense linears keep
their int8 blocks and the experts run in float.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import transformers
from gguf_writing import (
    ENGINE_KW,
    add_shape_metadata,
    gguf,
    hf_greedy,
    own_cache,  # noqa: F401 (autouse fixture: a cache directory per test)
    teacher_forced_ranks,
    write_gguf,
)
from test_gguf_gemma_phi3 import (  # same MAX_TOKENS and LOGPROB_ATOL
    _assert_matches,
    _config,
    _model,
    _ours,
)
from test_gguf_gemma_phi3 import _metadata_only as _gemma_phi3_metadata_only
from test_gguf_more_families import _prompts, _transformers_from_gguf  # same VOCAB and PROMPT_LENS
from test_models_hf import hf_greedy_reference

from pagedllm import LLM
from pagedllm.model.gguf_loader import get_or_convert_gguf, map_tensor_name

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

VOCAB = 512
MAX_TOKENS = 10
PROMPT_LENS = (3, 11, 19, 30)
_SHAPE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
          "rms_norm_eps": 1e-6, "attn_implementation": "eager"}
# As tests/test_gguf_more_families.py: far from 1 (and from head_dim**-0.5 = 0.25), clear top-2 logit margins.
_GRANITE_MULTIPLIERS = {"embedding_multiplier": 4.0, "residual_multiplier": 0.4, "attention_multiplier": 0.09,
                        "logits_scaling": 2.5}


# -- what each llama.cpp converter writes (LlamaModel / GraniteMoeModel / Qwen2MoeModel.set_gguf_parameters) ---------

def _experts_meta(w, cfg) -> None:
    """TextModel.set_gguf_parameters: expert_count and expert_used_count."""
    w.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)


def _mixtral_meta(w, cfg) -> None:
    """LlamaModel: the shape keys (feed_forward_length is the experts' width), vocabulary size, whole-head RoPE."""
    add_shape_metadata(w, cfg, head_dim=False)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    _experts_meta(w, cfg)


def _granitemoe_meta(w, cfg) -> None:
    _mixtral_meta(w, cfg)
    w.add_attention_scale(cfg.attention_multiplier)
    w.add_embedding_scale(cfg.embedding_multiplier)
    w.add_residual_scale(cfg.residual_multiplier)
    w.add_logit_scale(cfg.logits_scaling)


def _qwen_moe_meta(w, cfg, width: int | None = None) -> None:
    """Qwen2MoeModel (Qwen3MoeModel inherits it): the experts' (or ``width``) and the shared expert's widths."""
    add_shape_metadata(w, cfg)
    _experts_meta(w, cfg)
    w.add_expert_feed_forward_length(width or cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _llama_cpp_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' fused experts (gate_up_proj [E, 2·I, H], gate rows first; down_proj [E, H, I]) as llama.cpp's
    merged gate / up / down tensors, under the names gguf-py maps to ffn_{gate,up,down}_exps and ffn_gate_inp;
    Qwen2-MoE's shared-expert gate squeezed to [H] (llama.cpp's {n_embd})."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        name = name.replace(".block_sparse_moe.router.", ".mlp.gate.").replace(".block_sparse_moe.", ".mlp.")
        if name.endswith(".experts.gate_up_proj"):
            width = t.shape[1] // 2
            out[f"{name[: -len('gate_up_proj')]}gate_proj.weight"] = t[:, :width]
            out[f"{name[: -len('gate_up_proj')]}up_proj.weight"] = t[:, width:]
        elif name.endswith(".experts.down_proj"):
            out[f"{name}.weight"] = t
        elif name.endswith(".shared_expert_gate.weight"):
            out[name] = t.reshape(-1)
        else:
            out[name] = t
    return out


@dataclass(frozen=True)
class Case:
    arch: str  # llama.cpp's architecture name
    config_cls: str
    model_cls: str
    kwargs: dict
    metadata: Callable[[Any, Any], None]
    permute_qk: bool = False
    #: config fields transformers' GGUF reader does not take from the file (transformers 5.25 reads no expert widths;
    #: None: it cannot read the architecture)
    transformers_overrides: dict | None = None


CASES: dict[str, Case] = {
    # 4 experts of width 32, top 2 renormalized; q/k permuted (Llama's converter), an untied head.
    "mixtral": Case("llama", "MixtralConfig", "MixtralForCausalLM", {
        **_SHAPE, "intermediate_size": 32, "num_hidden_layers": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
        _mixtral_meta, permute_qk=True),
    # q/k/v biases, 8 experts of width 32, top 2 not renormalized, a shared expert of 64 (≠ feed_forward_length 96).
    "qwen2moe": Case("qwen2moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        **_SHAPE, "intermediate_size": 96, "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "norm_topk_prob": False},
        _qwen_moe_meta, transformers_overrides={"moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}),
    # Per-head q/k norms, head_dim 32 ≠ hidden / heads, 8 experts top 2 renormalized (llama.cpp hard-codes it, and
    # transformers' GGUF reader sets it for qwen3moe files too).
    "qwen3moe": Case("qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        **_SHAPE, "head_dim": 32, "intermediate_size": 96, "num_hidden_layers": 2, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
        _qwen_moe_meta, transformers_overrides={"moe_intermediate_size": 32}),
    # Granite's four multipliers over 4 experts of width 32 (top 2 of the logits, softmaxed), tied head, 3 layers.
    "granitemoe": Case("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM", {
        **_SHAPE, **_GRANITE_MULTIPLIERS, "intermediate_size": 32, "num_hidden_layers": 3, "num_local_experts": 4,
        "num_experts_per_tok": 2, "tie_word_embeddings": True}, _granitemoe_meta, permute_qk=True),
}


def _hf_model(case: Case, **overrides: Any) -> torch.nn.Module:
    """transformers' init at std 0.1 (clear top-2 margins), then 1-D weights (biases, norms) moved off 0 / 1."""
    config = getattr(transformers, case.config_cls)(vocab_size=VOCAB, initializer_range=0.1,
                                                    **{**case.kwargs, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, case.model_cls)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None
    return model


def _write(model: torch.nn.Module, case: Case, path: Path, **kw: Any) -> Path:
    return write_gguf(model, case.arch, path, partial(case.metadata, cfg=model.config), permute_qk=case.permute_qk,
                      state_dict=_llama_cpp_tensors(model), **kw)


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
    assert type(_model(llm)).__name__ == case.model_cls
    _assert_matches(_ours(llm, prompts), want, logprobs)


def test_mixtral_one_tensor_per_expert(tmp_path: Path) -> None:
    """Mixtral files converted before April 2024 store each expert's matrices apart (blk.N.ffn_gate.E.weight …, no
    merged tensors; current llama.cpp no longer reads them): they serve the same model."""
    case = CASES["mixtral"]
    model = _hf_model(case)
    prompts = _prompts()
    want, logprobs = hf_greedy_reference(model, prompts, MAX_TOKENS)
    merged = _llama_cpp_tensors(model)
    legacy = []
    for name in [n for n in merged if ".experts." in n]:
        layer, proj = int(name.split(".")[2]), name.split(".")[-2].removesuffix("_proj")
        legacy += [(f"blk.{layer}.ffn_{proj}.{e}.weight", m.numpy()) for e, m in enumerate(merged.pop(name))]
    src = write_gguf(model, "llama", tmp_path / "mixtral-legacy.gguf", partial(case.metadata, cfg=model.config),
                     permute_qk=True, state_dict=merged, extra_tensors=legacy)
    assert "blk.1.ffn_down.3.weight" in {t.name for t in gguf.GGUFReader(src).tensors}
    llm = LLM(model=str(src), **ENGINE_KW, quantization="none", block_size=4)
    assert type(_model(llm)).__name__ == "MixtralForCausalLM"
    _assert_matches(_ours(llm, prompts), want, logprobs)


def test_fused_gate_up_experts(tmp_path: Path) -> None:
    """convert_hf_to_gguf's --fuse-gate-up-exps stores each layer's gate and up experts as one ffn_gate_up_exps
    [experts, 2 · width, hidden] (gate rows first): served as the same model."""
    case = CASES["qwen3moe"]
    model = _hf_model(case)
    prompts = _prompts()[-2:]
    want, logprobs = hf_greedy_reference(model, prompts, MAX_TOKENS)
    unfused = {k: v for k, v in _llama_cpp_tensors(model).items()
               if ".experts." not in k or k.endswith("down_proj.weight")}
    template = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_UP_EXP] + ".weight"
    fused = [(template.format(bid=layer), model.model.layers[layer].mlp.experts.gate_up_proj.detach().numpy())
             for layer in range(model.config.num_hidden_layers)]
    src = write_gguf(model, "qwen3moe", tmp_path / "fused.gguf", partial(case.metadata, cfg=model.config),
                     state_dict=unfused, extra_tensors=fused)
    assert "blk.1.ffn_gate_up_exps.weight" in {t.name for t in gguf.GGUFReader(src).tensors}
    llm = LLM(model=str(src), **ENGINE_KW, quantization="none", block_size=4)
    _assert_matches(_ours(llm, prompts), want, logprobs)


def _q8_rounded(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with the weights a Q8_0 file stores (every 2-D or 3-D layer weight but routers and norms) replaced
    by their dequantized Q8_0 values, as write_gguf(q8_linears=True, q8_experts=True) writes them."""
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers" in name and p.dim() >= 2 and not name.endswith((".gate.weight", ".shared_expert_gate.weight")):
                arr = p.detach().float().numpy()
                p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(arr, q8), q8).reshape(arr.shape)))
    return model


def test_q8_experts_dequantized_at_load(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Qwen2-MoE with Q8_0 experts, shared expert and attention: with quantization="none" it is transformers on the
    dequantized weights (greedy tokens, log-probs); with quantization="gguf" the attention and shared-expert linears
    keep their Q8_0 blocks, the routed experts run in float (one log line says so) and the greedy path holds
    teacher-forced at nearly every position."""
    from pagedllm.model.layers.linear import PackableGemm

    case = CASES["qwen2moe"]
    model = _hf_model(case)
    prompts = _prompts()
    src = _write(model, case, tmp_path / "qwen2moe-q8.gguf", q8_linears=True, q8_experts=True)  # 2 layers × 3
    want, logprobs = hf_greedy_reference(_q8_rounded(model), prompts, MAX_TOKENS)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        dense = LLM(model=str(src), **ENGINE_KW, quantization="none", block_size=4)
    assert "6 quantized expert tensors (Q8_0) are dequantized to float at load" in caplog.text
    _assert_matches(_ours(dense, prompts), want, logprobs)

    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(model=str(src), **ENGINE_KW, quantization="gguf", block_size=4)
    assert "the 6 quantized expert tensors (Q8_0) are served from their dequantized float copy" in caplog.text
    layer = _model(llm).model.layers[0]
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, PackableGemm)}
    quantized = sorted(n for n, m in linears.items() if getattr(m, "gguf_weight", None) is not None)
    assert quantized == ["mlp.shared_expert.down_proj", "mlp.shared_expert.gate_up_proj", "self_attn.o_proj",
                         "self_attn.qkv_proj"], quantized
    assert layer.mlp.experts.w13_weight.dtype == torch.float32
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    assert torch.equal(layer.mlp.experts.w13_weight.data, gate_up)  # the dequantized Q8_0 values, gate rows first
    ranks = teacher_forced_ranks(llm, prompts, want)
    assert sum(r == 1 for r in ranks) >= 0.9 * len(ranks), ranks


def test_config_from_metadata(tmp_path: Path) -> None:
    """What build_config reads from each file: the MoE class, expert count, top-k, widths, the routing
    renormalization llama.cpp hard-codes per architecture, Granite's multipliers."""
    configs = {name: _config(_write(_hf_model(case), case, tmp_path / f"{name}.gguf")) for name, case in CASES.items()}
    mixtral = configs["mixtral"]
    assert (mixtral["architectures"], mixtral["model_type"]) == (["MixtralForCausalLM"], "mixtral")
    assert (mixtral["num_local_experts"], mixtral["num_experts_per_tok"], mixtral["intermediate_size"]) == (4, 2, 32)
    assert not mixtral["tie_word_embeddings"]
    qwen2 = configs["qwen2moe"]
    assert (qwen2["architectures"], qwen2["model_type"]) == (["Qwen2MoeForCausalLM"], "qwen2_moe")
    assert (qwen2["num_experts"], qwen2["num_experts_per_tok"], qwen2["moe_intermediate_size"]) == (8, 2, 32)
    assert (qwen2["shared_expert_intermediate_size"], qwen2["norm_topk_prob"]) == (64, False)
    assert (qwen2["decoder_sparse_step"], qwen2["mlp_only_layers"]) == (1, [])
    qwen3 = configs["qwen3moe"]
    assert (qwen3["architectures"], qwen3["head_dim"], qwen3["norm_topk_prob"]) == (["Qwen3MoeForCausalLM"], 32, True)
    assert (qwen3["num_experts"], qwen3["moe_intermediate_size"]) == (8, 32)
    assert qwen3["shared_expert_intermediate_size"] == 0
    granite = configs["granitemoe"]
    assert (granite["architectures"], granite["num_local_experts"]) == (["GraniteMoeForCausalLM"], 4)
    assert {k: granite[k] for k in _GRANITE_MULTIPLIERS} == pytest.approx(_GRANITE_MULTIPLIERS)
    assert granite["tie_word_embeddings"]


def test_features_change_the_outputs() -> None:
    """What the files leave to llama.cpp's per-architecture rules, and what they say, changes transformers' own
    log-probs here: Qwen's top-k renormalization either way, Mixtral's top-k, Granite MoE's multipliers; so the parity
    above checks pagedllm reads them."""
    changes = [("qwen2moe", {"norm_topk_prob": True}), ("qwen3moe", {"norm_topk_prob": False}),
               ("mixtral", {"num_experts_per_tok": 1})]
    changes += [("granitemoe", {key: 1.0}) for key in _GRANITE_MULTIPLIERS]
    prompts = _prompts()[-1:]
    for name, off in changes:
        _, want = hf_greedy_reference(_hf_model(CASES[name]), prompts, MAX_TOKENS)
        _, got = hf_greedy_reference(_hf_model(CASES[name], **off), prompts, MAX_TOKENS)
        assert (got[0] - want[0]).abs().max() > 1e-3, (name, off)


# -- metadata llama.cpp hard-codes or reads, and clear errors -------------------------------------------------------

_ROUTER = {"blk.0.ffn_gate_inp.weight": np.zeros((8, 64), dtype=np.float32)}
_SHEXP = {"blk.0.ffn_gate_shexp.weight": np.zeros((64, 64), dtype=np.float32)}


def _metadata_only(path: Path, arch: str, meta: Callable[[Any], None], tensors: dict[str, np.ndarray] | None = None,
                   **kw: Any) -> Path:
    """The metadata, the token embedding and ``tensors`` (default: a router of 8 experts), feed_forward_length 128."""
    return _gemma_phi3_metadata_only(path, arch, meta, extra_tensors=_ROUTER if tensors is None else tensors, **kw)


def _experts(n: int, used: int) -> Callable[[Any], None]:
    return lambda w: (w.add_expert_count(n), w.add_expert_used_count(used))


def test_moe_metadata_defaults_as_llama_cpp(tmp_path: Path) -> None:
    """Where a file is silent: Qwen's expert width is feed_forward_length / expert_used_count and its shared expert
    feed_forward_length wide (llama_model_qwen2moe / qwen3moe); a `llama` file without experts stays Llama."""
    qwen3 = _config(_metadata_only(tmp_path / "q3.gguf", "qwen3moe", _experts(8, 2)))
    assert (qwen3["moe_intermediate_size"], qwen3["shared_expert_intermediate_size"]) == (64, 0)
    qwen2 = _config(_metadata_only(tmp_path / "q2.gguf", "qwen2moe", _experts(8, 4), {**_ROUTER, **_SHEXP}))
    assert (qwen2["moe_intermediate_size"], qwen2["shared_expert_intermediate_size"]) == (32, 128)
    dense = _config(_metadata_only(tmp_path / "l.gguf", "llama", lambda w: None, {}))
    assert dense["architectures"] == ["LlamaForCausalLM"] and "num_local_experts" not in dense


def test_bad_moe_files_are_clear_errors(tmp_path: Path) -> None:
    def fails(path: Path, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            _config(path)

    fails(_metadata_only(tmp_path / "a.gguf", "llama", lambda w: None),
          r"llama.expert_count is missing or 0 \(it has expert tensors\)")
    fails(_metadata_only(tmp_path / "b.gguf", "qwen3moe", lambda w: w.add_expert_used_count(2)),
          "qwen3moe.expert_count is missing or 0")
    fails(_metadata_only(tmp_path / "c.gguf", "qwen2moe", lambda w: w.add_expert_count(8)),
          r"qwen2moe.expert_used_count = missing; it must lie in \[1, qwen2moe.expert_count = 8\]")
    fails(_metadata_only(tmp_path / "d.gguf", "granitemoe", lambda w: (_experts(2, 4)(w), w.add_logit_scale(1.0))),
          "expert_used_count = 4")
    fails(_metadata_only(tmp_path / "e.gguf", "qwen3moe", _experts(8, 2), {}), "no router tensor")
    fails(_metadata_only(tmp_path / "f.gguf", "granitemoe", lambda w: (
        _experts(8, 2)(w), w.add_logit_scale(1.0)), {**_ROUTER, **_SHEXP}), "Granite MoE with a shared expert")
    with pytest.raises(ValueError, match="Unsupported tensor 'blk.3.ffn_gate.7.weight'"):
        map_tensor_name("blk.3.ffn_gate.7.weight", "qwen3moe")  # one tensor per expert: Mixtral's old files only


def test_mismatched_expert_tensors_are_clear_errors(tmp_path: Path) -> None:
    """Expert tensors whose shape disagrees with the metadata (here: the width the file names) fail the conversion
    naming the tensor and the shape expected; so does an expert count the tensors do not have."""
    model = _hf_model(CASES["qwen3moe"])
    src = write_gguf(model, "qwen3moe", tmp_path / "width.gguf", partial(_qwen_moe_meta, cfg=model.config, width=48),
                     state_dict=_llama_cpp_tensors(model))
    with pytest.raises(ValueError, match=r"'blk.0.ffn_\w+_exps.weight' has shape \[8, \d+, \d+\].*expected \[8, "
                                         r"(48, 64|64, 48)\]"):
        get_or_convert_gguf(src)
    src = write_gguf(model, "qwen3moe", tmp_path / "count.gguf", partial(_qwen_moe_meta, cfg=model.config),
                     state_dict={k: v[:6] if ".experts." in k else v for k, v in _llama_cpp_tensors(model).items()})
    with pytest.raises(ValueError, match=r"has shape \[6, .*expected \[8, "):
        get_or_convert_gguf(src)
