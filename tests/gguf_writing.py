"""Tiny random-weight transformers models written as GGUF files in llama.cpp's layout, and the greedy runs the GGUF
tests compare (shared by tests/test_gguf_qwen.py and tests/test_gguf_gemma_phi3.py).

Tensor names come from gguf-py's own HF → GGUF map (``gguf.get_tensor_name_map``, the one llama.cpp's converter
uses), so the layout written does not depend on pagedllm's reverse mapping.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable, Iterable, Mapping

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.gguf_quant import copy_gguf_tokenizer

gguf = pytest.importorskip("gguf")

#: What the GGUF tests' LLMs share: small pools, token-id prompts, float32 on the CPU.
ENGINE_KW = dict(skip_tokenizer_init=True, num_gpu_blocks_override=32, max_model_len=128, device="cpu",
                 swap_space=0.01)


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test converts into its own cache directory."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))


def gguf_tensor_names(arch: str, n_layers: int) -> Callable[[str], str]:
    """llama.cpp's name for each HF parameter name of a model of llama.cpp architecture ``arch``."""
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(model_arch, n_layers)

    def name(hf_name: str) -> str:
        module, kind = hf_name.rsplit(".", 1)
        mapped = name_map.get_name(module)
        if mapped is None:
            raise KeyError(f"gguf-py has no {arch} tensor for {hf_name!r}")
        return f"{mapped}.{kind}"

    return name


def add_shape_metadata(w, cfg, rope_base: bool = True, head_dim: bool = True) -> None:
    """The shape keys every converter writes; ``rope_base``/``head_dim``: also rope.freq_base / key and value length
    (Gemma 1 and 2's converters write neither base; Phi-3's writes no head length)."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if head_dim:
        size = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_key_length(size)
        w.add_value_length(size)
    if rope_base:
        params = getattr(cfg, "rope_parameters", None) or {}
        params = params.get("full_attention", params)
        w.add_rope_freq_base(params.get("rope_theta", getattr(cfg, "rope_theta", None)))


def copy_tokenizer(w, source: Path) -> None:
    """The tokenizer metadata (BPE tokens, merges, special ids, chat template) of another GGUF file."""
    copy_gguf_tokenizer(w, source)


def llama_cpp_permute(arr: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's ``LlamaModel.permute`` (HF's rotate-half rows per head → interleaved pairs), for the
    q/k weights and biases of the architectures whose RoPE llama.cpp runs interleaved (llama, granite, smollm3)."""
    return arr.reshape(n_head, 2, arr.shape[0] // n_head // 2, *arr.shape[1:]).swapaxes(1, 2).reshape(arr.shape)


#: Routed-expert tensor names (group 1: the projection): merged or fused (``ffn_<proj>_exps``), or one per expert.
_EXPERT_TENSOR = re.compile(r"^blk\.\d+\.ffn_(gate_up|gate|up|down)(_exps|\.\d+)\.weight$")


def _expert_type(gguf_name: str, experts_type: str | Mapping[str, str] | None) -> str | None:
    """The GGUF type write_gguf stores a routed-expert tensor in (None: not one, or left float)."""
    m = _EXPERT_TENSOR.match(gguf_name)
    if m is None or experts_type is None or isinstance(experts_type, str):
        return experts_type if m is not None else None
    return experts_type.get(m[1])


def _nonzero(v: np.ndarray) -> np.ndarray:
    """float32 column [n, 1] of ``v`` with zeros replaced by 1 (a divisor for all-zero blocks)."""
    return np.where(v == 0, 1, v).astype(np.float32)[:, None]


def _k_quant_fit(arr: np.ndarray, qmax: int) -> tuple[np.ndarray, ...]:
    """The scale / minimum fit Q4_K and Q5_K share: per super-block of 256 an fp16 scale d and minimum dmin, per 32
    values 6-bit multiples sc, m of them (packed as ggml's get_scale_min_k4 reads them) and quants q in [0, qmax],
    w = d·sc·q − dmin·m → (d, dmin, packed scales, q [super-blocks, 8, 32]). A plain min / max fit (llama.cpp
    searches the scales); the tests only need valid blocks near the weights."""
    x = arr.astype(np.float32).reshape(-1, 8, 32)  # [super-blocks, sub-blocks, values]
    lo = np.minimum(x.min(axis=2), 0)
    scale, mins = (x.max(axis=2) - lo) / qmax, -lo
    d = (scale.max(axis=1) / 63).astype(np.float16)
    dmin = (mins.max(axis=1) / 63).astype(np.float16)
    sc = np.clip(np.rint(scale / _nonzero(d)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(mins / _nonzero(dmin)), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = (dmin.astype(np.float32)[:, None] * m)[:, :, None]
    q = np.clip(np.rint((x + offset) / np.where(step == 0, 1, step)[:, :, None]), 0, qmax).astype(np.uint8)
    scales = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
    return d, dmin, scales, q


def quantize_q4_k(arr: np.ndarray) -> np.ndarray:
    """Q4_K blocks (uint8 [..., row_bytes]) of float rows whose length is a multiple of 256, which gguf-py cannot
    write: :func:`_k_quant_fit` with 4-bit quants."""
    d, dmin, scales, q = _k_quant_fit(arr, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # each 64 values: low nibbles, then high
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1)
    return blocks.reshape(*arr.shape[:-1], arr.shape[-1] // 256 * 144)


def quantize_q5_k(arr: np.ndarray) -> np.ndarray:
    """Q5_K blocks of float rows whose length is a multiple of 256 (gguf-py cannot write them): :func:`_k_quant_fit`
    with 5-bit quants, the fifth bits of each 32 values in qh (bit j: sub-block j)."""
    d, dmin, scales, q = _k_quant_fit(arr, 31)
    low = q & 15
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    qh = np.bitwise_or.reduce(((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None], axis=1).astype(np.uint8)
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qh, qs],
                            axis=1)
    return blocks.reshape(*arr.shape[:-1], arr.shape[-1] // 256 * 176)


def quantize_q6_k(arr: np.ndarray) -> np.ndarray:
    """Q6_K blocks of float rows whose length is a multiple of 256 (gguf-py cannot write them): per 16 values an int8
    multiple sc of the super-block's fp16 d, 6-bit quants q, w = d·sc·(q − 32); value 128h + 64s + l keeps its low
    nibble in ql[64h + l] (shifted 4s) and its high 2 bits in qh[32h + l % 32] (shifted 2·((64s + l) // 32))."""
    x = arr.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(axis=2) / 31
    d = (scale.max(axis=1) / 127).astype(np.float16)
    sc = np.clip(np.rint(scale / _nonzero(d)), -128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.rint(x / np.where(step == 0, 1, step)[:, :, None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 128)  # [super-blocks, h, r]
    low, high = q & 15, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)
    qh = np.bitwise_or.reduce(high.reshape(-1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None],
                              axis=2).astype(np.uint8).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=1)
    return blocks.reshape(*arr.shape[:-1], arr.shape[-1] // 256 * 210)


def quantize_to(arr: np.ndarray, type_name: str) -> np.ndarray:
    """The GGUF blocks of ``arr`` in type ``type_name`` (gguf-py's quantizers: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; Q4_K,
    Q5_K, Q6_K: :func:`quantize_q4_k`, :func:`quantize_q5_k`, :func:`quantize_q6_k`)."""
    if type_name == "Q4_K":
        return quantize_q4_k(arr)
    if type_name == "Q5_K":
        return quantize_q5_k(arr)
    if type_name == "Q6_K":
        return quantize_q6_k(arr)
    return gguf.quants.quantize(arr, gguf.GGMLQuantizationType[type_name])


def round_to(arr: np.ndarray, type_name: str) -> np.ndarray:
    """``arr`` as a file of GGUF type ``type_name`` stores it: quantized (:func:`quantize_to`), then dequantized."""
    qtype = gguf.GGMLQuantizationType[type_name]
    return gguf.quants.dequantize(quantize_to(arr, type_name), qtype).reshape(arr.shape)


def write_gguf(model: torch.nn.Module, arch: str, path: Path, metadata: Callable[[object], None], *,
               norm_offset: float = 0.0, q8_linears: bool = False, q8_embedding: bool = False,
               tokenizer: Callable[[object], None] | None = None,
               extra_tensors: Iterable[tuple[str, np.ndarray]] = (), permute_qk: bool = False,
               state_dict: Mapping[str, torch.Tensor] | None = None,
               experts_type: str | Mapping[str, str] | None = None,
               tensor_type: Callable[[str], str | None] | None = None) -> Path:
    """``model`` as llama.cpp's converter stores it for ``arch``: ``metadata(writer)`` writes the architecture's
    keys; ``norm_offset`` is added to every ``*norm.weight`` (Gemma's converters add 1); a tied ``lm_head`` is not
    stored; ``q8_linears``: the layers' 2-D weights as Q8_0 blocks (``q8_embedding``: the embedding too), the rest
    float32; ``tokenizer(writer)`` writes the tokenizer keys (default: a token list of the vocabulary's size, which
    transformers reads the vocabulary size from); ``extra_tensors``: more (GGUF name, array) pairs; ``permute_qk``:
    q_proj / k_proj weights and biases permuted as llama.cpp's Llama converter does (:func:`llama_cpp_permute`);
    ``state_dict``: the HF-named tensors to write instead of the model's own (a converter's reshaped or stacked ones,
    named as gguf-py's map knows them); ``experts_type``: routed-expert tensors (ffn_<proj>_exps, also fused
    ffn_gate_up_exps and Mixtral's old blk.N.ffn_<proj>.E among ``extra_tensors``) as blocks of this type
    (:func:`quantize_to`), or of the type named per projection ({"gate": ..., "up": ..., "down": ...});
    ``tensor_type(gguf_name)``: the type of each other 2-D tensor (None: as the flags say), e.g. a Q4_K_M-like mix."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    metadata(w)
    if tokenizer is not None:
        tokenizer(w)
    else:
        w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    to_gguf = gguf_tensor_names(arch, cfg.num_hidden_layers)
    for name, tensor in (model.state_dict() if state_dict is None else state_dict).items():
        if name == "lm_head.weight" and tied:
            continue
        arr = tensor.float().numpy()
        if norm_offset and name.endswith("norm.weight"):
            arr = arr + np.float32(norm_offset)
        if permute_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = llama_cpp_permute(arr, cfg.num_attention_heads)
        elif permute_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        gguf_name = to_gguf(name)
        # the converter keeps norms F32 (StableLM's 2-D per-head ones), and MoE routers
        keep_f32 = gguf_name.endswith(("_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"))
        q8 = arr.ndim == 2 and not keep_f32 and ((q8_linears and "layers" in name)
                                                 or (q8_embedding and "embed_tokens" in name))
        chosen = tensor_type(gguf_name) if tensor_type is not None and arr.ndim == 2 and not keep_f32 else None
        _add_tensor(w, gguf_name, arr, chosen or ("Q8_0" if q8 else _expert_type(gguf_name, experts_type)))
    for gguf_name, arr in extra_tensors:
        _add_tensor(w, gguf_name, arr, _expert_type(gguf_name, experts_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_tensor(w, gguf_name: str, arr: np.ndarray, type_name: str | None) -> None:
    """``arr`` as float (``type_name`` None) or as blocks of GGUF type ``type_name``."""
    if type_name is None:
        w.add_tensor(gguf_name, arr)
    else:
        w.add_tensor(gguf_name, quantize_to(arr, type_name), raw_dtype=gguf.GGMLQuantizationType[type_name])


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding), never stopping early."""
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                                 pad_token_id=0, eos_token_id=None)
            out.append(seq[0, len(p):].tolist())
    return out


def ours_greedy(path: Path, prompts: list[list[int]], max_tokens: int, **kw) -> list[list[int]]:
    """pagedllm's greedy continuation of each prompt, served from the GGUF file ``path``."""
    llm = LLM(model=str(path), **{**ENGINE_KW, **kw})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def teacher_forced_ranks(llm: LLM, prompts: list[list[int]], continuations: list[list[int]]) -> list[int]:
    """The rank ``llm`` gives each token of ``continuations`` when fed prompt + continuation (1: its top choice)."""
    forced = [p + c for p, c in zip(prompts, continuations)]
    outs = llm.generate([{"prompt_token_ids": f} for f in forced],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [o.prompt_logprobs[i][f[i]].rank for o, f, p in zip(outs, forced, prompts) for i in range(len(p), len(f))]
