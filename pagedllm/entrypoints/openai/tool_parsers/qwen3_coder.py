"""Qwen3-Coder's XML format (vLLM's ``qwen3_coder`` / ``qwen3_xml``): one block per call,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text (no JSON escaping, which is the point of the format for code); each becomes the
type the function's JSON schema gives the parameter (string, integer, number, boolean, object/array as JSON)."""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import (
    ExtractedToolCalls,
    ParsedToolCall,
    ToolParser,
    content_end_before,
)

START = "<tool_call>"
_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>|$)", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


class Qwen3CoderToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        i = text.find(START)
        if i < 0:
            return ExtractedToolCalls(content=text, tool_calls=[])
        matches = _CALL.findall(text[i:])
        if not matches:
            return ExtractedToolCalls(content=text, tool_calls=[])
        calls = []
        for name, body in matches:
            name = name.strip()
            schema = self._parameters(name)
            args = {key.strip(): _typed(_strip_newline(value), schema.get(key.strip()))
                    for key, value in _PARAM.findall(body)}
            calls.append(ParsedToolCall(name, json.dumps(args, ensure_ascii=False)))
        content = text[:i]
        return ExtractedToolCalls(content=content if content.strip() else None, tool_calls=calls)

    def safe_content_end(self, text: str) -> int:
        return content_end_before(text, START)

    def _parameters(self, name: str) -> dict[str, Any]:
        """The named tool's parameter schemas ({} when the tool or its schema is unknown)."""
        for tool in self.tools:
            function = getattr(tool, "function", None)
            if function is not None and function.name == name:
                return dict((function.parameters or {}).get("properties") or {})
        return {}


def _strip_newline(value: str) -> str:
    """The format puts the value on lines of its own: drop exactly that one leading and trailing newline."""
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


def _typed(value: str, schema: Any) -> Any:
    """A raw parameter value as the type its schema names (the string itself when no type is known or fits)."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [k for k in (kinds if isinstance(kinds, list) else [kinds]) if isinstance(k, str)]
    if value.strip() == "null" and "null" in kinds:
        return None
    for kind in kinds:
        if kind == "string":
            return value
        converted = _convert(value.strip(), kind)
        if converted is not _NO:
            return converted
    return value


_NO = object()


def _convert(value: str, kind: str | None) -> Any:
    if kind == "integer":
        try:
            return int(value)
        except ValueError:
            return _NO
    if kind == "number":
        try:
            number = float(value)
        except ValueError:
            return _NO
        return int(number) if number.is_integer() and re.fullmatch(r"-?\d+", value) else number
    if kind == "boolean":
        return {"true": True, "false": False}.get(value.lower(), _NO)
    if kind in ("object", "array"):
        try:
            return json.loads(value)
        except ValueError:
            pass
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return _NO
    return _NO
