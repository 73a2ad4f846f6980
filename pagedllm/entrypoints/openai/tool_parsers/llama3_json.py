"""Llama-3 JSON format: the whole output is ``{"name": "f", "parameters": {...}}`` (optionally after
``<|python_tag|>``; several calls separated by ``;``)."""
from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ToolParser, call_from_json

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].strip()
        if not body.startswith("{"):
            return ExtractedToolCalls(content=text, tool_calls=[])
        calls, decoder, pos = [], json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return ExtractedToolCalls(content=text, tool_calls=[])
            call = call_from_json(obj, "parameters")
            if call is None:
                return ExtractedToolCalls(content=text, tool_calls=[])
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return ExtractedToolCalls(content=None, tool_calls=calls)

    def safe_content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or PYTHON_TAG.startswith(body[: len(PYTHON_TAG)]):
            return 0  # may be a call: hold everything until the end
        return len(text)
