"""`pagedllm serve --runner pooling`: POST /v1/embeddings with the official `openai` client (which asks for base64 by
default) and raw HTTP, checked against transformers' last hidden state of the same prompt on the same weights."""
from __future__ import annotations

import base64
import signal

import httpx
import numpy as np
import pytest
import torch
import torch.nn.functional as F

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer  # noqa: E402

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.", "hi"]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--runner", "pooling"])
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def _reference(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return F.normalize(hf_model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url("/v1/embeddings"), json={"model": MODEL_NAME, **body}, timeout=120)


def test_openai_client_embeddings_match_transformers(client, tokenizer, hf_model):
    resp = client.embeddings.create(model=MODEL_NAME, input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in resp.data] == [0, 1, 2] and resp.model == MODEL_NAME
    n_prompt = 0
    for text, item in zip(TEXTS, resp.data):
        ids = tokenizer.encode(text)
        n_prompt += len(ids)
        torch.testing.assert_close(torch.tensor(item.embedding), _reference(hf_model, ids), atol=1e-4, rtol=0)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == n_prompt
    floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS[1], encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(resp.data[1].embedding, abs=1e-7)


def test_token_ids_base64_and_messages(server, tokenizer):
    ids = tokenizer.encode(TEXTS[0])
    by_text = _post(server, {"input": TEXTS[0]}).json()["data"][0]["embedding"]
    r = _post(server, {"input": [ids, ids[:5]], "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    raw = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert raw.shape == (576,) and np.allclose(raw, by_text, atol=1e-6)
    assert r.json()["usage"]["prompt_tokens"] == len(ids) + 5
    # A conversation is embedded as its chat-template rendering (no generation prompt), as in vLLM.
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = httpx.post(server.url("/tokenize"), json={"messages": messages, "add_generation_prompt": False}).json()
    chat = _post(server, {"messages": messages}).json()
    direct = _post(server, {"input": rendered["tokens"]}).json()
    assert chat["usage"]["prompt_tokens"] == rendered["count"]
    assert np.allclose(chat["data"][0]["embedding"], direct["data"][0]["embedding"], atol=1e-6)
    # vLLM's extra fields: unnormalized vectors and truncation.
    raw = _post(server, {"input": TEXTS[0], "normalize": False}).json()["data"][0]["embedding"]
    assert np.linalg.norm(raw) > 2 and np.allclose(np.asarray(raw) / np.linalg.norm(raw), by_text, atol=1e-5)
    cut = _post(server, {"input": TEXTS[0], "truncate_prompt_tokens": 4}).json()
    assert cut["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize("body,param,text", [
    ({"input": "hi", "dimensions": 64}, "dimensions", "Matryoshka"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, "input", "exactly one"),
    ({}, "input", "exactly one"),
    ({"input": [[1, 2], [10**7]]}, "input", "token ids must be in"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", ""),
    ({"input": "hi " * 1100}, "input", "maximum context length"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param, text):
    r = _post(server, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text.lower() in err["message"].lower(), err


def test_generation_routes_refused_and_invocations_embed(server, client):
    done_before = server.metrics().get("vllm:request_success_total", 0.0)
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"}), ("/v1/responses", {"input": "hi"})):
        r = httpx.post(server.url(path), json={"model": MODEL_NAME, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text
        assert "/v1/embeddings" in r.json()["error"]["message"]
    inv = httpx.post(server.url("/invocations"), json={"input": TEXTS[2]}, timeout=60)
    assert inv.status_code == 200 and inv.json()["object"] == "list", inv.text
    assert np.allclose(inv.json()["data"][0]["embedding"],
                       client.embeddings.create(model=MODEL_NAME, input=TEXTS[2]).data[0].embedding, atol=1e-6)
    m = server.wait_idle()
    assert m["pagedllm:kv_blocks_free"] == m["pagedllm:kv_blocks_total"]
    assert m["vllm:request_success_total"] == done_before + 2  # the two embeddings; the refused routes ran nothing


def test_embeddings_schema_fuzz_never_5xx(server):
    """schemathesis cases (valid and invalid) for /v1/embeddings and /invocations of a pooling server: never a 5xx,
    every 4xx with OpenAI's error body, nothing left running."""
    from reliability import fuzz_schema

    statuses, failures = fuzz_schema(server.base_url, {}, max_examples=25, seed=5,
                                     paths=("/v1/embeddings", "/invocations"))
    # (Most generated bodies name a random model, a 400; the valid path is the other tests'.)
    assert sum(statuses.values()) >= 60, dict(statuses)
    assert failures == [], "\n".join(failures[:10])
    m = server.wait_idle()
    assert m["pagedllm:kv_blocks_free"] == m["pagedllm:kv_blocks_total"]
