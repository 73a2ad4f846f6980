"""POST /v1/responses and GET /v1/responses/{id} (OpenAI's Responses API, as vLLM serves it), driven by the
official `openai` client against a real server process on the bundled model. The chat endpoint, proven against
the offline engine elsewhere, is the reference: a response is the chat completion its input amounts to."""
from __future__ import annotations

import json
import signal

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer  # noqa: E402

GREEDY = dict(model=MODEL_NAME, temperature=0)
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SMALL_SERVER_ARGS, env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})  # vLLM's switch
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def _chat(client, messages, max_tokens):
    return client.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY)


def test_a_response_is_the_chat_completion_of_its_input(client):
    r = client.responses.create(input="Name three colors.", instructions="Answer briefly.", max_output_tokens=24,
                                **GREEDY)
    chat = _chat(client, [{"role": "system", "content": "Answer briefly."},
                          {"role": "user", "content": "Name three colors."}], 24)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL_NAME
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    want_status = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert r.status == want_status and r.instructions == "Answer briefly." and r.max_output_tokens == 24
    # Input items: text parts read as the same conversation; a message's parts joined with "\n", as a chat
    # message's are.
    items = client.responses.create(input=[
        {"role": "system", "content": [{"type": "input_text", "text": "Answer briefly."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name three colors."}]}],
        max_output_tokens=24, **GREEDY)
    assert items.output_text == r.output_text
    parts = client.responses.create(input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name three"},
                                                        {"type": "input_text", "text": "colors."}]}],
        max_output_tokens=12, **GREEDY)
    chat_parts = _chat(client, [{"role": "user", "content": [{"type": "text", "text": "Name three"},
                                                             {"type": "text", "text": "colors."}]}], 12)
    assert parts.output_text == chat_parts.choices[0].message.content
    assert parts.usage.input_tokens == chat_parts.usage.prompt_tokens


def test_max_output_tokens_ends_incomplete(client):
    r = client.responses.create(input="Write a long story about a dragon.", max_output_tokens=5, **GREEDY)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"


def test_previous_response_id_continues_the_conversation_and_retrieve_reads_it_back(client, server):
    first = client.responses.create(input="Name a fruit.", instructions="Answer in one word.", max_output_tokens=8,
                                    **GREEDY)
    second = client.responses.create(input="Name another one.", previous_response_id=first.id, max_output_tokens=8,
                                     **GREEDY)
    # The stored turn is replayed; the earlier instructions are not carried over (OpenAI's rule).
    chat = _chat(client, [{"role": "user", "content": "Name a fruit."},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "Name another one."}], 8)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.previous_response_id == first.id
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage
    unstored = client.responses.create(input="Hi", max_output_tokens=2, store=False, **GREEDY)
    assert first.store is True and unstored.store is False  # what the server did, as OpenAI reports it
    for rid, param in ((unstored.id, "response_id"), ("resp_missing", "response_id")):
        r = httpx.get(server.url(f"/v1/responses/{rid}"))
        assert r.status_code == 404 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.NotFoundError, match="resp_missing"):
        client.responses.create(input="Hi", previous_response_id="resp_missing", max_output_tokens=2, **GREEDY)


def test_streamed_events_build_the_same_response(client):
    whole = client.responses.create(input="Count to five.", max_output_tokens=12, include=[
        "message.output_text.logprobs"], top_logprobs=2, **GREEDY)
    events = list(client.responses.create(input="Count to five.", max_output_tokens=12, stream=True,
                                          include=["message.output_text.logprobs"], top_logprobs=2, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    text = "".join(e.delta for e in deltas)
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    lps = final.output[0].content[0].logprobs
    assert len(lps) == whole.usage.output_tokens == sum(len(e.logprobs) for e in deltas)
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob for lp in lps)
    assert [lp.logprob for lp in lps] == pytest.approx([lp.logprob for lp in whole.output[0].content[0].logprobs],
                                                       abs=1e-4)
    assert "".join(lp.token for lp in lps) == whole.output_text


def test_text_format_json_schema_constrains_the_output(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(input="Give a person's name and age.", max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}}, **GREEDY)
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    # A schema the grammar engine refuses: streamed, an `error` event naming text.format, then response.failed.
    bad = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}
    events = list(client.responses.create(input="Hi", max_output_tokens=4, stream=True, text=bad, **GREEDY))
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-2].param == "text.format" and "nope" in events[-2].message


def test_function_calls_and_their_outputs(client):
    r = client.responses.create(input="What's the weather in Paris?", tools=[WEATHER], tool_choice="required",
                                max_output_tokens=60, **GREEDY)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" and "city" in json.loads(c.arguments) for c in calls)
    assert all(c.call_id and c.id.startswith("fc_") for c in calls)
    named = client.responses.create(input="Weather in Rome?", tools=[WEATHER], max_output_tokens=40,
                                    tool_choice={"type": "function", "name": "get_weather"}, **GREEDY)
    assert [o.type for o in named.output] == ["function_call"] and "city" in json.loads(named.output[0].arguments)
    # The next turn sends the call and its result back; the model answers in text.
    call = calls[0]
    follow = client.responses.create(input=[
        {"role": "user", "content": "What's the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        tools=[WEATHER], max_output_tokens=30, **GREEDY)
    assert follow.output and follow.usage.input_tokens > r.usage.input_tokens
    streamed = list(client.responses.create(input="What's the weather in Paris?", tools=[WEATHER], stream=True,
                                            tool_choice="required", max_output_tokens=60, **GREEDY))
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert [(d.name, d.arguments) for d in done] == [(c.name, c.arguments) for c in calls]
    assert "response.function_call_arguments.done" in [e.type for e in streamed]


@pytest.mark.parametrize("body,param,needle", [
    ({"input": [{"type": "reasoning", "summary": []}]}, "input", "items of type 'reasoning' are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "only text parts"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input", "input[0].role must be one of"),
    ({"input": []}, "input", "input must not be empty"),
    ({"input": "hi", "background": True}, "background", "background responses are not supported"),
    ({"input": "hi", "include": ["file_search_call.results"]}, "include", "not supported"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"input": "hi", "top_logprobs": 99}, "top_logprobs", "top_logprobs must be in [0, 20]"),
    ({"input": "hi", "prompt_logprobs": 1}, "prompt_logprobs", "not available on /v1/responses"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens", "maximum context length"),
    ({"input": "hi " * 1100}, "input", "maximum context length"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format", ""),
    ({"input": "hi", "truncation": "auto"}, "truncation", ""),
])
def test_bad_requests_are_400s_naming_the_field(server, body, param, needle):
    r = httpx.post(server.url("/v1/responses"), json={"model": MODEL_NAME, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert server.wait_idle()["pagedllm:kv_blocks_free"] > 0
    ok = httpx.post(server.url("/v1/responses"), json={"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["status"] in ("completed", "incomplete")


def test_without_the_store_nothing_is_kept():
    from pagedllm.entrypoints.openai.serving_common import OpenAIError
    from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses, ResponseStore, StoredResponse

    off = OpenAIServingResponses(ctx=None, store=None)
    with pytest.raises(OpenAIError, match="--enable-responses-api-store") as e:
        off.retrieve("resp_x")
    assert e.value.status == 404
    with pytest.raises(OpenAIError, match="--enable-responses-api-store") as e:
        off._previous("resp_x")
    assert e.value.param == "previous_response_id"
    store = ResponseStore(capacity=2)
    for i in range(3):
        store.put(f"r{i}", StoredResponse(body={"id": f"r{i}"}, messages=[]))
    assert store.get("r0") is None and store.get("r2").body == {"id": "r2"}


def test_invocations_dispatch_on_the_body(server, client):
    """vLLM's (SageMaker's) /invocations: `messages` is a chat completion, `prompt` a completion, `input` a
    response, each the same as on its own route."""
    post = lambda body: httpx.post(server.url("/invocations"), json={"model": MODEL_NAME, "temperature": 0,  # noqa: E731
                                                                       **body}, timeout=60)
    messages = [{"role": "user", "content": "Name a planet."}]
    chat = post({"messages": messages, "max_tokens": 6}).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == _chat(client, messages, 6).choices[0].message.content
    cmpl = post({"prompt": "The capital of France is", "max_tokens": 4}).json()
    want = client.completions.create(prompt="The capital of France is", max_tokens=4, **GREEDY)
    assert cmpl["object"] == "text_completion" and cmpl["choices"][0]["text"] == want.choices[0].text
    resp = post({"input": "Name a planet.", "max_output_tokens": 6}).json()
    assert resp["object"] == "response" and resp["output"][0]["content"][0]["text"] == chat["choices"][0][
        "message"]["content"]
    for body, param in (({"max_tokens": 4}, "body"), ({"prompt": "hi", "max_tokens": "4"}, "max_tokens")):
        r = post(body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    bad_json = httpx.post(server.url("/invocations"), content=b"{nope", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    assert httpx.get(server.url("/ping")).status_code == 200

