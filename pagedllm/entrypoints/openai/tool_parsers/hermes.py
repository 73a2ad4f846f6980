"""Hermes / Qwen format: ``<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`` (one block per call)."""
from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ToolParser,
    call_from_json,
    content_end_before,
)

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        if START not in text:
            return ExtractedToolCalls(content=text, tool_calls=[])
        calls = []
        for body in _BLOCK.findall(text):
            try:
                call = call_from_json(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:  # not a valid call: keep the whole text as content
                return ExtractedToolCalls(content=text, tool_calls=[])
            calls.append(call)
        content = text[: text.index(START)]
        return ExtractedToolCalls(content=content if content.strip() else None, tool_calls=calls)

    def safe_content_end(self, text: str) -> int:
        return content_end_before(text, START)
