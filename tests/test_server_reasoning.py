"""`--reasoning-parser` (vLLM's): a thinking model's <think> block comes back as `reasoning`, apart from the
answer, on /v1/chat/completions (whole and streamed) and /v1/responses (a reasoning item). The bundled model does
not think, so a regex constraint makes it write a block: the split is checked against the constrained text."""
from __future__ import annotations

import re
import signal

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer  # noqa: E402

THINKING = r"<think>[a-z]{2,8}( [a-z]{2,8}){1,3}</think>[A-Z][a-z]{2,8}( [a-z]{2,8}){0,3}\."
PLAIN = r"[A-Z][a-z]{2,8}( [a-z]{2,8}){1,3}\."
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--reasoning-parser", "qwen3"])
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def _chat(client, regex, extra: dict | None = None, **kw):
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=60,
                                          extra_body={"structured_outputs": {"regex": regex}, **(extra or {})}, **kw)


def test_chat_reasoning_whole_and_streamed(client):
    msg = _chat(client, THINKING).choices[0].message
    reasoning, content = msg.model_extra["reasoning"], msg.content
    assert reasoning and content
    assert re.fullmatch(THINKING, f"<think>{reasoning}</think>{content}")
    assert re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){1,3}", reasoning)  # the markers are not in either part
    chunks = list(_chat(client, THINKING, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    # A chunk carries reasoning or content, never both; all the reasoning comes first.
    kinds = [("r" if d.model_extra.get("reasoning") else "") + ("c" if d.content else "") for d in deltas]
    assert "rc" not in kinds and "".join(k for k in kinds if k) == "r" * kinds.count("r") + "c" * kinds.count("c")


def test_output_without_a_block_is_all_content(client):
    msg = _chat(client, PLAIN).choices[0].message
    assert msg.model_extra.get("reasoning") is None and re.fullmatch(PLAIN, msg.content)


def test_responses_put_the_reasoning_in_its_own_item(client):
    chat = _chat(client, THINKING).choices[0].message
    r = client.responses.create(model=MODEL_NAME, input=MESSAGES[0]["content"], temperature=0, max_output_tokens=60,
                                extra_body={"structured_outputs": {"regex": THINKING}})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == chat.model_extra["reasoning"] and r.output_text == chat.content
    events = list(client.responses.create(model=MODEL_NAME, input=MESSAGES[0]["content"], temperature=0,
                                          max_output_tokens=60, stream=True,
                                          extra_body={"structured_outputs": {"regex": THINKING}}))
    assert [e.delta for e in events if e.type == "response.reasoning_text.delta"] == [chat.model_extra["reasoning"]]
    assert events[-1].type == "response.completed" and events[-1].response.output_text == chat.content


def test_include_reasoning_false_drops_it(client):
    """vLLM's include_reasoning=false: the same answer, no reasoning (whole or streamed)."""
    full = _chat(client, THINKING).choices[0].message
    msg = _chat(client, THINKING, {"include_reasoning": False})
    assert msg.choices[0].message.content == full.content
    assert msg.choices[0].message.model_extra.get("reasoning") is None
    chunks = list(_chat(client, THINKING, {"include_reasoning": False}, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.model_extra.get("reasoning") for d in deltas)
    assert "".join(d.content or "" for d in deltas) == full.content
