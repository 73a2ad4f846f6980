"""What every tool-call parser returns, and the streaming state machine shared by the chat handler."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_tool_call_id)


@dataclass
class ExtractedToolCalls:
    content: str | None
    tool_calls: list[ParsedToolCall]


def call_from_json(obj: Any, args_key: str) -> ParsedToolCall | None:
    """{"name": ..., <args_key>: {...}} → a call (arguments re-serialised as JSON text), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # already JSON text
        return ParsedToolCall(obj["name"], args)
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def content_end_before(text: str, marker: str) -> int:
    """Characters of `text` before `marker`, or before a tail that could be the start of it (held back)."""
    i = text.find(marker)
    if i >= 0:
        return i
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


class ToolParser:
    """Parses a finished output (`extract`) and, for streaming, says how much of a growing text is plain
    content that may be sent now (`safe_content_end`). `tools`: the request's tools (for formats whose
    arguments are typed by the function's schema); `needs_special_tokens`: the format's markers are special
    tokens, which detokenization must keep."""

    needs_special_tokens = False

    def __init__(self, tools: list[Any] | None = None) -> None:
        self.tools = tools or []

    def extract(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def safe_content_end(self, text: str) -> int:
        """Characters of `text` that are surely content (not the start of a tool call)."""
        raise NotImplementedError


class StreamingToolCalls:
    """tool_choice="auto" while streaming: content deltas flow until a tool call may have started; the
    rest is held and, once the output finishes, sent as OpenAI does: one delta per call with its index,
    id, type and name, then its arguments."""

    def __init__(self, parsers: list[ToolParser]) -> None:
        self.parsers = parsers
        self.sent = 0  # characters of content already sent

    def content_delta(self, text: str) -> str:
        end = min(p.safe_content_end(text) for p in self.parsers)
        end = max(end, self.sent)
        delta, self.sent = text[self.sent:end], end
        return delta

    def finish(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """→ (content not sent yet, tool calls) for the final text."""
        for parser in self.parsers:
            result = parser.extract(text)
            if result.tool_calls:
                rest = (result.content or "")[self.sent:] if result.content else ""
                return rest, result.tool_calls
        rest, self.sent = text[self.sent:], len(text)
        return rest, []
