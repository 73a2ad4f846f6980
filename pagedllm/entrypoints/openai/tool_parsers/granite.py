"""IBM Granite 3.x's format (vLLM's ``granite``): the output starts with ``<|tool_call|>`` (Granite 3.0: a special
token, kept when the parser is named) or ``<tool_call>`` (3.1 on), then a JSON list of ``{"name": "f", "arguments":
{...}}``. A bare list of such objects (the marker dropped with the special tokens) is read too."""
from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ToolParser,
    call_from_json,
    content_end_before,
)

MARKERS = ("<|tool_call|>", "<tool_call>")


class GraniteToolParser(ToolParser):
    needs_special_tokens = True

    def extract(self, text: str) -> ExtractedToolCalls:
        none = ExtractedToolCalls(content=text, tool_calls=[])
        body = text.lstrip()
        marker = next((m for m in MARKERS if body.startswith(m)), None)
        if marker is not None:
            body = body[len(marker):].lstrip()
        if not body.startswith("["):
            return none
        try:
            items, end = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return none
        if not isinstance(items, list) or not items or body[end:].strip():
            return none
        if marker is None and not all(isinstance(i, dict) and "arguments" in i for i in items):
            return none  # a bare list is a call list only if it reads as one
        calls = [call_from_json(item, "arguments") for item in items]
        if any(c is None for c in calls):
            return none
        return ExtractedToolCalls(content=None, tool_calls=calls)

    def safe_content_end(self, text: str) -> int:
        return min(content_end_before(text, m) for m in MARKERS)
