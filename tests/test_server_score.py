"""`pagedllm serve` of pooling models: POST /v1/score (/score), /rerank (/v1/rerank, /v2/rerank) and /classify on
real server processes of tiny random models (tests/test_classify_score.py builds them), checked against
transformers on the same token ids; the 400s name the field or the flag to use; no KV block is left held."""
from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("fastapi")

from conftest_server import RemoteServer  # noqa: E402
from test_classify_score import DOCS, QUERY, save_model  # noqa: E402

from pagedllm.entrypoints.score_utils import score_prompt_ids  # noqa: E402

ARGS = ["--num-gpu-blocks-override", "64", "--max-model-len", "256", "--dtype", "float32", "--no-dashboard"]


class Served:
    """A server of a model saved by `save_model`, with the transformers model and tokenizer it was saved from."""

    def __init__(self, name: str, path: Path, hf, tok) -> None:
        self.hf, self.tok = hf, tok
        self.server = RemoteServer(["--model", str(path), "--served-model-name", name, *ARGS])

    def post(self, route: str, body: dict) -> httpx.Response:
        return httpx.post(self.server.url(route), json=body, timeout=120)

    def assert_idle(self) -> None:
        m = self.server.wait_idle()
        assert m["pagedllm:kv_blocks_free"] == m["pagedllm:kv_blocks_total"], m

    def stop(self) -> None:
        assert self.server.stop(signal.SIGTERM) == 0, self.server.tail()


def _start(tmp_path_factory, default_model_dir: Path, name: str, **kw) -> Served:
    path = tmp_path_factory.mktemp(name)
    hf, tok = save_model(path, default_model_dir, **kw)
    return Served(name, path, hf, tok)


def _serve(tmp_path_factory, default_model_dir: Path, name: str, **kw):
    served = _start(tmp_path_factory, default_model_dir, name, **kw)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, default_model_dir):
    """A cross-encoder: LlamaForSequenceClassification with one label."""
    yield from _serve(tmp_path_factory, default_model_dir, "reranker", num_labels=1)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, default_model_dir):
    """Qwen2ForSequenceClassification with three labels (negative, neutral, positive)."""
    yield from _serve(tmp_path_factory, default_model_dir, "classifier", kind="qwen2", num_labels=3)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory, default_model_dir):
    """A LlamaModel checkpoint: an embedding model."""
    yield from _serve(tmp_path_factory, default_model_dir, "embedder")


def _pair_score(served: Served, text_1: str, text_2: str) -> tuple[float, int]:
    ids = score_prompt_ids(served.tok, text_1, text_2)
    with torch.no_grad():
        return float(torch.sigmoid(served.hf(input_ids=torch.tensor([ids])).logits[0, 0])), len(ids)


def _error(r: httpx.Response, param: str | None, text: str) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text.lower() in err["message"].lower(), err
    return err


def test_score_matches_transformers(reranker):
    r = reranker.post("/v1/score", {"model": "reranker", "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "reranker" and body["id"].startswith("score-")
    refs = [_pair_score(reranker, QUERY, d) for d in DOCS]
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    for item, (ref, _) in zip(body["data"], refs):
        assert item["object"] == "score" and item["score"] == pytest.approx(ref, abs=1e-4)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(n for _, n in refs)
    # N→N under vLLM's newer names, on the unversioned route.
    r = reranker.post("/score", {"queries": [QUERY, "Where is Berlin?"], "documents": DOCS[:2]})
    assert r.status_code == 200, r.text
    want = [_pair_score(reranker, QUERY, DOCS[0])[0], _pair_score(reranker, "Where is Berlin?", DOCS[1])[0]]
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-4)
    reranker.assert_idle()


def test_rerank_orders_documents_and_keeps_top_n(reranker):
    refs = [_pair_score(reranker, QUERY, d)[0] for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -refs[i])
    r = reranker.post("/rerank", {"query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["index"] for x in body["results"]] == order
    for x in body["results"]:
        assert x["document"] == {"text": DOCS[x["index"]]}
        assert x["relevance_score"] == pytest.approx(refs[x["index"]], abs=1e-4)
    scores = [x["relevance_score"] for x in body["results"]]
    assert scores == sorted(scores, reverse=True) and body["usage"]["total_tokens"] > 0
    for route in ("/v1/rerank", "/v2/rerank"):
        top = reranker.post(route, {"query": QUERY, "documents": DOCS, "top_n": 2, "return_documents": False}).json()
        assert [x["index"] for x in top["results"]] == order[:2]
        assert all(x["document"] is None for x in top["results"])
    reranker.assert_idle()


def test_classify_gives_probabilities_and_labels(classifier, reranker):
    texts = ["I loved this film.", "x", "The capital of France is Paris, a city on the Seine. " * 5]
    r = classifier.post("/classify", {"input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    n_prompt = 0
    for item, text in zip(body["data"], texts):
        ids = classifier.tok.encode(text)
        n_prompt += len(ids)
        with torch.no_grad():
            ref = torch.softmax(classifier.hf(input_ids=torch.tensor([ids])).logits[0], dim=-1)
        assert item["num_classes"] == 3
        torch.testing.assert_close(torch.tensor(item["probs"]), ref, atol=1e-4, rtol=0)
        assert item["label"] == ("negative", "neutral", "positive")[int(ref.argmax())]
    assert body["usage"]["prompt_tokens"] == n_prompt
    one = reranker.post("/classify", {"input": DOCS[0]}).json()["data"][0]
    assert one["label"] == "relevant" and one["num_classes"] == 1 and 0 < one["probs"][0] < 1
    classifier.assert_idle()


def test_embedding_model_scores_are_cosine_similarities(embedder):
    r = embedder.post("/v1/score", {"text_1": QUERY, "text_2": DOCS[:2]})
    assert r.status_code == 200, r.text
    emb = embedder.post("/v1/embeddings", {"input": [QUERY, *DOCS[:2]]}).json()["data"]
    vecs = [torch.tensor(e["embedding"]) for e in emb]
    for item, vec in zip(r.json()["data"], vecs[1:]):
        assert item["score"] == pytest.approx(float(F.cosine_similarity(vecs[0], vec, dim=0)), abs=1e-5)
    ranked = embedder.post("/rerank", {"query": QUERY, "documents": DOCS[:2]}).json()["results"]
    assert [x["relevance_score"] for x in ranked] == sorted((d["score"] for d in r.json()["data"]), reverse=True)
    err = _error(embedder.post("/classify", {"input": "hi"}), "model", "sequence-classification")
    assert err["code"] == "model_not_supported"
    embedder.assert_idle()


@pytest.mark.parametrize("route,body,param,text", [
    ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n", "top_n must be 0"),
    ("/rerank", {"query": QUERY, "documents": []}, "documents", "must not be empty"),
    ("/rerank", {"documents": DOCS}, "query", "field required"),
    ("/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCS}, "text_2", "1 and N"),
    ("/v1/score", {"text_1": QUERY}, "text_2", "text_2 (or documents) is required"),
    ("/v1/score", {"text_1": QUERY, "queries": QUERY, "text_2": "x"}, "queries", "not both"),
    ("/v1/score", {"text_1": QUERY, "text_2": []}, "text_2", "must not be empty"),
    ("/v1/score", {"text_1": QUERY, "text_2": "x", "truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens",
     "exceeds"),
    ("/v1/score", {"text_1": QUERY * 60, "text_2": "x"}, "text_1", "maximum context length"),
    ("/classify", {"input": []}, "input", "must not be empty"),
    ("/v1/embeddings", {"input": "hi"}, "model", "convert='embed'"),
])
def test_bad_requests_are_400_naming_the_field(reranker, route, body, param, text):
    _error(reranker.post(route, body), param, text)


def test_scoring_a_multi_label_classifier_is_refused(classifier):
    for route, body in (("/v1/score", {"text_1": "a", "text_2": "b"}), ("/rerank", {"query": "a", "documents": ["b"]})):
        err = _error(classifier.post(route, body), "model", "num_labels=1")
        assert err["code"] == "model_not_supported"
    r = classifier.post("/v1/completions", {"prompt": "hi"})
    assert r.status_code == 400 and "/classify" in r.json()["error"]["message"]


def test_generating_model_refuses_pooling_routes(tmp_path_factory, default_model_dir):
    served = _start(tmp_path_factory, default_model_dir, "generator", causal=True)
    try:
        for route, body in (("/v1/score", {"text_1": "a", "text_2": "b"}), ("/score", {"text_1": "a", "text_2": "b"}),
                            ("/rerank", {"query": "a", "documents": ["b"]}), ("/classify", {"input": "a"})):
            r = served.post(route, body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "model_not_supported" and "--runner pooling" in err["message"], err
        served.assert_idle()
    finally:
        served.stop()


def test_schema_fuzz_never_5xx(reranker):
    """schemathesis cases (valid and invalid) for the scoring and classification routes: never a 5xx, every 4xx
    with OpenAI's error body, nothing left running."""
    from reliability import fuzz_schema

    statuses, failures = fuzz_schema(reranker.server.base_url, {}, max_examples=20, seed=5,
                                     paths=("/v1/score", "/rerank", "/classify"))
    assert sum(statuses.values()) >= 60, dict(statuses)
    assert failures == [], "\n".join(failures[:10])
    reranker.assert_idle()
