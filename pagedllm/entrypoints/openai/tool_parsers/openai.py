"""OpenAI's harmony tool calls (GPT-OSS, vLLM's ``openai`` parser): a message to ``functions.NAME`` on the
`commentary` channel, its body the arguments, e.g.
``<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"location": "Paris"}<|call|>``.

It reads a raw harmony output, or the *tool view* the harmony split hands to ChatTools (content, then the calls
as ``<|start|>assistant…`` messages: see entrypoints/openai/harmony.py). JSON arguments (content type json, or
none) are re-serialised; arguments that are not valid JSON are kept as written, as vLLM does. A call cut off by
max_tokens is no call. The markers are special tokens, kept in the text for these requests."""
from __future__ import annotations

import json
import logging

from pagedllm.entrypoints.openai.harmony import (
    FUNCTIONS,
    START,
    HarmonyMessage,
    is_harmony,
    json_arguments,
    parse_messages,
    split_harmony,
)
from pagedllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    content_end_before,
)

logger = logging.getLogger("pagedllm")


class OpenAIToolParser(ToolParser):
    needs_special_tokens = True

    def extract(self, text: str) -> ExtractedToolCalls:
        view = split_harmony(text).tool_view() if is_harmony(text) else text
        cut = view.find(START)
        calls = [_call(m) for m in parse_messages(view[cut:]) if m.is_tool_call and m.ended] if cut >= 0 else []
        if not calls:
            return ExtractedToolCalls(content=text, tool_calls=[])
        return ExtractedToolCalls(content=view[:cut] or None, tool_calls=calls)

    def safe_content_end(self, text: str) -> int:
        if is_harmony(text) is not False:  # raw harmony: nothing in it is content as written
            return 0
        return content_end_before(text, START)


def reads_harmony(parser_classes: list[type[ToolParser]]) -> bool:
    """Whether one of these parsers reads harmony tool calls (so the harmony split hands them through)."""
    return any(issubclass(cls, OpenAIToolParser) for cls in parser_classes)


def _call(msg: HarmonyMessage) -> ParsedToolCall:
    arguments = msg.body
    if json_arguments(msg):
        try:
            arguments = json.dumps(json.loads(msg.body), ensure_ascii=False)
        except ValueError:
            logger.warning("harmony tool call to %s: arguments are not valid JSON; returned as written", msg.recipient)
    return ParsedToolCall(msg.recipient[len(FUNCTIONS):] if msg.recipient else "", arguments)
