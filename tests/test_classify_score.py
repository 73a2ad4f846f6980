"""Sequence classification and scoring on the pooling runner (vLLM's `LLM.classify`, `LLM.score`).

The references are transformers' own *ForSequenceClassification models (random weights, saved with the bundled
model's tokenizer): their logits through softmax (several labels) or sigmoid (one label, a cross-encoder) on the same
token ids. An embedding model's score is the cosine similarity of its embeddings, checked against pagedllm's own
embeddings and against transformers' last-token hidden states."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, PoolingParams, SamplingParams
from pagedllm.entrypoints.score_utils import score_prompt_ids

TEXTS = [
    "I loved this film, the acting was wonderful.",
    "x",
    "The capital of France is Paris, a city on the Seine that " * 8,
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
]
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "The quick brown fox jumps over the lazy dog.",
        "France is a country in Europe; " * 6, "Berlin"]
# A step budget smaller than the longest prompt: it runs in chunks, batched with the others.
ENGINE_KW = dict(dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=32)
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512)


def save_model(path: Path, tokenizer_dir: Path, kind: str = "llama", num_labels: int | None = None,
               causal: bool = False):
    """A random 2-layer transformers model saved with the bundled tokenizer: a classifier (`num_labels`), a
    generating model (`causal`) or else a base model (an embedding model). → (the model, its tokenizer)."""
    import transformers

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    torch.manual_seed(0)
    extra = {} if num_labels is None else dict(num_labels=num_labels, pad_token_id=tok.pad_token_id)
    if num_labels == 3:
        extra["id2label"] = {0: "negative", 1: "neutral", 2: "positive"}
    elif num_labels == 1:
        extra["id2label"] = {0: "relevant"}
    config_cls = transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig
    cfg = config_cls(vocab_size=len(tok), **COMMON, **extra)
    if num_labels is not None:
        cls = transformers.Qwen2ForSequenceClassification if kind == "qwen2" else \
            transformers.LlamaForSequenceClassification
    else:
        cls = transformers.LlamaForCausalLM if causal else transformers.LlamaModel
    model = cls(cfg)
    for name, p in model.named_parameters():
        p.data.normal_(0, 1.0 if name.startswith("score") else 0.08)  # a wide head: probabilities far from uniform
    model = model.float().eval()
    model.save_pretrained(path)
    return model, tok


def _logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(input_ids=torch.tensor([ids])).logits[0]


def _assert_no_blocks_held(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_classify_matches_transformers(kind: str, tmp_path: Path, default_model_dir: Path) -> None:
    """A 3-label classifier: runner auto picks pooling; probabilities are transformers' softmax, raw logits with
    activation=False, on a batch of 1 to ~100 tokens."""
    hf, _ = save_model(tmp_path, default_model_dir, kind, num_labels=3)
    llm = LLM(str(tmp_path), **ENGINE_KW)
    assert llm.llm_engine.runner == "pooling"
    assert llm.llm_engine.request_checker.labels == ("negative", "neutral", "positive")
    outs = llm.classify(TEXTS, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outs) > 2 * ENGINE_KW["max_num_batched_tokens"]
    spread = 0.0
    for out in outs:
        assert out.finished and out.outputs.num_classes == 3
        ref = torch.softmax(_logits(hf, out.prompt_token_ids), dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), ref, atol=1e-4, rtol=0)
        spread = max(spread, float(ref.max() - ref.min()))
    assert spread > 0.2  # the probabilities are not all near 1/3
    raw = llm.classify(TEXTS[0], PoolingParams(activation=False), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.probs), _logits(hf, raw.prompt_token_ids), atol=1e-4,
                               rtol=0)
    _assert_no_blocks_held(llm)


def test_mean_pooling_classifies_the_mean_hidden_state(tmp_path: Path, default_model_dir: Path) -> None:
    """The head is linear, so it commutes with pooling: MEAN gives softmax(score(mean of the hidden states))."""
    hf, _ = save_model(tmp_path, default_model_dir, num_labels=3)
    llm = LLM(str(tmp_path), **ENGINE_KW, convert="classify", pooler_config={"pooling_type": "MEAN"})
    out = llm.classify(TEXTS[2], use_tqdm=False)[0]
    with torch.no_grad():
        h = hf.model(input_ids=torch.tensor([out.prompt_token_ids])).last_hidden_state[0].mean(0)
        ref = torch.softmax(hf.score(h), dim=-1)
    torch.testing.assert_close(torch.tensor(out.outputs.probs), ref, atol=1e-4, rtol=0)


def test_cross_encoder_scores_match_transformers(tmp_path: Path, default_model_dir: Path) -> None:
    """A one-label classifier scores text pairs, 1→N and N→N, with sigmoid(logit) of the pair's prompt."""
    hf, tok = save_model(tmp_path, default_model_dir, num_labels=1)
    llm = LLM(str(tmp_path), **ENGINE_KW)
    one_to_n = llm.score(QUERY, DOCS, use_tqdm=False)
    n_to_n = llm.score([QUERY, "Where is Berlin?"], DOCS[:2], use_tqdm=False)
    pairs = [(QUERY, d) for d in DOCS] + [(QUERY, DOCS[0]), ("Where is Berlin?", DOCS[1])]
    scores = []
    for out, (q, d) in zip(one_to_n + n_to_n, pairs):
        # The tokenizer marks no pair boundary itself: query, its separator token (eos), document.
        want_ids = tok.encode(q) + [tok.eos_token_id] + tok.encode(d, add_special_tokens=False)
        assert out.prompt_token_ids == want_ids == score_prompt_ids(tok, q, d)
        ref = torch.sigmoid(_logits(hf, want_ids))[0]
        assert out.outputs.score == pytest.approx(float(ref), abs=1e-4)
        scores.append(out.outputs.score)
    assert max(scores) - min(scores) > 0.05
    # classify on a one-label model: the same sigmoid.
    probs = llm.classify({"prompt_token_ids": one_to_n[0].prompt_token_ids}, use_tqdm=False)[0].outputs.probs
    assert probs == pytest.approx([one_to_n[0].outputs.score], abs=1e-6)
    with pytest.raises(ValueError, match="1 and N .* or N and N"):
        llm.score([QUERY, QUERY], DOCS)
    with pytest.raises(ValueError, match="data_2 is empty"):
        llm.score(QUERY, [])
    _assert_no_blocks_held(llm)


def test_embedding_model_scores_are_cosine_similarities(tmp_path: Path, default_model_dir: Path) -> None:
    hf, _ = save_model(tmp_path, default_model_dir)
    llm = LLM(str(tmp_path), **ENGINE_KW)
    outs = llm.score(QUERY, DOCS, use_tqdm=False)
    embs = [torch.tensor(o.outputs.embedding) for o in llm.embed([QUERY, *DOCS], use_tqdm=False)]
    for out, doc, emb in zip(outs, DOCS, embs[1:]):
        own = float(F.cosine_similarity(embs[0], emb, dim=0))
        with torch.no_grad():
            q = hf(input_ids=torch.tensor([llm.get_tokenizer().encode(QUERY)])).last_hidden_state[0, -1]
            d = hf(input_ids=torch.tensor([llm.get_tokenizer().encode(doc)])).last_hidden_state[0, -1]
        assert out.outputs.score == pytest.approx(own, abs=1e-5)
        assert out.outputs.score == pytest.approx(float(F.cosine_similarity(q, d, dim=0)), abs=1e-4)
    pair = llm.score([QUERY, DOCS[1]], [DOCS[0], DOCS[2]], use_tqdm=False)[1]
    assert pair.outputs.score == pytest.approx(float(F.cosine_similarity(embs[2], embs[3], dim=0)), abs=1e-5)
    with pytest.raises(ValueError, match="sequence-classification model.*LLM.embed"):
        llm.classify("hello")
    with pytest.raises(ValueError, match="activation applies to classification models"):
        llm.embed("hello", PoolingParams(activation=True))
    with pytest.raises(ValueError, match="convert='classify' needs a sequence-classification checkpoint"):
        LLM(str(tmp_path), **ENGINE_KW, convert="classify")
    _assert_no_blocks_held(llm)


def test_wrong_uses_are_clear_errors(tmp_path: Path, default_model_dir: Path) -> None:
    hf, _ = save_model(tmp_path, default_model_dir, num_labels=3)
    llm = LLM(str(tmp_path), **ENGINE_KW)
    with pytest.raises(ValueError, match="convert='embed'"):
        llm.embed("hello")
    with pytest.raises(ValueError, match="num_labels=1.*LLM.classify"):
        llm.score(QUERY, DOCS)
    with pytest.raises(ValueError, match="dimensions applies to embedding models"):
        llm.classify("hello", PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="LLM.embed"):
        llm.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="activation must be"):
        PoolingParams(activation="yes")
    assert len(llm.classify("still serving", use_tqdm=False)[0].outputs.probs) == 3
    with pytest.raises(ValueError, match="no LM head.*--runner pooling"):
        LLM(str(tmp_path), **ENGINE_KW, runner="generate")
    with pytest.raises(ValueError, match="convert='classify' makes a classification model"):
        LLM(str(tmp_path), **ENGINE_KW, runner="generate", convert="classify")
    # convert='embed': the classifier's hidden states (its head unused) as embeddings.
    emb = LLM(str(tmp_path), **ENGINE_KW, convert="embed")
    out = emb.embed(TEXTS[0], use_tqdm=False)[0]
    with torch.no_grad():
        h = hf.model(input_ids=torch.tensor([out.prompt_token_ids])).last_hidden_state[0, -1]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), F.normalize(h, dim=-1), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="sequence-classification model"):
        emb.classify("hello")
    generating = LLM(str(default_model_dir), num_gpu_blocks_override=32)
    for call in (lambda: generating.classify("hi"), lambda: generating.score("a", "b")):
        with pytest.raises(ValueError, match="runner='pooling'"):
            call()
