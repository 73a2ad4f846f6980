"""Mixture-of-experts GGUF files in llama.cpp's layout: Mixtral (architecture `llama` with `llama.expert_count`),
`qwen2moe` (with its sigmoid-gated shared expert), `qwen3moe` and `granitemoe` (Granite's multipliers far from 1).
Tiny random-weight transformers models are written as llama.cpp's converter writes them (tests/gguf_writing.py:
gguf-py's tensor names; each layer's experts merged into ffn_gate_exps / ffn_up_exps [experts, width, hidden] and
ffn_down_exps [experts, hidden, width]; Mixtral's and Granite's q/k rows permuted; Qwen2-MoE's shared-expert gate
squeezed to [hidden]; routers kept float32). pagedllm serving the file must generate what transformers generates
from the original weights, greedy tokens and log-probs, in float32. transformers 5.25 reads the qwen2moe and qwen3moe
files itself (not Mixtral's or Granite MoE's): the second, independent check of the layout there. Also served: Mixtral
files of one tensor per expert (before April 2024) and fused ffn_gate_up_exps (the converter's --fuse-gate-up-exps).

Quantized experts (Q8_0, Q4_0, Q4_1, and Q4_K from tests/gguf_writing.quantize_q4_k): served with
quantization="none" they are dequantized at load and match transformers on the dequantized weights; with
quantization="gguf" they keep their blocks (merged, fused gate_up or one tensor per expert), one GGUFWeight per expert
and projection run by the quantized linears' GEMM (int8 activations), held to the dequantized path teacher-forced, to
an int8-activation reference per row, and within 1.2x of the file's bytes. Other types (MXFP4) stay float, logged, a
projection at a time (gate / up quantized beside a float down); tensor parallelism is refused. The converted cache holds
no float copy of experts in a type served quantized (they stay in the GGUF: quantization="gguf" reads none, "none"
dequantizes them from the file); a cache written before that (float experts, no experts_in_gguf) still loads.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
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
    round_to,
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

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.gguf_quant import random_gguf_blocks
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels.cpu_quant import GGML_TYPES
from pagedllm.model.gguf_loader import get_or_convert_gguf, map_tensor_name
from pagedllm.model.layers.fused_moe import FusedMoE, select_experts

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


def _one_tensor_per_expert(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[tuple[str, np.ndarray]]]:
    """Mixtral's layout before April 2024: (the merged layout's tensors but the experts, blk.N.ffn_<proj>.E.weight
    one matrix per expert)."""
    merged = _llama_cpp_tensors(model)
    legacy = []
    for name in [n for n in merged if ".experts." in n]:
        layer, proj = int(name.split(".")[2]), name.split(".")[-2].removesuffix("_proj")
        legacy += [(f"blk.{layer}.ffn_{proj}.{e}.weight", m.numpy()) for e, m in enumerate(merged.pop(name))]
    return merged, legacy


def _fused_gate_up(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[tuple[str, np.ndarray]]]:
    """convert_hf_to_gguf's --fuse-gate-up-exps layout: (the merged layout's tensors but gate / up experts,
    ffn_gate_up_exps [experts, 2 · width, hidden] per layer, gate rows first)."""
    unfused = {k: v for k, v in _llama_cpp_tensors(model).items()
               if ".experts." not in k or k.endswith("down_proj.weight")}
    template = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.FFN_GATE_UP_EXP] + ".weight"
    fused = [(template.format(bid=layer), model.model.layers[layer].mlp.experts.gate_up_proj.detach().numpy())
             for layer in range(model.config.num_hidden_layers)]
    return unfused, fused


#: The other expert layouts: (case, how its tensors are laid out, a tensor only that layout has).
_LAYOUTS = {"one_tensor_per_expert": ("mixtral", _one_tensor_per_expert, "blk.1.ffn_down.3.weight"),
            "fused_gate_up": ("qwen3moe", _fused_gate_up, "blk.1.ffn_gate_up_exps.weight")}


def _write_layout(model: torch.nn.Module, layout: str, path: Path, **kw: Any) -> Path:
    case_name, tensors, only_here = _LAYOUTS[layout]
    case = CASES[case_name]
    state_dict, extra = tensors(model)
    src = write_gguf(model, case.arch, path, partial(case.metadata, cfg=model.config), permute_qk=case.permute_qk,
                     state_dict=state_dict, extra_tensors=extra, **kw)
    assert only_here in {t.name for t in gguf.GGUFReader(src).tensors}
    return src


def test_mixtral_one_tensor_per_expert(tmp_path: Path) -> None:
    """Mixtral files converted before April 2024 store each expert's matrices apart (blk.N.ffn_gate.E.weight …, no
    merged tensors; current llama.cpp no longer reads them): they serve the same model."""
    model = _hf_model(CASES["mixtral"])
    prompts = _prompts()
    want, logprobs = hf_greedy_reference(model, prompts, MAX_TOKENS)
    src = _write_layout(model, "one_tensor_per_expert", tmp_path / "mixtral-legacy.gguf")
    llm = LLM(model=str(src), **ENGINE_KW, quantization="none", block_size=4)
    assert type(_model(llm)).__name__ == "MixtralForCausalLM"
    _assert_matches(_ours(llm, prompts), want, logprobs)


def test_fused_gate_up_experts(tmp_path: Path) -> None:
    """convert_hf_to_gguf's --fuse-gate-up-exps stores each layer's gate and up experts as one ffn_gate_up_exps
    [experts, 2 · width, hidden] (gate rows first): served as the same model."""
    model = _hf_model(CASES["qwen3moe"])
    prompts = _prompts()[-2:]
    want, logprobs = hf_greedy_reference(model, prompts, MAX_TOKENS)
    src = _write_layout(model, "fused_gate_up", tmp_path / "fused.gguf")
    llm = LLM(model=str(src), **ENGINE_KW, quantization="none", block_size=4)
    _assert_matches(_ours(llm, prompts), want, logprobs)


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_quantized_experts_in_other_layouts(layout: str, tmp_path: Path) -> None:
    """Q8_0 experts stored one tensor per expert (old Mixtral files) or as fused ffn_gate_up_exps keep their blocks
    too, and serve what the merged layout's same blocks serve: the same greedy tokens and log-probs."""
    case = CASES[_LAYOUTS[layout][0]]
    model = _hf_model(case)
    prompts = _prompts()
    src = _write_layout(model, layout, tmp_path / f"{layout}.gguf", experts_type="Q8_0")
    merged = _write(model, case, tmp_path / "merged.gguf", experts_type="Q8_0")
    outs = []
    for path in (src, merged):
        llm = LLM(model=str(path), **ENGINE_KW, quantization="gguf", block_size=4)
        assert all(moe.w13_gguf and moe.w2_gguf and moe.w13_weight.numel() == 0 for moe in _moe_layers(llm))
        outs.append(_ours(llm, prompts))
    for ours, theirs in zip(*outs):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.outputs[0].logprobs == theirs.outputs[0].logprobs


def _rounded(model: torch.nn.Module, experts_type: str, q8_linears: bool = True) -> torch.nn.Module:
    """``model`` with the weights a quantized file stores replaced by their dequantized values, as
    write_gguf(q8_linears=..., experts_type=...) writes them: the merged experts ``experts_type``, the layers'
    matrices Q8_0 with ``q8_linears``; routers and norms float."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers" in name and (p.dim() == 3 or (p.dim() == 2 and q8_linears)) \
                    and not name.endswith((".gate.weight", ".shared_expert_gate.weight")):
                arr = p.detach().float().numpy()
                p.copy_(torch.from_numpy(round_to(arr, "Q8_0" if p.dim() == 2 else experts_type)))
    return model


def _expert_file_bytes(path: Path) -> int:
    """Bytes of the file's routed-expert tensors (ffn_*_exps)."""
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors if "_exps." in t.name)


def _moe_layers(llm: LLM) -> list[FusedMoE]:
    return [m for m in _model(llm).modules() if isinstance(m, FusedMoE)]


#: Q4_K rows are whole super-blocks of 256 values: the Qwen2-MoE case widened so that every matrix has them.
_WIDE = {"hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 256,
         "shared_expert_intermediate_size": 256}


# The widened model's Q8_0 linears alone (int8 activations, float experts) hold 116-121 of 128 positions here: its Q4_K
# experts are served beside float32 linears (which reproduce float32 exactly), so that the measure is theirs.
@pytest.mark.parametrize("experts_type,q8_linears", [("Q8_0", True), ("Q4_0", True), ("Q4_1", True),
                                                     ("Q4_K", False)])
def test_quantized_experts_served_from_blocks(experts_type: str, q8_linears: bool, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """Qwen2-MoE with quantized experts (and Q8_0 shared expert and attention, or float32 ones): with
    quantization="none" it is transformers on the dequantized weights (greedy tokens, log-probs); with
    quantization="gguf" every quantized linear and every routed expert keeps its blocks (one GGUFWeight per expert
    and projection, no float expert weights), memory stays within 1.2x of the file's tensors, and the greedy path
    holds teacher-forced at >= 95 % of 8 prompts x 16 tokens (with float experts: 96-100 % of them here)."""
    from pagedllm.kernels.cpu_quant import GGUFWeight
    from pagedllm.model.layers.linear import PackableGemm
    from pagedllm.model.layers.quantized_linear import resident_weight_bytes

    case = CASES["qwen2moe"]
    model = _hf_model(case, **(_WIDE if experts_type == "Q4_K" else {}))
    hidden, width = model.config.hidden_size, model.config.moe_intermediate_size
    prompts = _prompts((3, 7, 11, 15, 19, 23, 27, 30))
    src = _write(model, case, tmp_path / f"qwen2moe-{experts_type}.gguf", q8_linears=q8_linears,
                 experts_type=experts_type)  # 2 layers × 3 expert tensors
    want, logprobs = hf_greedy_reference(_rounded(model, experts_type, q8_linears), prompts, 16)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        dense = LLM(model=str(src), **ENGINE_KW, quantization="none", block_size=4)
    assert f"6 quantized expert tensors ({experts_type}) are dequantized to float at load" in caplog.text
    _assert_matches(_ours(dense, prompts), [w[:MAX_TOKENS] for w in want], logprobs)
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    assert torch.equal(_moe_layers(dense)[0].w13_weight.data, gate_up)  # the dequantized values, gate rows first
    _assert_cache_holds_no_experts(src)  # the float path above dequantized them from the GGUF

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(model=str(src), **ENGINE_KW, quantization="gguf", block_size=4)
    assert f"GGUF weights served quantized: {8 * q8_linears} layers and 4 routed-expert projections" in caplog.text
    assert "dequantized float copy" not in caplog.text
    layer = _model(llm).model.layers[0]
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, PackableGemm)}
    quantized = sorted(n for n, m in linears.items() if getattr(m, "gguf_weight", None) is not None)
    assert quantized == ["mlp.shared_expert.down_proj", "mlp.shared_expert.gate_up_proj", "self_attn.o_proj",
                         "self_attn.qkv_proj"][: 4 * q8_linears], quantized
    experts = _moe_layers(llm)
    held = [w for moe in experts for w in moe.w13_gguf + moe.w2_gguf]
    assert all(moe.w13_weight.numel() == moe.w2_weight.numel() == 0 for moe in experts)  # no float experts
    assert len(held) == 2 * 2 * 8 and all(isinstance(w, GGUFWeight) and w.type_name == experts_type for w in held)
    assert [(w.out_features, w.in_features) for w in held[7:9]] == [(2 * width, hidden), (hidden, width)]
    expert_bytes, file_expert_bytes = sum(w.nbytes for w in held), _expert_file_bytes(src)
    assert expert_bytes <= 1.2 * file_expert_bytes, (expert_bytes, file_expert_bytes)
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(src).tensors)
    assert resident_weight_bytes(_model(llm)) <= 1.2 * file_bytes
    ranks = teacher_forced_ranks(llm, prompts, want)
    assert sum(r == 1 for r in ranks) >= 0.95 * len(ranks), ranks


def _cache_tensor_names(src: Path) -> list[str]:
    """The tensors the converted cache of ``src`` stores."""
    from safetensors import safe_open

    files = get_or_convert_gguf(src).glob("*.safetensors")
    return [n for f in files for n in safe_open(str(f), "pt").keys()]  # noqa: SIM118 (a safe_open is not iterable)


def _cache_bytes(src: Path) -> int:
    return sum(f.stat().st_size for f in get_or_convert_gguf(src).glob("*.safetensors"))


def _assert_cache_holds_no_experts(src: Path) -> None:
    """The cache of ``src`` (its experts all of a type served quantized) stores none of them: its safetensors take
    the non-expert tensors' float32 bytes (and a header)."""
    assert not [n for n in _cache_tensor_names(src) if ".experts." in n]
    float_bytes = sum(4 * int(np.prod(t.shape)) for t in gguf.GGUFReader(src).tensors
                      if not re.match(r"blk\.\d+\.ffn_(\w+_exps|(gate|up|down)\.\d+)\.", t.name))
    assert float_bytes <= _cache_bytes(src) <= float_bytes + 64 * 1024, (_cache_bytes(src), float_bytes)


def _recording_loads(monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], list[str]]:
    """(the names the weight loads yield, the expert matrices dequantized) from now on."""
    from pagedllm.model import gguf_moe, loader

    names: list[str] = []
    dequantized: list[str] = []
    iterate, to_float = loader.iterate_weights, gguf_moe._float32

    def recording_iterate(*args: Any, **kw: Any):
        for name, tensor in iterate(*args, **kw):
            names.append(name)
            yield name, tensor

    def recording_float32(data: np.ndarray, tensor_type: Any, gguf_name: str, path: Path) -> np.ndarray:
        dequantized.append(gguf_name)
        return to_float(data, tensor_type, gguf_name, path)

    monkeypatch.setattr(loader, "iterate_weights", recording_iterate)
    monkeypatch.setattr(gguf_moe, "_float32", recording_float32)
    return names, dequantized


@pytest.mark.parametrize("layout", ["merged", *_LAYOUTS])
def test_quantized_load_reads_no_expert_tensor(layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q8_0 experts (merged, one tensor per expert, fused gate | up): the cache leaves them in the GGUF; the
    quantization="gguf" load neither reads nor dequantizes one (its experts are the GGUF's blocks); the
    quantization="none" load on the same cache dequantizes each expert matrix once, from the GGUF."""
    case = CASES["qwen3moe" if layout == "merged" else _LAYOUTS[layout][0]]
    model = _hf_model(case)
    path = tmp_path / f"{layout}.gguf"
    src = _write(model, case, path, experts_type="Q8_0") if layout == "merged" else \
        _write_layout(model, layout, path, experts_type="Q8_0")
    _assert_cache_holds_no_experts(src)
    names, dequantized = _recording_loads(monkeypatch)
    llm = LLM(model=str(src), **ENGINE_KW, quantization="gguf", block_size=4)
    assert all(moe.w13_gguf and moe.w2_gguf for moe in _moe_layers(llm))
    assert names and not [n for n in names if ".experts." in n] and not dequantized
    names.clear()
    LLM(model=str(src), **ENGINE_KW, quantization="none", block_size=4)
    n_layers, n_experts = model.config.num_hidden_layers, model.config.num_local_experts \
        if case.arch == "llama" else model.config.num_experts
    assert len([n for n in names if ".experts." in n]) == 3 * n_layers * n_experts
    per_matrix = {"merged": 3, "one_tensor_per_expert": 3, "fused_gate_up": 2}[layout]  # fused: gate | up at once
    assert len(dequantized) == per_matrix * n_layers * n_experts


def test_experts_of_two_served_types_are_row_segments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Gate experts Q8_0 beside up experts Q4_0 (both types served, w13 = gate | up in two types): each expert's w13
    is one GGUFWeight of two row segments (Q8_0 rows, then Q4_0 rows), no expert tensor is read from the cache or
    dequantized, and the greedy path holds teacher-forced at >= 95 % of the dequantized path's tokens."""
    from pagedllm.kernels.cpu_quant import SEGMENTS

    case = CASES["qwen3moe"]
    src = _write(_hf_model(case), case, tmp_path / "mixed.gguf", experts_type={"gate": "Q8_0", "up": "Q4_0",
                                                                               "down": "Q8_0"})
    _assert_cache_holds_no_experts(src)
    prompts = _prompts((3, 7, 11, 15))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    dense = LLM(model=str(src), **ENGINE_KW, quantization="none", block_size=4)
    want = [list(o.outputs[0].token_ids) for o in dense.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                 use_tqdm=False)]
    names, dequantized = _recording_loads(monkeypatch)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(model=str(src), **ENGINE_KW, quantization="gguf", block_size=4)
    assert "dequantized float copy" not in caplog.text
    for moe in _moe_layers(llm):
        assert len(moe.w13_gguf) == len(moe.w2_gguf) == 8 and moe.w13_weight.numel() == 0
        assert {(w.qtype, w.type_name, w.segments) for w in moe.w13_gguf} == {(SEGMENTS, "Q8_0+Q4_0",
                                                                               ((8, 32), (2, 32)))}
    assert not [n for n in names if ".experts." in n] and not dequantized
    ranks = teacher_forced_ranks(llm, prompts, want)
    assert sum(r == 1 for r in ranks) >= 0.95 * len(ranks), ranks


def _as_old_cache(src: Path) -> None:
    """Rewrite the cache of ``src`` as pagedllm before this change wrote it: every expert dequantized into the
    safetensors, one float32 matrix per expert, and no experts_in_gguf in the marker."""
    import json

    from gguf.quants import dequantize
    from safetensors.torch import load_file, save_file

    from pagedllm.model.gguf_loader import EXPERTS_IN_GGUF, MARKER_FILE

    cache = get_or_convert_gguf(src)
    (shard,) = cache.glob("*.safetensors")
    tensors = load_file(str(shard))
    for t in gguf.GGUFReader(src).tensors:
        if "_exps." in t.name:
            layer, proj = t.name.split(".")[1], t.name.split(".")[2].removeprefix("ffn_").removesuffix("_exps")
            for e, matrix in enumerate(np.asarray(t.data).reshape(int(t.shape[2]), int(t.shape[1]), -1)):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"
                tensors[name] = torch.from_numpy(np.array(dequantize(matrix, t.tensor_type), dtype=np.float32))
    save_file(tensors, str(shard), metadata={"format": "pt"})
    marker = json.loads((cache / MARKER_FILE).read_text())
    del marker[EXPERTS_IN_GGUF]
    (cache / MARKER_FILE).write_text(json.dumps(marker))


def test_cache_of_older_version_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """A cache converted before the experts stayed in the GGUF (float copies of the Q4_0 experts in the safetensors,
    no experts_in_gguf in the marker) is used as it is: quantization="none" loads the cache's experts, the same
    weights the GGUF's blocks dequantize to (same tokens and log-probs as the new cache), and quantization="gguf"
    does not read them (logged, with the hint to delete the cache) and serves what it served from the new cache."""
    case = CASES["qwen3moe"]
    src = _write(_hf_model(case), case, tmp_path / "old.gguf", experts_type="Q4_0")
    prompts = _prompts()[-2:]
    runs = {}
    for cache in ("new", "old"):
        if cache == "old":
            _as_old_cache(src)
            assert len([n for n in _cache_tensor_names(src) if ".experts." in n]) == 2 * 8 * 3
        for quantization in ("none", "gguf"):
            names, dequantized = _recording_loads(monkeypatch)
            with caplog.at_level(logging.INFO, logger="pagedllm"):
                llm = LLM(model=str(src), **ENGINE_KW, quantization=quantization, block_size=4)
            runs[cache, quantization] = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs)
                                         for o in _ours(llm, prompts)]
            experts_read = [n for n in names if ".experts." in n]
            assert len(experts_read) == (48 if quantization == "none" else 0)
            assert bool(dequantized) == ((cache, quantization) == ("new", "none"))
    assert runs["old", "none"] == runs["new", "none"] and runs["old", "gguf"] == runs["new", "gguf"]
    assert "Not read: 48 tensors (0.00 GiB)" in caplog.text and "delete it to reconvert" in caplog.text


@pytest.mark.parametrize("type_name", sorted(GGML_TYPES))
@pytest.mark.parametrize("rows", [1, 16])
def test_quantized_expert_gemm_matches_int8_reference(type_name: str, rows: int) -> None:
    """FusedMoE holding one GGUFWeight per expert (random blocks of each type served quantized) equals, row by row,
    the experts computed on the dequantized weights with activations rounded to int8 blocks per row, as the kernel
    rounds them (kernels/reference.gguf_linear), within the dense quantized-linear tests' tolerance."""
    from gguf.quants import dequantize

    from pagedllm.kernels import reference
    from pagedllm.kernels.cpu_quant import GGUFWeight
    from pagedllm.model.layers.activation import silu_and_mul

    qtype, experts, top_k, hidden, width = GGML_TYPES[type_name], 8, 2, 512, 256  # Q4_K: rows of 256
    moe = FusedMoE(experts, top_k, hidden, width, True, TensorParallelGroup(), torch.float32)
    dense: dict[str, list[torch.Tensor]] = {"w13": [], "w2": []}
    held: dict[str, list[GGUFWeight]] = {"w13": [], "w2": []}
    for e in range(experts):
        for attr, (n, k) in (("w13", (2 * width, hidden)), ("w2", (hidden, width))):
            raw = random_gguf_blocks(qtype, n, k, seed=qtype * 100 + 2 * e + (attr == "w2"))
            held[attr].append(GGUFWeight.from_gguf_blocks(torch.from_numpy(raw), qtype, n, k))
            dense[attr].append(torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(n, k)))
    moe.w13_gguf, moe.w2_gguf = held["w13"], held["w2"]
    gen = torch.Generator().manual_seed(qtype)
    x, logits = torch.randn(rows, hidden, generator=gen), torch.randn(rows, experts, generator=gen)
    got = moe(x, logits)
    weights, ids = select_experts(logits, top_k, True)
    want = torch.zeros_like(x)
    for t in range(rows):
        for weight, e in zip(weights[t].tolist(), ids[t].tolist()):
            h = silu_and_mul(reference.gguf_linear(x[t:t + 1], dense["w13"][e], "int8"))
            want[t] += weight * reference.gguf_linear(h, dense["w2"][e], "int8")[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_unsupported_expert_type_stays_float(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """TQ2_0 experts (ternary: no quantized kernel) under quantization="gguf": served from the converted float copy,
    and the log says which and why; the outputs are transformers' on the dequantized weights."""
    case = CASES["qwen3moe"]
    model = _hf_model(case, **_WIDE)  # TQ2_0's blocks are 256 values
    prompts = _prompts()[-2:]
    src = _write(model, case, tmp_path / "qwen3moe-tq2.gguf", experts_type="TQ2_0")
    want, logprobs = hf_greedy_reference(_rounded(model, "TQ2_0", q8_linears=False), prompts, MAX_TOKENS)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(model=str(src), **ENGINE_KW, quantization="gguf", block_size=4)
    assert ("6 quantized expert tensors (TQ2_0) are served from their dequantized float copy: type TQ2_0 is not "
            "served quantized") in caplog.text
    moe = _moe_layers(llm)[0]
    assert moe.w13_gguf is moe.w2_gguf is None and moe.w13_weight.shape == (8, 512, 256)
    assert len([n for n in _cache_tensor_names(src) if ".experts." in n]) == 2 * 8 * 3  # no kernel: float in cache
    _assert_matches(_ours(llm, prompts), want, logprobs)


def test_quantized_gate_up_beside_float_down(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Gate / up experts Q8_0 and down experts TQ2_0 (a type without a quantized kernel): w13 is served
    quantized, w2 from the float copy (logged), and the greedy path holds teacher-forced at >= 95 % of the
    dequantized path's 8 x 16 tokens."""
    case = CASES["qwen3moe"]
    src = _write(_hf_model(case, **_WIDE), case, tmp_path / "qwen3moe-mixed.gguf",
                 experts_type={"gate": "Q8_0", "up": "Q8_0", "down": "TQ2_0"})
    prompts = _prompts((3, 7, 11, 15, 19, 23, 27, 30))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    dense = LLM(model=str(src), **ENGINE_KW, quantization="none", block_size=4)
    want = [list(o.outputs[0].token_ids) for o in dense.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                 use_tqdm=False)]
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(model=str(src), **ENGINE_KW, quantization="gguf", block_size=4)
    assert "2 quantized expert tensors (TQ2_0) are served from their dequantized float copy" in caplog.text
    for moe in _moe_layers(llm):
        assert len(moe.w13_gguf) == 8 and moe.w13_weight.numel() == 0
        assert moe.w2_gguf is None and moe.w2_weight.shape == (8, 256, 256)
    ranks = teacher_forced_ranks(llm, prompts, want)
    assert sum(r == 1 for r in ranks) >= 0.95 * len(ranks), ranks


def test_quantized_experts_refuse_tensor_parallelism(tmp_path: Path) -> None:
    """Quantized experts run on one rank: tensor parallelism is a clear error naming quantization='none'."""
    from pagedllm.model.layers.quantized_linear import attach_gguf_experts

    model = torch.nn.Module()
    model.experts = FusedMoE(4, 2, 64, 32, True, SimpleNamespace(size=2, rank=0), torch.float32)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=1\); use quantization='none'"):
        attach_gguf_experts(model, tmp_path / "never-read.gguf")


def test_quantized_experts_survive_preemption(tmp_path: Path) -> None:
    """Q4_0 experts served quantized in a pool too small for the four sequences at once: requests are preempted and
    recomputed, and every greedy output equals the unpreempted run's."""
    case = CASES["qwen3moe"]
    src = _write(_hf_model(case), case, tmp_path / "qwen3moe-q4.gguf", q8_linears=True, experts_type="Q4_0")
    prompts = _prompts()
    kw = {**ENGINE_KW, "quantization": "gguf", "block_size": 4}
    roomy = [list(o.outputs[0].token_ids) for o in _ours(LLM(model=str(src), **kw), prompts)]
    small = LLM(model=str(src), **{**kw, "num_gpu_blocks_override": 10, "max_model_len": 40})
    assert [list(o.outputs[0].token_ids) for o in _ours(small, prompts)] == roomy
    assert small.stats()["num_preemptions"] > 0


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
