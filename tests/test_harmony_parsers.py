"""GPT-OSS's harmony format: `--reasoning-parser openai_gptoss` and `--tool-call-parser openai` (vLLM's names) on
output text, whole and streamed in any chunking (one character at a time, random chunks), alone and chained as the
chat handler chains them (the reasoning split hands its tool view to ChatTools)."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from pagedllm.entrypoints.openai.harmony import MARKERS, split_harmony
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.reasoning import ReasoningParser
from pagedllm.entrypoints.openai.serving_chat import keep_special_tokens, output_splitter
from pagedllm.entrypoints.openai.serving_tools import ChatTools
from pagedllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    OpenAIToolParser,
    StreamingToolCalls,
    extract_tool_calls,
    tool_parser_classes,
)
from pagedllm.reasoning import REASONING_PARSERS, reasoning_token_ids

A = "<|start|>assistant"
WEATHER_CALL = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location":"Paris"}<|call|>'
PARIS = ("get_weather", {"location": "Paris"})

CASES = {  # name: (output text, reasoning, content, calls as (name, parsed JSON arguments or the raw text))
    "analysis_then_final": (
        f"<|channel|>analysis<|message|>We need to answer 2+2.<|end|>{A}<|channel|>final<|message|>The answer is "
        "4.<|return|>", "We need to answer 2+2.", "The answer is 4.", []),
    "final_without_eos_text": (
        f"<|channel|>analysis<|message|>Easy.<|end|>{A}<|channel|>final<|message|>4.", "Easy.", "4.", []),
    "analysis_cut_by_max_tokens": ("<|channel|>analysis<|message|>We need to think about the", "We need to think "
                                   "about the", None, []),
    "header_cut_by_max_tokens": (f"<|channel|>analysis<|message|>Done.<|end|>{A}<|channel|>fin", "Done.", None, []),
    "final_only": ("<|channel|>final<|message|>Just the answer.<|return|>", None, "Just the answer.", []),
    "two_analysis_messages": (
        f"<|channel|>analysis<|message|>First.<|end|>{A}<|channel|>analysis<|message|>Second.<|end|>{A}"
        "<|channel|>final<|message|>Done.", "First.\nSecond.", "Done.", []),
    "text_that_looks_like_markers": (
        "<|channel|>final<|message|>1 < 2, a<b and <|x|> stay.<|return|>", None, "1 < 2, a<b and <|x|> stay.", []),
    "preamble_then_call": (
        f"<|channel|>analysis<|message|>Need weather.<|end|>{A}<|channel|>commentary<|message|>Let me check."
        f"<|end|>{A}{WEATHER_CALL}", "Need weather.", "Let me check.", [PARIS]),
    "one_call": (f"<|channel|>analysis<|message|>Need weather.<|end|>{A}{WEATHER_CALL}", "Need weather.", None,
                 [PARIS]),
    "call_first_without_eos_text": (WEATHER_CALL.removesuffix("<|call|>"), None, None, [PARIS]),
    "recipient_before_channel": (
        f"<|channel|>analysis<|message|>Need weather.<|end|>{A} to=functions.get_weather<|channel|>commentary json"
        '<|message|>{"location": "Paris"}<|call|>', "Need weather.", None, [PARIS]),
    "recipient_in_the_first_header": (
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Paris"}<|call|>', None, None,
        [PARIS]),
    "no_constrain": ('<|channel|>commentary to=functions.get_weather<|message|>{"location": "Paris"}<|call|>', None,
                     None, [PARIS]),
    "two_calls": (
        f"<|channel|>analysis<|message|>Two things.<|end|>{A}{WEATHER_CALL}{A}<|channel|>commentary to=functions.now "
        "<|constrain|>json<|message|>{}<|call|>", "Two things.", None, [PARIS, ("now", {})]),
    "invalid_json_kept_as_written": (
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": Paris}<|call|>',
        None, None, [("get_weather", '{"location": Paris}')]),
    "non_json_content_type_kept_as_written": (
        "<|channel|>commentary to=functions.search <|constrain|>text<|message|>cats and dogs<|call|>", None, None,
        [("search", "cats and dogs")]),
    "call_cut_by_max_tokens_is_no_call": (
        f"<|channel|>analysis<|message|>Need weather.<|end|>{A}<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"locat', "Need weather.", None, []),
    "builtin_tool_message_is_neither": (
        f"<|channel|>analysis to=browser.search<|message|>query<|call|>{A}<|channel|>final<|message|>Found.", "query",
        "Found.", []),
    "not_harmony_is_content": ("The capital of France is Paris.", None, "The capital of France is Paris.", []),
    "empty": ("", None, None, []),
}
_IDS = sorted(CASES)


def _calls(calls) -> list[tuple[str, object]]:
    out = []
    for c in calls:
        try:
            out.append((c.name, json.loads(c.arguments)))
        except ValueError:
            out.append((c.name, c.arguments))
    return out


def _cuts(text: str, rng: random.Random) -> list[list[int]]:
    """Chunk ends: one character at a time, and a few random chunkings."""
    out = [list(range(1, len(text) + 1))]
    for _ in range(4):
        ends, i = [], 0
        while i < len(text):
            i = min(len(text), i + rng.randint(1, 12))
            ends.append(i)
        out.append(ends)
    return [ends or [0] for ends in out]


def _no_marker(*parts: str | None) -> None:
    for part in parts:
        assert part is None or not any(m in part for m in MARKERS), part


@pytest.mark.parametrize("name", _IDS)
def test_reasoning_split_whole_and_streamed(name: str) -> None:
    text, reasoning, content, _ = CASES[name]
    parser = ReasoningParser("openai_gptoss")
    assert parser.split(text) == (reasoning, content)
    for ends in _cuts(text, random.Random(name)):
        stream = parser.stream()
        r_all = c_all = ""
        for i, end in enumerate(ends):
            r, c = stream.feed(text[:end], finished=i == len(ends) - 1)
            _no_marker(r, c)
            r_all, c_all = r_all + r, c_all + c
        assert (r_all or None, c_all or None) == (reasoning, content), ends


@pytest.mark.parametrize("name", _IDS)
def test_tool_parser_on_the_raw_output(name: str) -> None:
    text, _, content, calls = CASES[name]
    result = OpenAIToolParser().extract(text)
    assert _calls(result.tool_calls) == calls
    if calls:  # as vLLM: the content is the final text or a preamble, never the reasoning
        assert result.content == content
    else:  # nothing to call: the text stays as it was (the reasoning split runs before this parser)
        assert result.content == text


@pytest.mark.parametrize("name", _IDS)
def test_reasoning_and_tool_parsers_chained(name: str) -> None:
    """Whole: the split's tool view through the tool parser; streamed: the stream's content through
    StreamingToolCalls, as the chat handler does. Both agree, and no marker reaches the client."""
    text, reasoning, content, calls = CASES[name]
    parser = ReasoningParser("openai_gptoss")
    r_whole, view = parser.split(text, tool_calls=True)
    result = extract_tool_calls(view or "", [OpenAIToolParser()])
    assert r_whole == reasoning and (result.content or None) == content and _calls(result.tool_calls) == calls
    for ends in _cuts(text, random.Random(name + "chained")):
        stream, tools = parser.stream(tool_calls=True), StreamingToolCalls([OpenAIToolParser()])
        r_all = c_all = ""
        for end in ends:
            r, _ = stream.feed(text[:end], finished=end == ends[-1])
            delta = tools.content_delta(stream.content)
            _no_marker(r, delta)
            r_all, c_all = r_all + r, c_all + delta
        rest, streamed_calls = tools.finish(stream.content)
        _no_marker(rest)
        assert (r_all or None, (c_all + rest) or None) == (reasoning, content), ends
        assert _calls(streamed_calls) == calls


def test_streaming_holds_back_a_cut_marker_and_an_undecided_start() -> None:
    stream = ReasoningParser("openai_gptoss").stream()
    assert stream.feed("<|chan", False) == ("", "")
    assert stream.feed("<|channel|>analysis<|message|>Think <|e", False) == ("Think ", "")
    assert stream.feed("<|channel|>analysis<|message|>Think <|end|><|start|>assistant<|channel|>final<|message|>A",
                       False) == ("", "A")
    plain = ReasoningParser("openai_gptoss").stream()
    assert plain.feed(" t", False) == ("", "")  # " to=functions…" would be a header
    assert plain.feed(" the", False) == ("", " the")


def test_split_keeps_the_call_messages_apart() -> None:
    parts = split_harmony(CASES["preamble_then_call"][0])
    assert [(m.channel, m.recipient, m.content_type) for m in parts.calls] == [
        ("commentary", "functions.get_weather", "json")]
    assert parts.tool_view().startswith("Let me check.<|start|>assistant<|channel|>commentary to=functions.get_weather")


def test_names_and_registration() -> None:
    assert "openai_gptoss" in REASONING_PARSERS
    assert TOOL_PARSERS["openai"] is OpenAIToolParser and OpenAIToolParser.needs_special_tokens
    assert OpenAIToolParser in tool_parser_classes(None)  # tried by detection too (its markers kept only when named)
    assert ReasoningParser("openai_gptoss").needs_special_tokens and not ReasoningParser("qwen3").needs_special_tokens


def _request(**kw) -> ChatCompletionRequest:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"location": {"type": "string"}}}}}
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[tool], **kw)


def _ctx(reasoning_parser: str | None, tool_call_parser: str | None):
    return SimpleNamespace(reasoning_parser=ReasoningParser(reasoning_parser) if reasoning_parser else None,
                           tool_call_parser=tool_call_parser)


def test_chat_wiring_keeps_special_tokens_and_hands_calls_through() -> None:
    req = _request()
    keep_special_tokens(_ctx("openai_gptoss", None), req)
    assert req.skip_special_tokens is False
    req = _request()
    keep_special_tokens(_ctx("qwen3", None), req)
    assert req.skip_special_tokens is True
    both = _ctx("openai_gptoss", "openai")
    tools = ChatTools(_request(), "openai")
    parser, harmony_calls = output_splitter(both, tools)
    assert parser.name == "openai_gptoss" and harmony_calls
    # The whole message as the chat handler builds it.
    reasoning, view = parser.split(CASES["preamble_then_call"][0], tool_calls=harmony_calls)
    message, finish = tools.message(view, "stop")
    assert reasoning == "Need weather." and message.content == "Let me check." and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [PARIS]
    # --tool-call-parser openai alone still splits harmony; tool_choice "none" hands no calls through.
    parser, harmony_calls = output_splitter(_ctx(None, "openai"), ChatTools(_request(), "openai"))
    assert parser.name == "openai_gptoss" and harmony_calls
    parser, harmony_calls = output_splitter(both, ChatTools(_request(tool_choice="none"), "openai"))
    assert parser.name == "openai_gptoss" and not harmony_calls
    assert output_splitter(_ctx(None, "hermes"), ChatTools(_request(), "hermes")) == (None, False)


class _HarmonyTokenizer:
    """Harmony's markers as GPT-OSS's tokenizer (o200k_harmony) encodes them ("final" and <think> stand-ins)."""
    IDS = {"<|start|>": [200006], "<|channel|>": [200005], "<|message|>": [200008], "final": [17196],
           "<think>": [27, 37953, 29], "</think>": [1829, 37953, 29]}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.IDS[text]


def test_reasoning_markers_for_the_engine(tokenizer) -> None:
    assert reasoning_token_ids(_HarmonyTokenizer(), "openai_gptoss") == ((200006,), (200005, 17196, 200008))
    assert reasoning_token_ids(_HarmonyTokenizer(), "qwen3") is None
    # SmolLM2 has none of these as tokens: its grammars constrain the whole output (what the server test relies on).
    assert reasoning_token_ids(tokenizer, "openai_gptoss") is None
