"""Mistral format: content, then ``[TOOL_CALLS]`` and the calls, as the tokenizer's version writes them:
``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`` (before v11) or ``[TOOL_CALLS]f[ARGS]{...}`` once per call
(v11+; ``[ARGS]`` optional before v13, ``[CALL_ID]id`` optional). ``[TOOL_CALLS]`` is a special token, so
detokenization keeps special tokens for these requests. Call ids are 9 letters or digits: Mistral's chat
templates refuse others when the calls come back in the conversation."""
from __future__ import annotations

import json
import random
import string

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    call_from_json,
    content_end_before,
)

BOT = "[TOOL_CALLS]"
ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"
_ID_CHARS = string.ascii_letters + string.digits


def mistral_tool_call_id() -> str:
    return "".join(random.SystemRandom().choice(_ID_CHARS) for _ in range(9))


class MistralToolParser(ToolParser):
    needs_special_tokens = True

    def extract(self, text: str) -> ExtractedToolCalls:
        if BOT not in text:
            return ExtractedToolCalls(content=text, tool_calls=[])
        content, _, rest = text.partition(BOT)
        calls: list[ParsedToolCall] = []
        for segment in rest.split(BOT):
            parsed = _segment_calls(segment.strip())
            if parsed is None:  # not a valid call: the whole text stays content
                return ExtractedToolCalls(content=text, tool_calls=[])
            calls.extend(parsed)
        if not calls:
            return ExtractedToolCalls(content=text, tool_calls=[])
        return ExtractedToolCalls(content=content if content.strip() else None, tool_calls=calls)

    def safe_content_end(self, text: str) -> int:
        return content_end_before(text, BOT)


def _segment_calls(segment: str) -> list[ParsedToolCall] | None:
    """One ``[TOOL_CALLS]`` segment → its calls (None: not a valid call)."""
    if not segment:
        return []
    if segment[0] in "[{":  # before v11: a JSON list (or one object) of {"name", "arguments"}
        try:
            value, end = json.JSONDecoder().raw_decode(segment)
        except ValueError:
            return None
        if segment[end:].strip():
            return None
        items = value if isinstance(value, list) else [value]
        calls = [call_from_json(item, "arguments") for item in items]
        if any(c is None for c in calls):
            return None
        return [ParsedToolCall(c.name, c.arguments, mistral_tool_call_id()) for c in calls if c is not None]
    # v11+: name, optional [CALL_ID]id, optional [ARGS], then the arguments' JSON object.
    brace = segment.find("{")
    if brace < 0:
        return None
    head, body = segment[:brace], segment[brace:]
    head = head.removesuffix(ARGS)
    name, _, call_id = head.partition(CALL_ID)
    name, call_id = name.strip(), call_id.strip()
    try:
        args, end = json.JSONDecoder().raw_decode(body)
    except ValueError:
        return None
    if not name or not isinstance(args, dict) or body[end:].strip():
        return None
    return [ParsedToolCall(name, json.dumps(args, ensure_ascii=False), call_id or mistral_tool_call_id())]
