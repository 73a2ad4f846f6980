"""vLLM's request options and HTTP flags on a real server process with the bundled model: chat_template_kwargs
(over --default-chat-template-kwargs) and continue_final_message, stream_options.continuous_usage_stats, return_tokens_as_token_ids
(--return-tokens-as-token-ids), X-Request-Id (--enable-request-id-headers), CORS (--allowed-origins) and the
generation config's request defaults (--override-generation-config)."""
from __future__ import annotations

import json
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("fastapi")

from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer, stream_chunks  # noqa: E402

ORIGIN = "https://app.example"
CONVERSATION = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour I pick is"}]
#: What a model's generation_config.json would say (the bundled model's says nothing of sampling).
GENERATION_OVERRIDE = {"temperature": 0.0, "max_new_tokens": 64}
GREETING_TEMPLATE = "{{ greeting | default('none') }}|{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--enable-request-id-headers", "--allowed-origins", json.dumps([ORIGIN]),
                        "--return-tokens-as-token-ids", "--no-dashboard", "--trust-request-chat-template",
                        "--override-generation-config", json.dumps(GENERATION_OVERRIDE),
                        "--default-chat-template-kwargs", json.dumps({"greeting": "hello"})])
    yield srv
    rc = srv.stop(signal.SIGTERM)
    assert rc == 0, srv.logs()[-3000:]


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url(path), json={"model": MODEL_NAME, **body}, timeout=120, **kw)


def _detokenize(server, tokens: list[int]) -> str:
    return _post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]


def test_chat_template_kwargs_and_continue_final_message(server):
    def rendered(**body) -> str:
        r = _post(server, "/tokenize", {"messages": CONVERSATION, "add_generation_prompt": False, **body})
        assert r.status_code == 200, r.text
        return _detokenize(server, r.json()["tokens"])

    # chat_template_kwargs are the template's variables, over --default-chat-template-kwargs
    assert rendered(chat_template=GREETING_TEMPLATE, chat_template_kwargs={"greeting": "hi"}).startswith("hi|Name")
    assert rendered(chat_template=GREETING_TEMPLATE).startswith("hello|Name")
    assert rendered(chat_template=GREETING_TEMPLATE, chat_template_kwargs={"other": 1}).startswith("hello|Name")
    # continue_final_message: the prompt stops inside the assistant's message, with no end of turn after it
    assert rendered(continue_final_message=True).endswith("<|im_start|>assistant\nThe colour I pick is")
    assert rendered().endswith("The colour I pick is<|im_end|>\n")

    # The chat completion continues that message: the same tokens as a completion of the rendered prompt.
    prompt = _post(server, "/tokenize", {"messages": CONVERSATION, "add_generation_prompt": False,
                                         "continue_final_message": True}).json()["tokens"]
    chat = _post(server, "/v1/chat/completions", {"messages": CONVERSATION, "add_generation_prompt": False,
                                                  "continue_final_message": True, "max_tokens": 12,
                                                  "temperature": 0.0, "ignore_eos": True})
    completion = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0.0,
                                                   "ignore_eos": True})
    assert chat.status_code == completion.status_code == 200
    assert chat.json()["choices"][0]["message"]["content"] == completion.json()["choices"][0]["text"]
    assert chat.json()["usage"]["prompt_tokens"] == len(prompt)

    both = _post(server, "/v1/chat/completions", {"messages": CONVERSATION, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    assert "add_generation_prompt" in both.json()["error"]["message"]
    clash = _post(server, "/v1/chat/completions", {"messages": CONVERSATION[:1], "chat_template_kwargs": {"tools": []}})
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "chat_template_kwargs"
    assert "'tools'" in clash.json()["error"]["message"]


def test_continuous_usage_stats_on_every_chunk(server):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = stream_chunks(server, "/v1/chat/completions", {"messages": CONVERSATION[:1], "max_tokens": 8,
                                                            "ignore_eos": True, "stream_options": opts})
    with_choices = [c for c in chunks if c["choices"]]
    prompt_tokens = with_choices[0]["usage"]["prompt_tokens"]
    counts = [c["usage"]["completion_tokens"] for c in with_choices]
    assert all(c["usage"]["total_tokens"] == prompt_tokens + c["usage"]["completion_tokens"] for c in with_choices)
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 8
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8

    plain = stream_chunks(server, "/v1/chat/completions", {"messages": CONVERSATION[:1], "max_tokens": 4,
                                                           "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain if c["choices"]) and plain[-1]["usage"]["completion_tokens"] <= 4

    # Completions: each choice counts its own prompt's tokens.
    prompts = ["Hello", "The capital of France is a city that"]
    lens = [len(_post(server, "/tokenize", {"prompt": p}).json()["tokens"]) for p in prompts]
    chunks = stream_chunks(server, "/v1/completions", {"prompt": prompts, "max_tokens": 5, "ignore_eos": True,
                                                       "stream_options": opts})
    seen = {0: 0, 1: 0}
    for c in (c for c in chunks if c["choices"]):
        idx, usage = c["choices"][0]["index"], c["usage"]
        assert usage["prompt_tokens"] == lens[idx] and usage["completion_tokens"] >= seen[idx]
        seen[idx] = usage["completion_tokens"]
    assert seen == {0: 5, 1: 5}


def test_return_tokens_as_token_ids(server):
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0.0, "logprobs": 2,
            "ignore_eos": True}
    as_ids = _post(server, "/v1/completions", body).json()["choices"][0]  # the server's default: on
    as_text = _post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": False}).json()["choices"][0]
    assert as_ids["text"] == as_text["text"]
    ids = [int(re.fullmatch(r"token_id:(\d+)", t).group(1)) for t in as_ids["logprobs"]["tokens"]]
    assert [_detokenize(server, [i]) for i in ids] == as_text["logprobs"]["tokens"]
    assert _detokenize(server, ids) == as_text["text"]
    assert all(re.fullmatch(r"token_id:\d+", t) for top in as_ids["logprobs"]["top_logprobs"] for t in top)

    chat = _post(server, "/v1/chat/completions", {"messages": CONVERSATION[:1], "max_tokens": 4, "temperature": 0.0,
                                                  "logprobs": True, "top_logprobs": 2})
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(re.fullmatch(r"token_id:\d+", e["token"]) for e in content)
    assert all(e["bytes"] == list(e["token"].encode()) for e in content)
    stream = stream_chunks(server, "/v1/chat/completions", {"messages": CONVERSATION[:1], "max_tokens": 3,
                                                             "logprobs": True, "return_tokens_as_token_ids": False})
    tokens = [e["token"] for c in stream if c["choices"] and c["choices"][0]["logprobs"]
              for e in c["choices"][0]["logprobs"]["content"]]
    assert len(tokens) == 3 and not any(t.startswith("token_id:") for t in tokens)


def test_request_id_headers(server):
    body = {"prompt": "Hello", "max_tokens": 3}
    r = _post(server, "/v1/completions", body, headers={"X-Request-Id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "cmpl-trace-42"
    # One id on two requests at once: both answered (the engine's own ids stay unique).
    with ThreadPoolExecutor(2) as pool:
        twins = list(pool.map(lambda _: _post(server, "/v1/chat/completions",
                                              {"messages": CONVERSATION[:1], "max_tokens": 8, "ignore_eos": True},
                                              headers={"X-Request-Id": "same"}), range(2)))
    assert [t.status_code for t in twins] == [200, 200]
    assert {t.json()["id"] for t in twins} == {"chatcmpl-same"}
    assert re.fullmatch(r"[0-9a-f]{32}", _post(server, "/v1/completions", body).headers["x-request-id"])
    assert re.fullmatch(r"[0-9a-f]{32}", httpx.get(server.url("/health")).headers["x-request-id"])
    bad = _post(server, "/v1/completions", body, headers={"X-Request-Id": "a b"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "X-Request-Id"
    m = server.wait_idle()
    assert m["pagedllm:kv_blocks_free"] == m["pagedllm:kv_blocks_total"]  # the twins freed their blocks


def test_cors_allows_only_the_configured_origin(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    ok = httpx.options(server.url("/v1/completions"), headers={"Origin": ORIGIN, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    denied = httpx.options(server.url("/v1/completions"), headers={"Origin": "https://other.example", **preflight})
    assert denied.status_code == 400 and "access-control-allow-origin" not in denied.headers
    models = httpx.get(server.url("/v1/models"), headers={"Origin": ORIGIN})
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in httpx.get(server.url("/v1/models"),
                                                          headers={"Origin": "https://other.example"}).headers


def test_generation_config_defaults_fill_unset_fields_and_cap_max_tokens(server):
    """temperature 0 from the override: a request without temperature is greedy (the same text as temperature 0
    given, twice); max_new_tokens 64 caps a request's max_tokens of 100."""
    body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True}
    unset = [_post(server, "/v1/completions", body).json()["choices"][0]["text"] for _ in range(2)]
    given = _post(server, "/v1/completions", {**body, "temperature": 0.0}).json()["choices"][0]["text"]
    assert unset == [given, given]
    hot = {_post(server, "/v1/completions", {**body, "temperature": 1.5, "seed": s}).json()["choices"][0]["text"]
           for s in range(3)}
    assert len(hot) > 1  # a request's own temperature still wins
    capped = _post(server, "/v1/completions", {**body, "max_tokens": 100}).json()
    assert capped["usage"]["completion_tokens"] == 64 and capped["choices"][0]["finish_reason"] == "length"


EFFORT_TEMPLATE = "{{ reasoning_effort | default('unset') }}|{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_reasoning_effort_reaches_the_chat_template(server):
    """OpenAI's reasoning_effort is the chat template's `reasoning_effort` variable (gpt-oss's template writes it into
    the system message); chat_template_kwargs naming it wins; an effort OpenAI does not define is a 400."""
    def prompt(**body) -> str:
        r = _post(server, "/v1/chat/completions", {"messages": CONVERSATION[:1], "max_tokens": 1,
                                                   "chat_template": EFFORT_TEMPLATE, "return_token_ids": True, **body})
        assert r.status_code == 200, r.text
        return _detokenize(server, r.json()["prompt_token_ids"])

    assert prompt(reasoning_effort="high").startswith("high|Name")
    assert prompt().startswith("unset|Name")
    assert prompt(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"}).startswith("low|Name")
    bad = _post(server, "/v1/chat/completions", {"messages": CONVERSATION[:1], "reasoning_effort": "extreme"})
    assert bad.status_code == 400 and "reasoning_effort" in bad.text
    # The Responses API's reasoning.effort is the same variable (its chat request carries it).
    r = _post(server, "/v1/responses", {"input": "Name a colour.", "max_output_tokens": 1,
                                        "reasoning": {"effort": "low", "summary": "auto"}})
    assert r.status_code == 200, r.text
    bad = _post(server, "/v1/responses", {"input": "Name a colour.", "reasoning": {"effort": "extreme"}})
    assert bad.status_code == 400 and "effort" in bad.text
