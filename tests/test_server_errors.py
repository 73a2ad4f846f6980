"""Bad input gets an OpenAI-style 400 naming the problem (never a 500); --api-key guards /v1/*."""
from __future__ import annotations

import signal

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer  # noqa: E402

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--api-key", KEY])
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


def cmpl(**kw):
    return ("/v1/completions", {"prompt": "Hello", "max_tokens": 4, **kw})


def chat(**kw):
    return ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, **kw})


# (id, (path, json body or raw bytes), expected param, substring of the message (lower case))
BAD_INPUT = [
    ("malformed-json", ("/v1/completions", b'{"prompt": "Hi", '), None, "not valid json"),
    ("body-not-object", ("/v1/completions", b"[1, 2, 3]"), None, "valid dictionary"),
    ("missing-prompt", ("/v1/completions", {"max_tokens": 4}), "prompt", "field required"),
    ("prompt-wrong-type", cmpl(prompt=123), "prompt", "valid"),
    ("prompt-empty-list", cmpl(prompt=[]), "prompt", "empty"),
    ("prompt-empty-string", cmpl(prompt=""), "prompt", "empty"),
    ("prompt-token-out-of-vocab", cmpl(prompt=[1, 2, 999999]), "prompt", "token ids must be in"),
    ("prompt-too-long", cmpl(prompt=[17] * 1500), "prompt", "maximum context length is 1024"),
    ("max-tokens-cannot-fit", cmpl(max_tokens=2000), "max_tokens", "maximum context length is 1024"),
    ("max-tokens-zero", cmpl(max_tokens=0), "max_tokens", "at least 1"),
    ("max-tokens-mistyped", cmpl(max_tokens="abc"), "max_tokens", "valid integer"),
    ("unknown-model", cmpl(model="gpt-17"), "model", "does not exist"),
    ("temperature-negative", cmpl(temperature=-1), "temperature", "non-negative"),
    ("top-p-too-big", cmpl(top_p=1.5), "top_p", "(0, 1]"),
    ("top-k-negative", cmpl(top_k=-5), "top_k", "top_k"),
    ("n-zero", cmpl(n=0), "n", "at least 1"),
    ("n-above-max", cmpl(n=1000), "n", "at most"),
    ("best-of-below-n", cmpl(n=3, best_of=2, temperature=1.0), "best_of", "greater than or equal to n"),
    ("stream-best-of-ne-n", cmpl(n=1, best_of=2, temperature=1.0, stream=True), "best_of", "when streaming"),
    ("logprobs-too-many", cmpl(logprobs=50), "logprobs", "logprobs must be in"),
    ("presence-penalty-range", cmpl(presence_penalty=3), "presence_penalty", "[-2, 2]"),
    ("repetition-penalty-zero", cmpl(repetition_penalty=0), "repetition_penalty", "greater than zero"),
    ("stop-empty-string", cmpl(stop=[""]), "stop", "empty string"),
    ("min-tokens-above-max", cmpl(min_tokens=10, max_tokens=4), "min_tokens", "less than or equal"),
    ("beam-search-best-of-1", cmpl(use_beam_search=True, temperature=0), "best_of", "beam search"),
    ("beam-search-stream", cmpl(use_beam_search=True, n=2, temperature=0, stream=True), "stream", "beam search"),
    ("length-penalty-no-beam", cmpl(length_penalty=2.0), "length_penalty", "not effective"),
    ("stream-mistyped", cmpl(stream="maybe"), "stream", "valid boolean"),
    ("priority-under-fcfs", cmpl(priority=2), "priority", "--scheduling-policy priority"),
    ("chat-priority-mistyped", chat(priority="high"), "priority", "valid integer"),
    ("chat-missing-messages", ("/v1/chat/completions", {"max_tokens": 4}), "messages", "field required"),
    ("chat-empty-messages", chat(messages=[]), "messages", "at least one"),
    ("chat-message-no-role", chat(messages=[{"content": "Hi"}]), "messages.0.role", "field required"),
    ("chat-image-content", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages",
     "only text"),
    ("chat-top-logprobs-needs-logprobs", chat(top_logprobs=2), "top_logprobs", "logprobs=true"),
    ("chat-top-logprobs-too-many", chat(logprobs=True, top_logprobs=30), "top_logprobs", "must be in"),
    ("chat-max-completion-tokens-cannot-fit", chat(max_completion_tokens=5000), "max_completion_tokens",
     "maximum context length"),
    ("chat-temperature-mistyped", chat(temperature="hot"), "temperature", "valid number"),
    ("chat-unknown-model", chat(model="nope"), "model", "does not exist"),
    ("detokenize-bad-id", ("/detokenize", {"tokens": [-1]}), "tokens", "token ids must be in"),
    ("tokenize-nothing", ("/tokenize", {}), "prompt", "exactly one"),
]


@pytest.mark.parametrize("case", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_a_clear_400(server, case):
    """Each a 400 naming the parameter, but an unknown model: 404 (vLLM's and OpenAI's NotFound)."""
    name, (path, body), param, fragment = case
    if isinstance(body, bytes):
        r = httpx.post(server.url(path), content=body, headers={**AUTH, "Content-Type": "application/json"})
    else:
        r = httpx.post(server.url(path), json=body, headers=AUTH)
    assert r.status_code == (404 if "unknown-model" in name else 400), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert fragment in err["message"].lower(), err
    assert "Traceback" not in r.text


def test_server_unharmed_after_bad_input(server):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0)
    for _, (path, body), _, _ in BAD_INPUT[:10]:
        httpx.post(server.url(path), content=body if isinstance(body, bytes) else None,
                   json=None if isinstance(body, bytes) else body, headers=AUTH)
    resp = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3, temperature=0)
    assert resp.usage.completion_tokens == 3
    m = server.wait_idle()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["pagedllm:kv_blocks_free"] == m["pagedllm:kv_blocks_total"] == 256


def test_beam_search_through_the_server(server):
    """`use_beam_search` as a vLLM client sends it: without a temperature it runs (beam search samples nothing),
    n beams come back best first; a sampling temperature with it is a 400 naming the field."""
    for extra in ({}, {"temperature": 0}):
        r = httpx.post(server.url("/v1/completions"), headers=AUTH, timeout=120,
                       json={"prompt": "Hello", "max_tokens": 4, "n": 2, "use_beam_search": True, **extra})
        assert r.status_code == 200, r.text
        assert [c["index"] for c in r.json()["choices"]] == [0, 1]
        assert len({c["text"] for c in r.json()["choices"]}) == 2
    r = httpx.post(server.url("/v1/completions"), headers=AUTH, timeout=120,
                   json={"prompt": "Hello", "max_tokens": 4, "n": 2, "use_beam_search": True, "temperature": 0.7})
    assert r.status_code == 400
    assert "temperature must be 0" in r.json()["error"]["message"]


def test_unknown_route_is_openai_shaped_404(server):
    r = httpx.get(server.url("/v1/nothing-here"), headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}],
                         ids=["missing", "wrong", "no-bearer"])
def test_auth_rejects_bad_key(server, headers):
    for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", cmpl()[1]),
                               ("POST", "/v1/chat/completions", chat()[1])]:
        r = httpx.request(method, server.url(path), json=body, headers=headers)
        assert r.status_code == 401, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and "api key" in err["message"].lower()


def test_auth_accepts_right_key_and_leaves_health_open(server):
    assert httpx.get(server.url("/v1/models"), headers=AUTH).status_code == 200
    r = httpx.post(server.url("/v1/completions"), json=cmpl()[1], headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.get(server.url("/metrics")).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url("/v1"), api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0).models.list()
    assert ok.data[0].id == MODEL_NAME
