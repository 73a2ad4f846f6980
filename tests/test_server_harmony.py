"""`--reasoning-parser openai_gptoss` with `--tool-call-parser openai` (vLLM's names) on a real server: GPT-OSS's
harmony output comes back as `reasoning`, `content` and `tool_calls`, whole and streamed, on /v1/chat/completions
and /v1/responses. The bundled model does not speak harmony, so a regex constraint makes it write harmony text (its
tokenizer has the markers as ordinary text, which the parsers read all the same; they never reach the client)."""
from __future__ import annotations

import json
import re
import signal

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer  # noqa: E402

WORDS = r"[a-z]{2,8}( [a-z]{2,8}){1,3}"
ANSWER = r"[A-Z][a-z]{2,8}( [a-z]{2,8}){0,3}\."
ANALYSIS = rf"<\|channel\|>analysis<\|message\|>{WORDS}<\|end\|><\|start\|>assistant"
FINAL = rf"{ANALYSIS}<\|channel\|>final<\|message\|>{ANSWER}"
CALL = (rf'{ANALYSIS}<\|channel\|>commentary to=functions\.get_weather <\|constrain\|>json<\|message\|>'
        r'\{"location": "[A-Z][a-z]{2,8}"\}<\|call\|>')
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {
                                               "location": {"type": "string"}}, "required": ["location"]}}}]
MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
           "<|im_end|>")


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai"])
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def answer(client):
    """The constrained answer, whole (greedy: every other request of this regex writes the same text)."""
    return _chat(client, FINAL).choices[0]


def _chat(client, regex, **kw):
    return client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=160,
                                          extra_body={"structured_outputs": {"regex": regex}}, **kw)


def _clean(*parts: str | None) -> None:
    for part in parts:
        assert part is None or not any(m in part for m in MARKERS), part


def test_reasoning_and_answer_whole_and_streamed(client, answer):
    choice = answer
    reasoning, content = choice.message.model_extra["reasoning"], choice.message.content
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert re.fullmatch(WORDS, reasoning) and re.fullmatch(ANSWER, content)  # no marker or channel name in either
    chunks = list(_chat(client, FINAL, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    for d in deltas:
        _clean(d.model_extra.get("reasoning"), d.content)
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_the_answer_with_tools_offered_streams_as_content(client, answer):
    """The content goes through the tool parser (the split's tool view, no call in it) as it is written."""
    chunks = list(_chat(client, FINAL, tools=TOOLS, tool_choice="auto", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    for d in deltas:
        _clean(d.model_extra.get("reasoning"), d.content)
    assert not any(d.tool_calls for d in deltas)
    assert "".join(d.content or "" for d in deltas) == answer.message.content
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == answer.message.model_extra["reasoning"]
    assert len([d for d in deltas if d.content]) > 1  # streamed, not held back to the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_a_harmony_tool_call_comes_back_as_tool_calls(client):
    choice = _chat(client, CALL, tools=TOOLS, tool_choice="auto").choices[0]
    msg = choice.message
    assert choice.finish_reason == "tool_calls" and msg.content is None
    assert re.fullmatch(WORDS, msg.model_extra["reasoning"])
    [call] = msg.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert list(args) == ["location"] and re.fullmatch(r"[A-Z][a-z]{2,8}", args["location"])
    chunks = list(_chat(client, CALL, tools=TOOLS, tool_choice="auto", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    for d in deltas:
        _clean(d.model_extra.get("reasoning"), d.content)
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == msg.model_extra["reasoning"]
    assert not "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls[0].function.name == "get_weather" and calls[0].index == 0
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == args
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_responses_split_reasoning_and_calls(client, answer):
    chat = answer.message
    r = client.responses.create(model=MODEL_NAME, input=MESSAGES[0]["content"], temperature=0, max_output_tokens=160,
                                extra_body={"structured_outputs": {"regex": FINAL}})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == chat.model_extra["reasoning"] and r.output_text == chat.content
    r = client.responses.create(model=MODEL_NAME, input=MESSAGES[0]["content"], temperature=0, max_output_tokens=160,
                                tools=[{"type": "function", **TOOLS[0]["function"]}],
                                extra_body={"structured_outputs": {"regex": CALL}})
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[1].name == "get_weather" and "location" in json.loads(r.output[1].arguments)
