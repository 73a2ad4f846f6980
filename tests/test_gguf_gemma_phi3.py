"""GGUF files of llama.cpp's `gemma`, `gemma2`, `gemma3` and `phi3` architectures: tiny random-weight transformers
models written in llama.cpp's layout (tests/gguf_writing.py: gguf-py's tensor names, Gemma's norms stored with +1,
Phi-3's fused attn_qkv and gate|up ffn_up, no output.weight where the head is tied, the metadata keys each of
llama.cpp's converters writes). pagedllm serving the file must generate what transformers generates from the
original weights, greedy tokens and log-probs, in float32; transformers reading the same file (gemma2, gemma3, phi3:
it cannot read gemma) is the independent check of the layout written.

The tiny configs make each feature bite (test_features_change_the_outputs): windows of 8 tokens under prompts of up
to 30, soft caps below the score and logit ranges, head_dim (32) apart from hidden / heads (16) and so the query
scale apart from transformers' default query_pre_attn_scalar (256), Gemma 3's local and global RoPE (the global one
linearly scaled), Phi-3's window and LongRoPE.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import transformers
from gguf_writing import ENGINE_KW as _GGUF_ENGINE_KW
from gguf_writing import add_shape_metadata, gguf, hf_greedy, teacher_forced_ranks, write_gguf
from gguf_writing import own_cache  # noqa: F401 (autouse fixture: a cache directory per test)
from test_models_hf import hf_greedy_reference

from pagedllm import LLM, SamplingParams
from pagedllm.model.gguf_config import build_config
from pagedllm.model.gguf_loader import gguf_cache_dir, open_gguf, transformers_dense_gguf_kwargs

# Gemma 3's hybrid KV cache (core/kv_cache_groups.py) counts blocks of one group's layers: a pool of more of them.
ENGINE_KW = {**_GGUF_ENGINE_KW, "num_gpu_blocks_override": 128}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

VOCAB = 512
MAX_TOKENS = 10
WINDOW = 8
PROMPT_LENS = (3, 11, 19, 30)
LONGROPE_ORIGINAL = 16  # a 128k Phi-3 in miniature: every prompt is longer, so transformers uses the long factors
LONGROPE_PROMPT_LENS = (17, 23, 30)
LOGPROB_ATOL = 2e-5
_SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, rms_norm_eps=1e-6, attn_implementation="eager")
# head_dim 32 ≠ hidden / heads (16), as Gemma's 256; llama.cpp scales queries by head_dim**-0.5 (not a 27B model).
_GEMMA = {**_SHAPE, "head_dim": 32, "query_pre_attn_scalar": 32}
_PHI3 = {**_SHAPE, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
_GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}


def _longrope(head_dim: int) -> dict[str, Any]:
    half = head_dim // 2
    return {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 0.5 * i for i in range(half)]}


# -- what each llama.cpp converter writes (conversion/gemma.py, conversion/phi.py) ---------------------------------

def _gemma_meta(w, cfg) -> None:
    add_shape_metadata(w, cfg, rope_base=False)  # Gemma 1's converter writes no RoPE base (llama.cpp: 10 000)


def _gemma2_meta(w, cfg) -> None:
    add_shape_metadata(w, cfg, rope_base=False)
    w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)


def _gemma3_meta(w, cfg) -> None:
    add_shape_metadata(w, cfg)  # the global base
    full, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_rope_freq_base_swa(local["rope_theta"])
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)  # no pattern key: llama.cpp's default, one global layer in six


def _rope_dims(cfg) -> int:
    return int(cfg.rope_parameters.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads


def _phi3_meta(w, cfg) -> None:
    add_shape_metadata(w, cfg, head_dim=False)
    w.add_bos_token_id(cfg.bos_token_id)  # the converter's SpecialVocab (tokenizer.ggml.*_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
    w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    w.add_rope_dimension_count(_rope_dims(cfg))
    w.add_sliding_window(cfg.sliding_window or 0)  # 0: no window (Phi-4)
    if cfg.rope_parameters.get("rope_type") == "longrope":
        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        original = cfg.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))


def _phi3_rope_factors(cfg) -> list[tuple[str, np.ndarray]]:
    params = cfg.rope_parameters
    if params.get("rope_type") != "longrope":
        return []
    return [("rope_factors_long.weight", np.asarray(params["long_factor"], dtype=np.float32)),
            ("rope_factors_short.weight", np.asarray(params["short_factor"], dtype=np.float32))]


@dataclass(frozen=True)
class Case:
    arch: str  # llama.cpp's architecture name
    config_cls: str
    model_cls: str
    kwargs: dict
    metadata: Callable[[Any, Any], None]
    norm_offset: float = 0.0
    #: config fields transformers' GGUF reader does not take from the file (None: it cannot read the architecture)
    transformers_overrides: dict | None = field(default_factory=dict)
    prompt_lens: tuple[int, ...] = PROMPT_LENS


CASES: dict[str, Case] = {
    # GeGLU (tanh GELU), (1 + w) norms, sqrt(hidden)-scaled embeddings, tied head.
    "gemma": Case("gemma", "GemmaConfig", "GemmaForCausalLM", {**_GEMMA, "num_hidden_layers": 2}, _gemma_meta,
                  norm_offset=1.0, transformers_overrides=None),
    # Local (window 8) / global / local layers (llama.cpp's default period 2), score soft cap 2, final soft cap 3.
    "gemma2": Case("gemma2", "Gemma2Config", "Gemma2ForCausalLM", {
        **_GEMMA, "num_hidden_layers": 3, "sliding_window": WINDOW, "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0}, _gemma2_meta, norm_offset=1.0,
        transformers_overrides={"query_pre_attn_scalar": 32, "attn_logit_softcapping": 2.0,
                                "final_logit_softcapping": 3.0}),
    # Five local layers and a global one (llama.cpp's default period 6), per-head q/k norms, RoPE base 10 000
    # locally and 10⁶ linearly scaled ×2 globally, final soft cap 3.
    "gemma3": Case("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM", {
        **_GEMMA, "num_hidden_layers": 6, "sliding_window": WINDOW, "final_logit_softcapping": 3.0,
        "rope_parameters": _GEMMA3_ROPE}, _gemma3_meta, norm_offset=1.0,
        transformers_overrides={"query_pre_attn_scalar": 32, "final_logit_softcapping": 3.0,
                                "rope_parameters": _GEMMA3_ROPE}),
    # Fused attn_qkv / ffn_up (gate|up), an untied head, a window of 8 on every layer (HF's Phi-3 honours it).
    "phi3": Case("phi3", "Phi3Config", "Phi3ForCausalLM", {
        **_PHI3, "num_hidden_layers": 2, "sliding_window": WINDOW, "original_max_position_embeddings": 128},
        _phi3_meta, transformers_overrides={"sliding_window": WINDOW}),
    # LongRoPE (rope_factors_long / _short tensors) past a 16-token pretraining length.
    "phi3-longrope": Case("phi3", "Phi3Config", "Phi3ForCausalLM", {
        **_PHI3, "num_hidden_layers": 2, "original_max_position_embeddings": LONGROPE_ORIGINAL,
        "rope_scaling": _longrope(16)}, _phi3_meta,
        transformers_overrides={"original_max_position_embeddings": LONGROPE_ORIGINAL,
                                "rope_parameters": {**_longrope(16), "rope_theta": 10000.0}},
        prompt_lens=LONGROPE_PROMPT_LENS),
}


def _hf_model(case: Case, vocab: int = VOCAB) -> torch.nn.Module:
    """transformers' init at std 0.1 (clear top-2 margins), then 1-D weights (Gemma's norm offsets) moved off 0."""
    config = getattr(transformers, case.config_cls)(vocab_size=vocab, initializer_range=0.1, **case.kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, case.model_cls)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.generation_config.eos_token_id = None
    return model


def _write(model: torch.nn.Module, case: Case, path: Path, **kw) -> Path:
    return write_gguf(model, case.arch, path, partial(case.metadata, cfg=model.config), norm_offset=case.norm_offset,
                      extra_tensors=_phi3_rope_factors(model.config) if case.arch == "phi3" else (), **kw)


def _prompts(lens: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens]


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
    prompts = _prompts(case.prompt_lens)
    want, logprobs = hf_greedy_reference(model, prompts, MAX_TOKENS)
    src = _write(model, case, tmp_path / f"{name}.gguf")
    if case.transformers_overrides is not None:
        theirs = _transformers_from_gguf(src, case.transformers_overrides)
        assert hf_greedy(theirs, prompts, MAX_TOKENS) == want
    llm = LLM(model=str(src), **ENGINE_KW, quantization="none", block_size=4)
    assert type(_model(llm)).__name__ == case.model_cls
    _assert_matches(_ours(llm, prompts), want, logprobs)


def test_features_change_the_outputs() -> None:
    """Each setting the GGUF metadata carries changes transformers' own log-probs on these prompts, so the parity
    above holds because pagedllm read it from the file, not by accident."""
    for name, off in [("gemma2", {"sliding_window": 4096}), ("gemma2", {"attn_logit_softcapping": None}),
                      ("gemma2", {"final_logit_softcapping": None}), ("gemma2", {"query_pre_attn_scalar": 256}),
                      ("gemma3", {"sliding_window": 4096}), ("gemma3", {"final_logit_softcapping": None}),
                      ("gemma3", {"rope_parameters": {**_GEMMA3_ROPE, "sliding_attention": _GEMMA3_ROPE[
                          "full_attention"]}}),
                      ("gemma3", {"rope_parameters": {**_GEMMA3_ROPE, "full_attention": {
                          "rope_type": "default", "rope_theta": 1e6}}}),
                      ("phi3", {"sliding_window": None}),
                      ("phi3-longrope", {"rope_scaling": {**_longrope(16), "long_factor": [1.0] * 8}})]:
        case = CASES[name]
        prompts = _prompts(case.prompt_lens)[-1:]
        _, want = hf_greedy_reference(_hf_model(case), prompts, MAX_TOKENS)
        changed = Case(case.arch, case.config_cls, case.model_cls, {**case.kwargs, **off}, case.metadata)
        _, got = hf_greedy_reference(_hf_model(changed), prompts, MAX_TOKENS)
        assert (got[0] - want[0]).abs().max() > 1e-3, (name, off)


@pytest.mark.parametrize("name", ["gemma3", "phi3"])
def test_q8_linears_run_quantized(name: str, tmp_path: Path) -> None:
    """Q8_0 projections (and Gemma 3's Q8_0 embedding, which the tied head shares) are served as int8 blocks; Phi-3's
    fused attn_qkv / ffn_up blocks are split by rows into q/k/v and gate/up. Int8 activations are not bit-exact,
    so the check is teacher-forced: fed the dequantized path's greedy continuation, the quantized model ranks that
    path's token first at nearly every position."""
    case = CASES[name]
    prompts = _prompts(case.prompt_lens)
    src = _write(_hf_model(case), case, tmp_path / f"{name}-q8.gguf", q8_linears=True, q8_embedding=name == "gemma3")
    dense = [list(o.outputs[0].token_ids)
             for o in _ours(LLM(model=str(src), **ENGINE_KW, quantization="none"), prompts)]
    llm = LLM(model=str(src), **ENGINE_KW, quantization="gguf")  # the suite's default is "none" (conftest.py)
    model = _model(llm)
    assert type(model).__name__ == case.model_cls
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.gguf_weight is not None and layer.mlp.gate_up_proj.gguf_weight is not None
    assert layer.self_attn.o_proj.gguf_weight is not None and layer.mlp.down_proj.gguf_weight is not None
    if name == "gemma3":
        assert model.lm_head.gguf_weight is model.model.embed_tokens.gguf_weight is not None
    ranks = teacher_forced_ranks(llm, prompts, dense)
    assert len(ranks) == len(prompts) * MAX_TOKENS
    assert sum(r == 1 for r in ranks) >= 0.9 * len(ranks), ranks


def test_phi4_mini_shape_partial_rotary(tmp_path: Path) -> None:
    """Phi-4-mini's shape: RoPE on 12 of 16 dimensions per head (rope.dimension_count), a tied head, no window
    (sliding_window 0). The config gets partial_rotary_factor 0.75; the greedy tokens match transformers' once
    Phi3ForCausalLM rotates part of each head (until then it refuses the config with a clear error)."""
    case = Case("phi3", "Phi3Config", "Phi3ForCausalLM", {
        **_PHI3, "num_hidden_layers": 2, "original_max_position_embeddings": 128, "partial_rotary_factor": 0.75,
        "tie_word_embeddings": True}, _phi3_meta)
    model = _hf_model(case)
    prompts = _prompts(PROMPT_LENS)
    want, logprobs = hf_greedy_reference(model, prompts, MAX_TOKENS)
    src = _write(model, case, tmp_path / "phi4-mini-shape.gguf")
    info = build_config(open_gguf(src), src)
    assert info.config["partial_rotary_factor"] == 0.75
    assert info.config["sliding_window"] is None and info.config["tie_word_embeddings"] is True
    theirs = _transformers_from_gguf(src, {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                               "partial_rotary_factor": 0.75}})
    assert hf_greedy(theirs, prompts, MAX_TOKENS) == want
    try:
        llm = LLM(model=str(src), **ENGINE_KW, quantization="none", block_size=4)
    except ValueError as e:
        if "partial_rotary_factor=0.75" not in str(e):
            raise
        pytest.skip(f"Phi3ForCausalLM does not rotate part of each head yet: {e}")
    _assert_matches(_ours(llm, prompts), want, logprobs)


# -- the tokenizer --------------------------------------------------------------------------------------------------

_CORPUS = ("The quick brown fox jumps over the lazy dog. Paged attention keeps the key-value cache in blocks; "
           "a block table maps each sequence's logical blocks to physical ones. In 2023, 1234 requests arrived "
           "at 56.7 per second.\n  Indented lines, tabs\tand  double  spaces stay.\n")
_TEXTS = ["The quick brown fox", " leading space and  two  spaces", "Numbers 2023 and 3.14159\nnew line",
          "naïve café ü 日本語 🙂", "<start_of_turn>user\nHi there<end_of_turn>\n"]
_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
                  "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
_SPECIALS = ["<start_of_turn>", "<end_of_turn>"]


def _train_sentencepiece(path: Path) -> Any:
    """A small BPE SentencePiece model with Gemma's conventions: ids pad 0, eos 1, bos 2, unk 3, byte fallback,
    no dummy prefix, whitespace kept as is, digits split, the turn markers as their own pieces."""
    spm = pytest.importorskip("sentencepiece")
    corpus = path / "corpus.txt"
    corpus.write_text(_CORPUS * 20)
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(path / "spm"), model_type="bpe", vocab_size=420, byte_fallback=True,
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, bos_piece="<bos>", eos_piece="<eos>", add_dummy_prefix=False,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        user_defined_symbols=_SPECIALS, character_coverage=1.0, num_threads=1, minloglevel=2)
    return spm.SentencePieceProcessor(model_file=str(path / "spm.model"))


def _sentencepiece_tokenizer(w, sp: Any) -> None:
    """The vocabulary as llama.cpp's converter writes a SentencePiece one (_create_vocab_sentencepiece), the turn
    markers as control tokens (Gemma's tokenizer_config marks them special), and Gemma's special ids and template."""
    types = gguf.TokenType
    tokens, scores, toktypes = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        tokens.append(piece)
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            toktypes.append(types.UNKNOWN)
        elif sp.is_control(i) or piece in _SPECIALS:
            toktypes.append(types.CONTROL)
        elif sp.is_byte(i):
            toktypes.append(types.BYTE)
        else:
            toktypes.append(types.NORMAL)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(toktypes)
    w.add_pad_token_id(0)
    w.add_eos_token_id(1)
    w.add_bos_token_id(2)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    w.add_chat_template(_CHAT_TEMPLATE)


@pytest.mark.parametrize("name", ["gemma", "gemma3"])
def test_gemma_sentencepiece_tokenizer_serves_text(name: str, tmp_path: Path) -> None:
    """A Gemma GGUF's SentencePiece vocabulary (tokens, scores, token types) becomes the served tokenizer: text
    encodes and decodes as transformers' tokenizer built from the same file does, and as SentencePiece itself
    encodes it; text prompts and chat run. (transformers' AutoTokenizer cannot open a Gemma 1 file, whose config it
    cannot read; its fast tokenizer class reads the tokenizer keys alone.)"""
    sp = _train_sentencepiece(tmp_path)
    case = CASES[name]
    src = _write(_hf_model(case, vocab=sp.get_piece_size()), case, tmp_path / f"{name}-tok.gguf",
                 tokenizer=partial(_sentencepiece_tokenizer, sp=sp))
    loader = transformers.AutoTokenizer if name == "gemma3" else transformers.PreTrainedTokenizerFast
    theirs = loader.from_pretrained(str(tmp_path), gguf_file=src.name)
    llm = LLM(model=str(src), num_gpu_blocks_override=32, max_model_len=128, device="cpu", swap_space=0.01)
    tok = llm.get_tokenizer()
    for text in _TEXTS:
        ids = tok.encode(text)
        assert ids == theirs.encode(text)
        assert ids[0] == 2  # BOS, as llama.cpp adds it
        if not any(s in text for s in _SPECIALS):
            assert ids[1:] == sp.encode(text)
        assert tok.decode(ids[1:]) == theirs.decode(ids[1:]) == text
        assert tok.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert tok.convert_tokens_to_ids(_SPECIALS) == [sp.piece_to_id(s) for s in _SPECIALS]
    out = llm.generate([_TEXTS[0]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode(_TEXTS[0]) and len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    messages = [{"role": "user", "content": "Hi there"}]
    chat = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    rendered = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
    assert chat[0].prompt_token_ids == theirs.encode(rendered, add_special_tokens=False)
    assert chat[0].prompt_token_ids.count(sp.piece_to_id("<start_of_turn>")) == 2
    generation = json.loads((gguf_cache_dir(src) / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 1 and generation["bos_token_id"] == 2


# -- metadata llama.cpp hard-codes or reads, and clear errors -------------------------------------------------------

def _metadata_only(path: Path, arch: str, meta: Callable[[Any], None], n_layers: int = 4, hidden: int = 64,
                   heads: int = 4, head_dim: int | None = 32,
                   extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A GGUF with the metadata and the token embedding only (enough for build_config)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(128)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-6)
    if head_dim is not None:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    meta(w)
    w.add_tensor("token_embd.weight", np.zeros((VOCAB, hidden), dtype=np.float32))
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _config(path: Path) -> dict[str, Any]:
    return build_config(open_gguf(path), path).config


def test_gemma_metadata_defaults_as_llama_cpp(tmp_path: Path) -> None:
    """What llama.cpp assumes where a file is silent: Gemma 2's window 4096 and soft caps 50 / 30; Gemma 3's local
    RoPE base 10 000, one global layer in six, no final cap, no window → all global, linear RoPE scaling for a factor
    without a type; the 27B models' query scale (hidden / heads, 46 and 62 layers); per-layer or periodic
    sliding_window_pattern keys."""
    nothing = lambda w: None  # noqa: E731
    g2 = _config(_metadata_only(tmp_path / "g2.gguf", "gemma2", nothing))
    assert (g2["sliding_window"], g2["attn_logit_softcapping"], g2["final_logit_softcapping"]) == (4096, 50.0, 30.0)
    assert g2["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert g2["query_pre_attn_scalar"] == 32 and g2["rope_theta"] == 10000.0 and g2["tie_word_embeddings"]
    assert g2["hidden_activation"] == "gelu_pytorch_tanh" and g2["model_type"] == "gemma2"

    g3 = _config(_metadata_only(tmp_path / "g3.gguf", "gemma3", lambda w: w.add_sliding_window(512), n_layers=7))
    assert g3["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert (g3["sliding_window"], g3["rope_local_base_freq"], g3["final_logit_softcapping"]) == (512, 10000.0, None)
    assert g3["model_type"] == "gemma3_text" and g3["attn_logit_softcapping"] is None

    # Gemma 3 4B+'s global RoPE scaling, here with the factor alone: llama.cpp's default type is linear.
    g3_scaled = _config(_metadata_only(tmp_path / "g3s.gguf", "gemma3", lambda w: (
        w.add_sliding_window(512), w.add_rope_freq_base(1e6), w.add_rope_scaling_factor(8.0))))
    assert g3_scaled["rope_scaling"] == {"rope_type": "linear", "factor": 8.0} and g3_scaled["rope_theta"] == 1e6

    g3_global = _config(_metadata_only(tmp_path / "g3g.gguf", "gemma3", nothing))
    assert g3_global["sliding_window"] is None and set(g3_global["layer_types"]) == {"full_attention"}

    # 27B: hidden / heads (here 64 / 4 = 16) rather than head_dim (32), as Gemma 2 27B's 144 and Gemma 3 27B's 168.
    assert _config(_metadata_only(tmp_path / "g2-27b.gguf", "gemma2", nothing, n_layers=46))[
        "query_pre_attn_scalar"] == 16
    assert _config(_metadata_only(tmp_path / "g3-27b.gguf", "gemma3", lambda w: w.add_sliding_window(8),
                                  n_layers=62))["query_pre_attn_scalar"] == 16

    flags = [True, False, False, True]
    pattern = _config(_metadata_only(tmp_path / "flags.gguf", "gemma3", lambda w: (
        w.add_sliding_window(8), w.add_sliding_window_pattern(flags))))
    assert pattern["layer_types"] == ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
    period = _config(_metadata_only(tmp_path / "period.gguf", "gemma2", lambda w: w.add_sliding_window_pattern(3)))
    assert period["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def test_unsupported_gguf_contents_are_clear_errors(tmp_path: Path) -> None:
    def fails(path: Path, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            _config(path)

    fails(_metadata_only(tmp_path / "a.gguf", "gemma2", lambda w: w.add_rope_freq_base_swa(20000.0)),
          "gemma2.rope.freq_base_swa = 20000.0 differs .* supported for gemma3 only")
    fails(_metadata_only(tmp_path / "b.gguf", "gemma3", lambda w: (w.add_sliding_window(8),
                                                                 w.add_sliding_window_pattern([True, False]))),
          "sliding_window_pattern has 2 per-layer flags, the model has 4 layers")
    fails(_metadata_only(tmp_path / "c.gguf", "gemma", lambda w: w.add_rope_dimension_count(16)),
          "rotates 16 of each head's 32 dimensions.*supported for phi3 only")
    orig_ctx = lambda w: w.add_rope_scaling_orig_ctx_len(16)  # noqa: E731
    long_only = {"rope_factors_long.weight": np.ones(8, dtype=np.float32)}
    fails(_metadata_only(tmp_path / "d.gguf", "phi3", orig_ctx, head_dim=None, extra_tensors=long_only),
          "LongRoPE needs both rope_factors_long.weight and rope_factors_short.weight")
    too_few = {name: np.ones(5, dtype=np.float32) for name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    fails(_metadata_only(tmp_path / "f.gguf", "phi3", orig_ctx, head_dim=None, extra_tensors=too_few),
          "rope_factors_long.weight has 5 factors; LongRoPE needs rotated dimensions / 2 = 8")
    longrope = lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)  # noqa: E731
    fails(_metadata_only(tmp_path / "e.gguf", "phi3", longrope, head_dim=None),
          "names LongRoPE scaling but has no rope_factors_long.weight")
    fails(_metadata_only(tmp_path / "g.gguf", "gemma", longrope),
          "Unsupported RoPE scaling type 'longrope'.*supported: linear, yarn$")


def test_tensor_names_per_architecture() -> None:
    """Each architecture's own names (llama.cpp's `ffn_norm` is Gemma 1's post-attention norm but Gemma 2/3's
    pre-MLP one); a tensor the architecture does not have (a bias on Gemma, Gemma 2's norms on Phi-3, LongRoPE
    factors outside Phi-3) fails naming the tensor and the ones the architecture has."""
    from pagedllm.model.gguf_loader import map_tensor_name

    assert map_tensor_name("blk.3.post_ffw_norm.weight", "gemma2") == "model.layers.3.post_feedforward_layernorm.weight"
    assert map_tensor_name("blk.0.ffn_norm.weight", "gemma") == "model.layers.0.post_attention_layernorm.weight"
    assert map_tensor_name("blk.0.ffn_norm.weight", "gemma3") == "model.layers.0.pre_feedforward_layernorm.weight"
    assert map_tensor_name("blk.1.attn_qkv.weight", "phi3") == "model.layers.1.self_attn.qkv_proj.weight"
    assert map_tensor_name("blk.1.ffn_up.weight", "phi3") == "model.layers.1.mlp.gate_up_proj.weight"
    assert map_tensor_name("rope_factors_long.weight", "phi3") is None
    with pytest.raises(ValueError, match=r"Unsupported tensor 'blk.0.attn_q.bias' .* architecture 'gemma3'; "
                                         r"expected weight tensors .*attn_q_norm"):
        map_tensor_name("blk.0.attn_q.bias", "gemma3")
    with pytest.raises(ValueError, match="Unsupported tensor 'rope_factors_long.weight' .* 'gemma2'"):
        map_tensor_name("rope_factors_long.weight", "gemma2")
    with pytest.raises(ValueError, match="Unsupported tensor 'blk.0.post_ffw_norm.weight' .* 'phi3'"):
        map_tensor_name("blk.0.post_ffw_norm.weight", "phi3")
