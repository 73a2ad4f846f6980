"""Structured outputs and tool calling through the real server with the official `openai` client."""
from __future__ import annotations

import json
import re
import signal

import httpx
import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")

from conftest_server import SMALL_SERVER_ARGS, RemoteServer  # noqa: E402

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                                       "required": ["tz"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SMALL_SERVER_ARGS)
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


def test_parse_with_pydantic_response_format(client):
    completion = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Invent a person."}],
        response_format=Person, max_tokens=60, temperature=0.7, seed=1)
    msg = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, Person), msg.content
    assert 0 <= msg.parsed.age <= 120


def test_response_format_json_object_and_extra_body(client):
    out = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=40,
                                         response_format={"type": "json_object"}, temperature=0)
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    regex = r"[A-Z][a-z]{2,8} is (sunny|rainy)\."
    for body in ({"structured_outputs": {"regex": regex}}, {"guided_regex": regex}):
        comp = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The weather:", max_tokens=20,
                                         temperature=1.0, extra_body=body)
        assert re.fullmatch(regex, comp.choices[0].text), comp.choices[0].text
    comp = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Yes or no?", max_tokens=5, n=3,
                                     temperature=1.0, extra_body={"guided_choice": ["yes", "no"]})
    assert {c.text for c in comp.choices} <= {"yes", "no"}


def test_bad_constraints_are_400s_naming_the_field(client, server):
    cases = [
        ({"guided_regex": "a(b"}, "regex"),
        ({"guided_json": {"type": "objectx"}}, "json"),
        ({"guided_grammar": "root ::= undefined_rule"}, "grammar"),
        ({"guided_choice": []}, "choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "only one output constraint"),
        ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "exactly one of"),
        ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ]
    # A constrained request streams while the bad ones arrive: it must finish intact.
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Count:", max_tokens=30, stream=True,
                                       temperature=0, extra_body={"guided_regex": r"[0-9]{200}"})
    first = next(iter(stream))
    for body, needle in cases:
        r = httpx.post(server.url("/v1/completions"), json={"prompt": "x", "max_tokens": 5, **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        assert needle in r.json()["error"]["message"], (body, r.text)
    r = httpx.post(server.url("/v1/chat/completions"), timeout=60, json={
        "messages": MESSAGES, "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    chunks = [first] + list(stream)
    text = "".join(c.choices[0].text for c in chunks)
    assert text.isdigit() and chunks[-1].choices[0].finish_reason == "length", text
    # The engine still serves, and no KV block leaked.
    assert client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=3).choices[0].text
    m = server.wait_idle()
    assert m["pagedllm:kv_blocks_free"] == m["pagedllm:kv_blocks_total"]


def test_tools_named_required_auto(client):
    named = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0.5, seed=3)
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])

    req = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=80,
                                         tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", temperature=0)
    choice = req.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])

    # auto: the Hermes parser reads a <tool_call> block the model wrote (forced here by a regex so the test
    # does not depend on the small model choosing to call a tool).
    hermes = r'Let me check\.<tool_call>\{"name": "get_time", "arguments": \{"tz": "(UTC|CET)"\}\}</tool_call>'
    auto = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, tools=[TIME_TOOL],
                                          max_tokens=150, temperature=0, extra_body={"guided_regex": hermes})
    msg = auto.choices[0].message
    assert auto.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Let me check." and msg.tool_calls[0].function.name == "get_time"
    assert json.loads(msg.tool_calls[0].function.arguments)["tz"] in ("UTC", "CET")
    plain = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, tools=[TIME_TOOL],
                                           tool_choice="none", max_tokens=8, temperature=0)
    assert not plain.choices[0].message.tool_calls and plain.choices[0].finish_reason in ("stop", "length")


def test_streaming_tool_call_deltas(client):
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=MESSAGES, tools=[WEATHER_TOOL], max_tokens=60, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0)
    name, args, ids = None, "", set()
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            assert d.index == 0
            ids |= {d.id} - {None}
            name = d.function.name or name
            args += d.function.arguments or ""
    assert name == "get_weather" and len(ids) == 1
    jsonschema.validate(json.loads(args), WEATHER_TOOL["function"]["parameters"])
    # auto, streamed: content first, then the parsed call.
    hermes = r'Sure\.<tool_call>\{"name": "get_time", "arguments": \{"tz": "UTC"\}\}</tool_call>'
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, tools=[TIME_TOOL],
                                            max_tokens=150, stream=True, temperature=0, extra_body={"guided_regex": hermes})
    content, calls, finish = "", {}, None
    for chunk in stream:
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            calls.setdefault(d.index, ["", ""])
            calls[d.index][0] += d.function.name or ""
            calls[d.index][1] += d.function.arguments or ""
        finish = ch.finish_reason or finish
    assert content == "Sure." and calls == {0: ["get_time", '{"tz": "UTC"}']} and finish == "tool_calls"


def test_openapi_shows_new_fields(server):
    spec = httpx.get(server.url("/openapi.json"), timeout=30).json()
    text = json.dumps(spec)
    for field in ("response_format", "structured_outputs", "guided_json", "guided_choice", "tools", "tool_choice"):
        assert f'"{field}"' in text, field
