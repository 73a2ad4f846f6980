"""GGUF files of llama.cpp's `qwen2` and `qwen3` architectures: tiny random-weight models written from a
transformers model in llama.cpp's layout (q/k rows as HF has them: Qwen's RoPE is not permuted; q/k/v biases;
Qwen3's per-head q/k norms). transformers reading the same file is the independent check of that layout;
pagedllm must generate what transformers generates from the HF weights."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
import transformers
from gguf_writing import ENGINE_KW, add_shape_metadata, copy_tokenizer, hf_greedy, teacher_forced_ranks, write_gguf
from gguf_writing import own_cache  # noqa: F401 (autouse fixture: a cache directory per test)
from gguf_writing import ours_greedy as _ours_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.model.gguf_loader import transformers_dense_gguf_kwargs

VOCAB = 512
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rope_theta=50000.0, rms_norm_eps=1e-6)
ARCHS = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
         # Qwen3's real head_dim (128, here ≠ hidden / heads); transformers' GGUF reader assumes it.
         "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 128})}
PROMPTS = [[3, 17, 250, 9], [100, 5], [42, 43, 44, 45, 46, 47, 48]]
MAX_TOKENS = 12


def _hf_model(arch: str, vocab: int = VOCAB) -> torch.nn.Module:
    config_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, config_cls)(vocab_size=vocab, initializer_range=0.1, tie_word_embeddings=False,
                                               **SHAPE, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # biases and norm weights off 0 / 1, so a mislaid one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def write_qwen_gguf(model: torch.nn.Module, arch: str, path: Path, q8_linears: bool = False,
                    tokenizer_from: Path | None = None) -> Path:
    """The model as llama.cpp's converter stores it (no q/k permutation for Qwen); `q8_linears`: the 2-D
    projection weights as Q8_0 blocks, the rest float32; `tokenizer_from`: a GGUF whose tokenizer to embed (else
    only a token list of the vocabulary's size)."""
    return write_gguf(model, arch, path, partial(add_shape_metadata, cfg=model.config), q8_linears=q8_linears,
                      tokenizer=None if tokenizer_from is None else partial(copy_tokenizer, source=tokenizer_from))


def _hf_greedy(model: torch.nn.Module) -> list[list[int]]:
    return hf_greedy(model, PROMPTS, MAX_TOKENS)


def _ours(path: Path, **kw) -> list[list[int]]:
    return _ours_greedy(path, PROMPTS, MAX_TOKENS, **kw)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_qwen_gguf_generates_what_transformers_does(arch: str, tmp_path: Path) -> None:
    model = _hf_model(arch)
    want = _hf_greedy(model)
    src = write_qwen_gguf(model, arch, tmp_path / f"{arch}.gguf")
    # transformers reads the file itself: the layout written is llama.cpp's.
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=src.name,
                                                               **transformers_dense_gguf_kwargs()).eval()
    assert _hf_greedy(theirs.float()) == want
    assert _ours(src, quantization="none") == want
    assert _ours(src, quantization="gguf") == want  # float32 tensors stay dense on the quantized path too


@pytest.mark.parametrize("arch", list(ARCHS))
def test_qwen_gguf_q8_linears_run_quantized(arch: str, tmp_path: Path) -> None:
    """Q8_0 projections are served as int8 blocks (the model is the Qwen class; its linears hold GGUF blocks).
    Int8 activations are not bit-exact, so the check is teacher-forced: fed the dequantized path's greedy
    continuation, the quantized model ranks that path's token first at nearly every position."""
    model = _hf_model(arch)
    src = write_qwen_gguf(model, arch, tmp_path / f"{arch}-q8.gguf", q8_linears=True)
    dense = _ours(src, quantization="none")
    llm = LLM(model=str(src), **ENGINE_KW, quantization="gguf")  # the suite's default is "none" (conftest.py)
    runner_model = llm.llm_engine.executor.driver_worker.model
    assert type(runner_model).__name__ == ARCHS[arch][1]
    assert runner_model.model.layers[0].self_attn.qkv_proj.gguf_weight is not None
    ranks = teacher_forced_ranks(llm, PROMPTS, dense)
    assert len(ranks) == len(PROMPTS) * MAX_TOKENS
    assert sum(r == 1 for r in ranks) >= 0.9 * len(ranks), ranks


def test_qwen_gguf_with_a_tokenizer_serves_text(tmp_path: Path) -> None:
    """A Qwen GGUF's own tokenizer (here the bundled model's BPE vocabulary and chat template, embedded in a
    qwen2 file) is built from the file: text prompts and chat work, and plain English encodes as the bundled
    tokenizer does."""
    from pagedllm.model.loader import default_model_path

    bundled = default_model_path()
    model = _hf_model("qwen2", vocab=49152)
    src = write_qwen_gguf(model, "qwen2", tmp_path / "qwen2-tok.gguf", tokenizer_from=bundled)
    llm = LLM(model=str(src), num_gpu_blocks_override=32, max_model_len=128, device="cpu", swap_space=0.01)
    tok = llm.get_tokenizer()
    reference = LLM(num_gpu_blocks_override=4, max_model_len=64, device="cpu", swap_space=0.01).get_tokenizer()
    text = "The capital of France is Paris, and it is lovely in spring."
    assert tok.encode(text) == reference.encode(text)
    out = llm.generate([text], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode(text) and len(out.outputs[0].token_ids) == 6
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    chat = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    want = reference.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert tok.decode(chat[0].prompt_token_ids) == want and "Hi" in want
