"""Per-token pooling (vLLM's ALL pooling): the token_classify and token_embed tasks, `LLM.reward`, the
*ForTokenClassification models, and the server's `POST /pooling`.

References are transformers' own models on the same random weights and token ids: a token classifier's
`logits` (every token) through softmax, a base model's `last_hidden_state` L2-normalized per token (vLLM's
token_embed default). Prompts of different lengths run in one batch with a step budget smaller than the longest
(rows gathered across chunks), with prefix caching on (a token request still computes every row) and in a pool
too small for all of them (preemption by recompute)."""
from __future__ import annotations

import base64
import shutil
import signal
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, PoolingParams
from test_classify_score import COMMON, TEXTS, save_model  # noqa: E402
from test_classify_score import _assert_no_blocks_held as _assert_idle  # noqa: E402
from test_classify_score import _logits as _hf_logits  # noqa: E402
from test_encoder_models import save_bert_tokenizer  # noqa: E402

# A step budget smaller than the longest prompt (~100 tokens): it runs in chunks, batched with the others.
ENGINE_KW = dict(dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=32)


def save_token_classifier(path: Path, tokenizer_dir: Path, kind: str = "llama", num_labels: int = 3):
    """A random 2-layer transformers *ForTokenClassification saved with its tokenizer → (model, tokenizer)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if kind == "bert":
        tok = save_bert_tokenizer(path)
        cfg = transformers.BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=64, num_labels=num_labels)
        model = transformers.BertForTokenClassification(cfg)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / name, path / name)
        tok = transformers.AutoTokenizer.from_pretrained(str(path))
        cfg_cls = transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig
        cfg = cfg_cls(vocab_size=len(tok), **COMMON, num_labels=num_labels, pad_token_id=tok.pad_token_id)
        model = (transformers.Qwen2ForTokenClassification if kind == "qwen2"
                 else transformers.LlamaForTokenClassification)(cfg)
    for name, p in model.named_parameters():
        if "LayerNorm.weight" in name:
            p.data.normal_(1.0, 0.1)
        else:  # a wide head: probabilities far from uniform
            p.data.normal_(0, 1.0 if name.startswith(("score", "classifier")) else 0.08)
    model = model.float().eval()
    model.save_pretrained(path)
    return model, tok


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_decoder_token_classifier_matches_transformers(kind: str, tmp_path: Path, default_model_dir: Path) -> None:
    """Runner auto: pooling, task token_classify. Every token's softmax (raw logits with activation=False) on a
    batch of 1 to ~100 tokens in 32-token steps; `reward` = `encode(pooling_task="token_classify")` = `encode()`."""
    hf, _ = save_token_classifier(tmp_path, default_model_dir, kind)
    llm = LLM(str(tmp_path), **ENGINE_KW, enable_prefix_caching=True)
    assert llm.llm_engine.runner == "pooling"
    assert llm.llm_engine.config.model_config.pooling_task == "token_classify"
    outs = llm.reward(TEXTS, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outs) > 32
    for out in outs:
        ref = _hf_logits(hf, out.prompt_token_ids)
        assert out.outputs.data.shape == (len(out.prompt_token_ids), 3)
        torch.testing.assert_close(out.outputs.data, ref.softmax(-1), atol=1e-5, rtol=0)
    enc = llm.encode(TEXTS, use_tqdm=False, pooling_task="token_classify")
    default = llm.encode(TEXTS, use_tqdm=False)
    for a, b, c in zip(outs, enc, default):
        torch.testing.assert_close(a.outputs.data, b.outputs.data, atol=0, rtol=0)
        torch.testing.assert_close(a.outputs.data, c.outputs.data, atol=0, rtol=0)
    raw = llm.reward(TEXTS[1:3], pooling_params=PoolingParams(activation=False), use_tqdm=False)
    for out in raw:
        torch.testing.assert_close(out.outputs.data, _hf_logits(hf, out.prompt_token_ids), atol=1e-4, rtol=0)
    for call in (lambda: llm.classify("hi"), lambda: llm.embed("hi"), lambda: llm.score("a", "b"),
                 lambda: llm.encode("hi", pooling_task="token_embed")):
        with pytest.raises(ValueError, match="token classifier.*LLM.reward"):
            call()
    with pytest.raises(ValueError, match="pooling_type 'ALL' only"):
        LLM(str(tmp_path), **ENGINE_KW, pooler_config={"pooling_type": "LAST"})
    _assert_idle(llm)


@pytest.mark.cuda
def test_cuda_token_classifier_matches_transformers(tmp_path: Path, default_model_dir: Path) -> None:
    """The same per-token rows on the GPU's kernels (chunked prompts, prefix caching on), float32."""
    hf, _ = save_token_classifier(tmp_path, default_model_dir, "llama")
    llm = LLM(str(tmp_path), **ENGINE_KW, device="cuda", enable_prefix_caching=True)
    outs = llm.reward(TEXTS, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in outs) > 32
    for out in outs:
        assert out.outputs.data.device.type == "cpu"
        torch.testing.assert_close(out.outputs.data, _hf_logits(hf, out.prompt_token_ids).softmax(-1), atol=1e-4,
                                   rtol=0)
    _assert_idle(llm)


def test_bert_token_classifier_matches_transformers(tmp_path: Path) -> None:
    hf, tok = save_token_classifier(tmp_path, tmp_path, "bert", num_labels=5)
    llm = LLM(str(tmp_path), dtype="float32", max_num_batched_tokens=128, max_num_seqs=2)
    texts = ["the film was wonderful", "x", "paris is a city on the seine river in france , the capital ."]
    outs = llm.reward(texts, use_tqdm=False)
    for text, out in zip(texts, outs):
        assert out.prompt_token_ids == tok.encode(text)
        ref = _hf_logits(hf, out.prompt_token_ids)
        torch.testing.assert_close(out.outputs.data, ref.softmax(-1), atol=1e-5, rtol=0)


def test_token_embed_with_prefix_caching_chunks_and_preemption(tmp_path: Path, default_model_dir: Path) -> None:
    """An embedding model (LAST pooling: prefix caching on) serves token_embed: every prompt row, normalized per
    token, even where a cached prefix exists (it computes its whole prompt), chunked, and in a pool too small for
    the batch (preempted by recompute)."""
    hf, _ = save_model(tmp_path, default_model_dir)  # a LlamaModel: an embedding model
    prefix = "You are a helpful assistant. Answer briefly and cite sources where you can. " * 3
    texts = [prefix + t for t in ("What is a cat?", "What is a dog?", "Name a river.")] + TEXTS[:2]
    # 16 tokens a prompt a step, 4 prompts a step, in 16 blocks of 8 (~10 blocks a prompt): they preempt each other.
    llm = LLM(str(tmp_path), dtype="float32", num_gpu_blocks_override=16, block_size=8, max_num_batched_tokens=64,
              long_prefill_token_threshold=16, enable_prefix_caching=True)
    assert llm.llm_engine.config.cache_config.enable_prefix_caching
    llm.embed(texts[0], use_tqdm=False)  # fills the prefix cache
    embs = llm.embed(texts, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in embs) > 0
    before = llm.stats()["num_recompute_preemptions"]
    outs = llm.encode(texts, use_tqdm=False, pooling_task="token_embed")
    assert llm.stats()["num_recompute_preemptions"] > before
    for emb, out in zip(embs, outs):
        assert out.num_cached_tokens == 0
        with torch.no_grad():
            h = hf(input_ids=torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
        assert out.outputs.data.shape == h.shape
        torch.testing.assert_close(out.outputs.data, F.normalize(h, dim=-1), atol=1e-4, rtol=0)
        torch.testing.assert_close(out.outputs.data[-1], torch.tensor(emb.outputs.embedding), atol=1e-5, rtol=0)
    raw = llm.encode(texts[3], PoolingParams(normalize=False), use_tqdm=False, pooling_task="token_embed")[0]
    with torch.no_grad():
        h = hf(input_ids=torch.tensor([raw.prompt_token_ids])).last_hidden_state[0]
    torch.testing.assert_close(raw.outputs.data, h, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="embedding model.*token_embed"):
        llm.reward("hi")
    _assert_idle(llm)


def test_sequence_classifier_token_classify_and_errors(tmp_path: Path, default_model_dir: Path) -> None:
    """A decoder's *ForSequenceClassification applies its `score` head to every token (vLLM's token_classify on
    a classification model); its classify still pools LAST."""
    hf, _ = save_model(tmp_path, default_model_dir, num_labels=3)
    llm = LLM(str(tmp_path), **ENGINE_KW, enable_prefix_caching=True)
    clf = llm.classify(TEXTS[2], use_tqdm=False)[0]
    out = llm.reward(TEXTS[2], use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf.score(hf.model(input_ids=torch.tensor([out.prompt_token_ids])).last_hidden_state[0])
    torch.testing.assert_close(out.outputs.data, ref.softmax(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.outputs.data[-1], torch.tensor(clf.outputs.probs), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="classifier.*not embeddings"):
        llm.encode("hi", pooling_task="token_embed")
    with pytest.raises(ValueError, match="task must be one of"):
        PoolingParams(task="reward")


def test_recomputed_rows_are_kept_once_and_pooler_all() -> None:
    from pagedllm.config import PoolerConfig
    from pagedllm.engine.pooling import PoolingState

    rows = torch.randn(10, 8)
    state = PoolingState.of(PoolingParams(task="token_embed", normalize=False), PoolerConfig("LAST"))
    assert state.wants_every_row
    state.add_rows(0, rows[:4])
    state.add_rows(4, rows[4:7])
    state.add_rows(0, rows[:7])  # recomputed after a preemption
    state.add_rows(7, rows[7:])
    torch.testing.assert_close(state.finish(rows[-1], 10), rows)
    assert PoolerConfig("all").pooling_type == "ALL"


def test_server_pooling_route(tmp_path: Path, default_model_dir: Path) -> None:
    """One server of an embedding model, behind an API key: /pooling's token_embed rows, its embed vector (the
    default task) equal to /v1/embeddings', base64, and a 400 for a task the model does not do."""
    from conftest_server import RemoteServer
    from pagedllm.entrypoints.openai.security import ApiKeyAuth
    from pagedllm.entrypoints.openai.server_ops import LOAD_TRACKED_PATHS

    assert ApiKeyAuth("k").protects("/pooling") and "/pooling" in LOAD_TRACKED_PATHS
    hf, tok = save_model(tmp_path, default_model_dir)
    server = RemoteServer(["--model", str(tmp_path), "--served-model-name", "tiny", "--num-gpu-blocks-override", "64",
                           "--max-model-len", "256", "--dtype", "float32", "--no-dashboard", "--api-key", "k"])
    headers = {"Authorization": "Bearer k"}

    def post(route: str, body: dict, auth: bool = True) -> httpx.Response:
        return httpx.post(server.url(route), json={"model": "tiny", **body}, headers=headers if auth else {},
                          timeout=120)

    try:
        assert post("/pooling", {"input": "hi"}, auth=False).status_code == 401
        r = post("/pooling", {"input": TEXTS[:2], "task": "token_embed"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["pooling", "pooling"]
        n_prompt = 0
        for text, item in zip(TEXTS, body["data"]):
            ids = tok.encode(text)
            n_prompt += len(ids)
            with torch.no_grad():
                h = hf(input_ids=torch.tensor([ids])).last_hidden_state[0]
            torch.testing.assert_close(torch.tensor(item["data"]), F.normalize(h, dim=-1), atol=1e-4, rtol=0)
        assert body["usage"]["prompt_tokens"] == n_prompt
        b64 = post("/pooling", {"input": TEXTS[1], "task": "token_embed", "encoding_format": "base64"}).json()
        rows = np.frombuffer(base64.b64decode(b64["data"][0]["data"]), dtype="<f4").reshape(-1, COMMON["hidden_size"])
        np.testing.assert_allclose(rows, np.array(body["data"][1]["data"]), atol=1e-6)
        emb = post("/v1/embeddings", {"input": TEXTS[0]}).json()["data"][0]["embedding"]
        for task in ({"task": "embed"}, {}):
            pooled = post("/pooling", {"input": TEXTS[0], **task}).json()["data"][0]["data"]
            assert pooled == pytest.approx(emb, abs=1e-6)
        bad = post("/pooling", {"input": "hi", "task": "token_classify"})
        assert bad.status_code == 400 and "embedding model" in bad.json()["error"]["message"], bad.text
    finally:
        assert server.stop(signal.SIGTERM) == 0, server.logs()[-3000:]
