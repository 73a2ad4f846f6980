"""Phi-4-mini's format (vLLM's ``phi4_mini_json``): ``functools[{"name": "f", "arguments": {...}}, ...]``."""
from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ToolParser,
    call_from_json,
    content_end_before,
)

MARKER = "functools"


class Phi4MiniJsonToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        i = text.find(MARKER + "[")
        if i < 0:
            return ExtractedToolCalls(content=text, tool_calls=[])
        body = text[i + len(MARKER):]
        try:
            items, end = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return ExtractedToolCalls(content=text, tool_calls=[])
        calls = [call_from_json(item, "arguments") for item in items] if isinstance(items, list) else [None]
        if not calls or any(c is None for c in calls) or body[end:].strip():
            return ExtractedToolCalls(content=text, tool_calls=[])
        content = text[:i]
        return ExtractedToolCalls(content=content if content.strip() else None,
                                  tool_calls=[c for c in calls if c is not None])

    def safe_content_end(self, text: str) -> int:
        return content_end_before(text, MARKER)
