"""Tool-call parsers (vLLM's names and formats) on model outputs as each model family writes them, alone and as
`ChatTools` uses them with `--tool-call-parser`: whole messages and streamed deltas."""
from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_tools import ChatTools
from pagedllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    StreamingToolCalls,
    extract_tool_calls,
    tool_parser_classes,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "hours": {"type": "array"},
                                     "note": {"type": ["string", "null"]}}}}}
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("now", {})]

# Each format's rendering of CALLS after the content "Let me check.", as the model family writes it.
OUTPUTS = {
    "hermes": 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
              '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
    "mistral": 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]now[ARGS]{}',
    "phi4_mini_json": 'Let me check.functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                      '{"name": "now", "arguments": {}}]',
    "qwen3_coder": "Let me check.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n"
                   "</function>\n</tool_call>",
}
# Formats whose output is nothing but the calls.
CALLS_ONLY = {
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; {"name": "now", '
                   '"parameters": {}}',
    "pythonic": '[get_weather(city="Paris", days=3), now()]',
    "llama4_pythonic": '<|python_start|>[get_weather(city="Paris", days=3), now()]<|python_end|>',
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "now", '
               '"arguments": {}}]',
}


@pytest.mark.parametrize("text", [
    ' <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "now", "arguments": {}}]',
    '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "now", "arguments": {}}]\n'])
def test_granite_3_1_marker_and_a_bare_list(text: str) -> None:
    result = _parser("granite").extract(text)
    assert _calls(result) == CALLS and result.content is None
    # a bare list of objects that are not calls, and a call list after other text, stay content
    for other in ('[{"name": "Ada"}, {"name": "Alan"}]', 'Sure. <|tool_call|>[{"name": "now", "arguments": {}}]'):
        assert _parser("granite").extract(other).tool_calls == []


def _calls(result) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


def _parser(name: str, tools=None):
    return TOOL_PARSERS[name]([_tool(WEATHER)] if tools is None else tools)


def _tool(spec: dict):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[spec]).tools[0]


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_content_then_calls(name: str) -> None:
    result = _parser(name).extract(OUTPUTS[name])
    assert _calls(result) == CALLS
    assert result.content == "Let me check."
    assert len({c.id for c in result.tool_calls}) == 2


@pytest.mark.parametrize("name", sorted(CALLS_ONLY))
def test_calls_only_formats(name: str) -> None:
    result = _parser(name).extract(CALLS_ONLY[name])
    assert _calls(result) == CALLS
    assert result.content is None


@pytest.mark.parametrize("name", sorted(set(TOOL_PARSERS)))
@pytest.mark.parametrize("text", ["The weather in Paris is mild.", "[1, 2, 3] are the numbers.", "[x for x in y]",
                                  '{"a": 1} is JSON.', "<tool_call>not json</tool_call>", "functools[oops",
                                  "[f(1)]", "[f(a=b)]", "[TOOL_CALLS]get_weather[ARGS]{broken", ""])
def test_plain_text_and_broken_calls_stay_content(name: str, text: str) -> None:
    result = _parser(name).extract(text)
    assert result.tool_calls == [] and result.content == text


def test_mistral_before_v11_and_ids() -> None:
    parser = _parser("mistral")
    result = parser.extract('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
                            '{"name": "now", "arguments": {}}]')
    assert _calls(result) == CALLS and result.content is None
    # Mistral's chat templates accept 9-character alphanumeric ids only; a [CALL_ID] the model wrote is kept.
    assert all(len(c.id) == 9 and c.id.isalnum() for c in result.tool_calls)
    kept = parser.extract('[TOOL_CALLS]now[CALL_ID]abc123XYZ[ARGS]{}')
    assert [c.id for c in kept.tool_calls] == ["abc123XYZ"]
    assert _calls(parser.extract('[TOOL_CALLS]get_weather{"city": "Paris", "days": 3}')) == CALLS[:1]  # v11


def test_qwen3_coder_types_values_by_the_schema() -> None:
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nC:\\temp \"x\"\n</parameter>\n"
            "<parameter=days>\n7\n</parameter>\n<parameter=metric>\nFalse\n</parameter>\n"
            "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
            "<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>")
    [(name, args)] = _calls(_parser("qwen3_coder").extract(text))
    assert name == "get_weather"
    # Raw text, no JSON escaping: backslashes and quotes arrive as written; unknown parameters stay strings.
    assert args == {"city": 'C:\\temp "x"', "days": 7, "metric": False, "hours": [1, 2], "note": None,
                    "extra": "42"}
    no_schema = _parser("qwen3_coder", tools=[]).extract(text)
    assert json.loads(no_schema.tool_calls[0].arguments)["days"] == "7"


def test_pythonic_literals_become_json() -> None:
    text = '[search(q="a \'quoted\' word", n=2, exact=True, filters={"lang": ["en", None]}, score=0.5)]'
    assert _calls(_parser("pythonic").extract(text)) == [
        ("search", {"q": "a 'quoted' word", "n": 2, "exact": True, "filters": {"lang": ["en", None]}, "score": 0.5})]
    assert _parser("pythonic").extract('[f(x={1, 2})]').tool_calls == []  # a set has no JSON form


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_streaming_sends_content_then_holds_the_calls(name: str) -> None:
    text = OUTPUTS[name]
    streamer = StreamingToolCalls([_parser(name)])
    sent = "".join(streamer.content_delta(text[:i]) for i in range(1, len(text) + 1))
    assert sent == "Let me check."  # never a piece of a marker
    rest, calls = streamer.finish(text)
    assert rest == "" and [(c.name, json.loads(c.arguments)) for c in calls] == CALLS


def test_unnamed_detection_tries_every_format() -> None:
    parsers = [cls([_tool(WEATHER)]) for cls in tool_parser_classes(None)]
    for text in list(OUTPUTS.values()) + list(CALLS_ONLY.values()):
        assert _calls(extract_tool_calls(text, parsers)) == CALLS, text
    assert _calls(extract_tool_calls(OUTPUTS["hermes"])) == CALLS  # default: every format, no schemas
    assert len(tool_parser_classes(None)) == len(set(TOOL_PARSERS.values()))
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'; known: .*hermes"):
        tool_parser_classes("nope")


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER], **kw)


def test_chat_tools_uses_the_named_parser_only() -> None:
    hermes_text = OUTPUTS["hermes"]
    message, finish = ChatTools(_request(), "hermes").message(hermes_text, "stop")
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "now"] and finish == "tool_calls"
    # Named pythonic: a Hermes block is content, and a pythonic list is calls.
    message, finish = ChatTools(_request(), "pythonic").message(hermes_text, "stop")
    assert message.tool_calls in (None, []) and message.content == hermes_text and finish == "stop"
    message, _ = ChatTools(_request(), "pythonic").message(CALLS_ONLY["pythonic"], "stop")
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "now"]


def test_mistral_keeps_special_tokens_only_when_named_and_auto() -> None:
    req = _request()
    ChatTools(req, "mistral")
    assert req.skip_special_tokens is False
    for parser, choice in ((None, "auto"), ("hermes", "auto"), ("mistral", "none")):
        req = _request(tool_choice=choice)
        ChatTools(req, parser)
        assert req.skip_special_tokens is True


def test_serve_accepts_vllm_tool_flags() -> None:
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "qwen3_coder"
    # Checked at start-up, once a --tool-parser-plugin could have added names (argparse takes any name).
    from pagedllm.entrypoints.openai.cli_serve import tool_options

    with pytest.raises(ValueError, match="unknown tool call parser 'nope'; known: .*hermes"):
        tool_options(build_parser().parse_args(["serve", "--tool-call-parser", "nope"]))
