"""Encoder-only models (BERT, RoBERTa, XLM-RoBERTa) on the pooling runner: embeddings (CLS, MEAN, the
sentence-transformers pooling config), classifiers and cross-encoder scores (with BERT's token types), checked
against transformers on the same weights and token ids; clear errors for what an encoder cannot do; a real server
answering /v1/embeddings and /rerank.

The models are tiny (hidden 32, 2 layers, 4 heads) with random weights, saved with a tiny tokenizer: a WordPiece
vocabulary for BERT, a character-level byte-BPE one for RoBERTa and XLM-RoBERTa."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, PoolingParams, SamplingParams

WORDS = ("the a of to and in is was it for on that with as at by from this be or are an capital paris france city "
         "river seine berlin germany fox dog quick brown lazy jumps over what where film loved acting wonderful "
         "europe country").split()
QUERY = "what is the capital of france ?"
DOCS = ["paris is the capital of france .", "the quick brown fox jumps over the lazy dog .",
        "france is a country in europe .", "berlin"]
# Prompts of different lengths (RoBERTa's tokenizer here takes one token per character: all fit 128 tokens).
TEXTS = ["the film was wonderful", "x", "paris is a city on the seine river in france , the capital of the country .",
         "the quick brown fox jumps over the lazy dog " * 2, "where is berlin ?"]
# At most 3 prompts a step: TEXTS run as a step of 3 prompts of different lengths, then a step of 2.
ENGINE_KW = dict(dtype="float32", max_num_batched_tokens=128, max_num_seqs=3)
COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def save_bert_tokenizer(path: Path):
    import transformers

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ",", "?", *WORDS]
    tok = transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})
    tok.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(str(path))


def save_roberta_tokenizer(path: Path):
    """Byte-level BPE without merges: one token per character (RoBERTa's special tokens, <pad> = 1)."""
    import transformers

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for c in "abcdefghijklmnopqrstuvwxyz\u0120?.,":  # \u0120: byte-level BPE's space
        vocab[c] = len(vocab)
    vocab["<mask>"] = len(vocab)
    tok = transformers.RobertaTokenizerFast(vocab=vocab, merges=[])
    tok.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(str(path))


def save_encoder(path: Path, kind: str = "bert", num_labels: int | None = None, prefixed: bool = False):
    """A random tiny encoder saved with its tokenizer: the base model, or a *ForSequenceClassification with
    `num_labels`; `prefixed`: a base model's tensors saved under the `bert.` / `roberta.` prefix (as some
    checkpoints converted from pre-training models are). → (the transformers model, its tokenizer)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    bert = kind == "bert"
    tok = save_bert_tokenizer(path) if bert else save_roberta_tokenizer(path)
    torch.manual_seed({"bert": 0, "roberta": 1, "xlm-roberta": 2}[kind])
    extra = {} if num_labels is None else dict(num_labels=num_labels)
    if bert:
        cfg = transformers.BertConfig(vocab_size=len(tok), max_position_embeddings=64, **COMMON, **extra)
    else:
        config_cls = transformers.RobertaConfig if kind == "roberta" else transformers.XLMRobertaConfig
        cfg = config_cls(vocab_size=len(tok), max_position_embeddings=130, pad_token_id=1, bos_token_id=0,
                         eos_token_id=2, type_vocab_size=1, **COMMON, **extra)
    prefix = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}[kind]
    cls = getattr(transformers, prefix + ("Model" if num_labels is None else "ForSequenceClassification"))
    model = cls(cfg)
    for name, p in model.named_parameters():
        if "LayerNorm.weight" in name:
            p.data.normal_(1.0, 0.1)
        else:  # a wide last layer: probabilities far from uniform
            p.data.normal_(0, 1.0 if name in ("classifier.weight", "classifier.out_proj.weight") else 0.1)
    model = model.float().eval()
    model.save_pretrained(path)
    if prefixed:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(path / "model.safetensors"))
        save_file({f"{kind.split('-')[-1]}.{k}": v for k, v in tensors.items()}, str(path / "model.safetensors"),
                  metadata={"format": "pt"})
    return model, tok


def hidden_states(hf, ids: list[int], token_type_ids: list[int] | None = None) -> torch.Tensor:
    with torch.no_grad():
        kw = {} if token_type_ids is None else {"token_type_ids": torch.tensor([token_type_ids])}
        return hf(input_ids=torch.tensor([ids]), **kw).last_hidden_state[0]


def logits(hf, ids: list[int], token_type_ids: list[int] | None = None) -> torch.Tensor:
    with torch.no_grad():
        kw = {} if token_type_ids is None else {"token_type_ids": torch.tensor([token_type_ids])}
        return hf(input_ids=torch.tensor([ids]), **kw).logits[0]


def assert_no_blocks_held(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] > 0
    assert not llm.llm_engine.has_unfinished_requests()


def write_sentence_transformers_config(path: Path, mode: str, normalize: bool = True) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32, **flags}))


@pytest.mark.parametrize("kind", ["bert", "roberta", "xlm-roberta"])
def test_embeddings_match_transformers(kind: str, tmp_path: Path) -> None:
    """CLS pooling by default (runner auto picks pooling), MEAN through pooler_config; prompts of different lengths
    batched in one step and spread over steps; L2-normalized unless asked not to be."""
    hf, tok = save_encoder(tmp_path, kind)
    llm = LLM(str(tmp_path), **ENGINE_KW)
    engine = llm.llm_engine
    assert engine.runner == "pooling" and engine.config.model_config.pooler_config.pooling_type == "CLS"
    # RoBERTa: 130 positions less its offset (padding_idx 1, + 1)
    assert engine.config.scheduler_config.max_model_len == (64 if kind == "bert" else 128)
    assert not engine.config.scheduler_config.enable_chunked_prefill
    outs = llm.embed(TEXTS, use_tqdm=False)
    lens = [len(o.prompt_token_ids) for o in outs]
    assert len(set(lens[:3])) == 3 and len(TEXTS) > ENGINE_KW["max_num_seqs"]
    for out, text in zip(outs, TEXTS):
        assert out.prompt_token_ids == tok(text)["input_ids"]  # [CLS] … [SEP] / <s> … </s>
        ref = F.normalize(hidden_states(hf, out.prompt_token_ids)[0], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-4, rtol=0)
    raw = llm.embed(TEXTS[0], PoolingParams(normalize=False), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), hidden_states(hf, raw.prompt_token_ids)[0],
                               atol=1e-4, rtol=0)
    assert_no_blocks_held(llm)
    mean = LLM(str(tmp_path), **ENGINE_KW, pooler_config={"pooling_type": "MEAN"})
    for out in mean.embed(TEXTS, use_tqdm=False):
        ref = F.normalize(hidden_states(hf, out.prompt_token_ids).mean(0), dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-4, rtol=0)
    assert_no_blocks_held(mean)


def test_sentence_transformers_pooling_config_is_honoured(tmp_path: Path) -> None:
    """modules.json + 1_Pooling/config.json saying mean switches CLS → MEAN (vLLM reads them); a checkpoint saved
    with the `bert.` prefix loads; the user's pooler_config still wins."""
    hf, _ = save_encoder(tmp_path, "bert", prefixed=True)
    write_sentence_transformers_config(tmp_path, "mean_tokens")
    llm = LLM(str(tmp_path), **ENGINE_KW)
    assert llm.llm_engine.config.model_config.pooler_config.pooling_type == "MEAN"
    for out in llm.embed(TEXTS[:3], use_tqdm=False):
        ref = F.normalize(hidden_states(hf, out.prompt_token_ids).mean(0), dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-4, rtol=0)
    cls = LLM(str(tmp_path), **ENGINE_KW, pooler_config='{"pooling_type": "CLS"}').embed(TEXTS[2], use_tqdm=False)[0]
    ref = F.normalize(hidden_states(hf, cls.prompt_token_ids)[0], dim=-1)
    torch.testing.assert_close(torch.tensor(cls.outputs.embedding), ref, atol=1e-4, rtol=0)
    # No Normalize module after the pooling: vLLM returns the pooled vector as it is.
    write_sentence_transformers_config(tmp_path, "mean_tokens", normalize=False)
    out = LLM(str(tmp_path), **ENGINE_KW).embed(TEXTS[2], use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), hidden_states(hf, out.prompt_token_ids).mean(0),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["bert", "xlm-roberta"])
def test_classifier_probabilities_match_transformers(kind: str, tmp_path: Path) -> None:
    """A 3-label classifier: its head (BERT: pooler + classifier; RoBERTa: classifier.dense/out_proj) on the CLS
    row; softmax of transformers' logits, and the raw logits with activation=False."""
    hf, _ = save_encoder(tmp_path, kind, num_labels=3)
    llm = LLM(str(tmp_path), **ENGINE_KW)
    assert llm.llm_engine.config.model_config.pooling_task == "classify"
    spread = 0.0
    for out in llm.classify(TEXTS, use_tqdm=False):
        ref = torch.softmax(logits(hf, out.prompt_token_ids), dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), ref, atol=1e-4, rtol=0)
        spread = max(spread, float(ref.max() - ref.min()))
    assert spread > 0.05  # the probabilities are not all near 1/3
    raw = llm.classify(TEXTS[3], PoolingParams(activation=False), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.probs), logits(hf, raw.prompt_token_ids), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="reads the CLS token.*pooling_type 'CLS' only"):
        LLM(str(tmp_path), **ENGINE_KW, pooler_config={"pooling_type": "MEAN"})
    assert_no_blocks_held(llm)


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_cross_encoder_scores_match_transformers(kind: str, tmp_path: Path) -> None:
    """A one-label cross-encoder: LLM.score is sigmoid(logit) of the tokenizer's pair encoding, with BERT's token
    types (1 for the second segment) reaching the model."""
    hf, tok = save_encoder(tmp_path, kind, num_labels=1)
    llm = LLM(str(tmp_path), **ENGINE_KW)
    outs = llm.score(QUERY, DOCS, use_tqdm=False) + llm.score([QUERY, "where is berlin ?"], DOCS[:2], use_tqdm=False)
    pairs = [(QUERY, d) for d in DOCS] + [(QUERY, DOCS[0]), ("where is berlin ?", DOCS[1])]
    scores = []
    for out, (q, d) in zip(outs, pairs):
        enc = tok(q, d)
        assert out.prompt_token_ids == enc["input_ids"]
        types = enc.get("token_type_ids")
        assert (kind == "bert") == bool(types and any(types))
        ref = float(torch.sigmoid(logits(hf, enc["input_ids"], types))[0])
        assert out.outputs.score == pytest.approx(ref, abs=1e-4)
        scores.append(out.outputs.score)
    assert max(scores) - min(scores) > 0.01  # 100× the tolerance: the pairs score apart
    if kind == "bert":  # the token types matter: without them the score differs
        enc = tok(QUERY, DOCS[0])
        untyped = float(torch.sigmoid(logits(hf, enc["input_ids"]))[0])
        assert abs(untyped - outs[0].outputs.score) > 1e-3
        # A token-id prompt may carry its own token types (vLLM's TokensPrompt field); bad ones are refused.
        typed = llm.classify({"prompt_token_ids": enc["input_ids"], "token_type_ids": enc["token_type_ids"]},
                             use_tqdm=False)[0]
        assert typed.outputs.probs == pytest.approx([outs[0].outputs.score], abs=1e-6)
        with pytest.raises(ValueError, match="token_type_ids must be 0s then 1s"):
            llm.classify({"prompt_token_ids": [2, 8, 3], "token_type_ids": [1, 0, 0]})
        with pytest.raises(ValueError, match="one 0 or 1 per prompt token"):
            llm.classify({"prompt_token_ids": [2, 8, 3], "token_type_ids": [0, 1]})
    assert_no_blocks_held(llm)


def test_encoder_errors_are_clear(tmp_path: Path) -> None:
    hf, tok = save_encoder(tmp_path, "bert")
    with pytest.raises(ValueError, match="no LM head.*runner='pooling'"):
        LLM(str(tmp_path), **ENGINE_KW, runner="generate")
    with pytest.raises(ValueError, match="max_num_batched_tokens=32 is less than max_model_len=64.*encoder-only"):
        LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="max_model_len=80 exceeds the model's context length \\(64\\)"):
        LLM(str(tmp_path), dtype="float32", max_model_len=80)
    llm = LLM(str(tmp_path), **ENGINE_KW, enable_prefix_caching=True)
    assert not llm.llm_engine.config.cache_config.enable_prefix_caching
    with pytest.raises(ValueError, match="LLM.embed"):
        llm.generate("the film", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="65 tokens but this engine fits at most 64 .*max_model_len=64"):
        llm.embed({"prompt_token_ids": [2] + [8] * 63 + [3]})
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.embed(" ".join(["the"] * 80))
    # The longest prompt that fits still runs, and nothing is left held after the refusals.
    longest = [2] + [8] * 62 + [3]  # max_model_len tokens: a pooling request generates none
    out = llm.embed({"prompt_token_ids": longest}, use_tqdm=False)[0]
    ref = F.normalize(hidden_states(hf, longest)[0], dim=-1)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), ref, atol=1e-4, rtol=0)
    assert_no_blocks_held(llm)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """`pagedllm serve` of a BERT embedding model and of a BERT cross-encoder."""
    pytest.importorskip("fastapi")
    from conftest_server import RemoteServer

    out = {}
    try:
        for name, labels in (("embedder", None), ("reranker", 1)):
            path = tmp_path_factory.mktemp(name)
            hf, tok = save_encoder(path, "bert", num_labels=labels)
            server = RemoteServer(["--model", str(path), "--served-model-name", name, "--dtype", "float32",
                                   "--no-dashboard"])
            out[name] = (server, hf, tok)
        yield out
    finally:
        for server, _, _ in out.values():
            assert server.stop(signal.SIGTERM) == 0, server.tail()


def test_server_embeddings_and_rerank(servers) -> None:
    server, hf, tok = servers["embedder"]
    r = httpx.post(server.url("/v1/embeddings"), json={"model": "embedder", "input": TEXTS[:3]}, timeout=120)
    assert r.status_code == 200, r.text
    for item, text in zip(r.json()["data"], TEXTS[:3]):
        ref = F.normalize(hidden_states(hf, tok(text)["input_ids"])[0], dim=-1)
        torch.testing.assert_close(torch.tensor(item["embedding"]), ref, atol=1e-4, rtol=0)
    r = httpx.post(server.url("/v1/embeddings"), json={"model": "embedder", "input": " ".join(["the"] * 80)},
                   timeout=60)
    assert r.status_code == 400 and "maximum context length is 64 tokens" in r.text, r.text
    longest = [2] + [8] * 62 + [3]  # exactly max_model_len: a pooling prompt needs no room for a completion
    r = httpx.post(server.url("/v1/embeddings"), json={"model": "embedder", "input": longest}, timeout=60)
    assert r.status_code == 200, r.text
    ref = F.normalize(hidden_states(hf, longest)[0], dim=-1)
    torch.testing.assert_close(torch.tensor(r.json()["data"][0]["embedding"]), ref, atol=1e-4, rtol=0)
    m = server.wait_idle()
    assert m["pagedllm:kv_blocks_free"] == m["pagedllm:kv_blocks_total"]

    server, hf, tok = servers["reranker"]
    refs = []
    for d in DOCS:
        enc = tok(QUERY, d)
        refs.append(float(torch.sigmoid(logits(hf, enc["input_ids"], enc["token_type_ids"]))[0]))
    r = httpx.post(server.url("/rerank"), json={"model": "reranker", "query": QUERY, "documents": DOCS}, timeout=120)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -refs[i])
    for x in results:
        assert x["relevance_score"] == pytest.approx(refs[x["index"]], abs=1e-4)
    m = server.wait_idle()
    assert m["pagedllm:kv_blocks_free"] == m["pagedllm:kv_blocks_total"]
