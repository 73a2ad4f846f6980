"""Pythonic format (Llama 3.2 / Llama 4, vLLM's ``pythonic``): the whole output is a Python list of calls with
keyword arguments, ``[get_weather(city="Paris", unit="celsius"), now()]``, optionally between Llama 4's
``<|python_start|>`` and ``<|python_end|>``. Argument values are Python literals (strings, numbers,
True/False/None, lists, dicts); they become JSON."""
from __future__ import annotations

import ast
import json

from pagedllm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ParsedToolCall, ToolParser

START, END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(ToolParser):
    def extract(self, text: str) -> ExtractedToolCalls:
        body = text.strip().removeprefix(START).removesuffix(END).strip()
        if not body.startswith("["):
            return ExtractedToolCalls(content=text, tool_calls=[])
        calls = _calls_of(body)
        if not calls:
            return ExtractedToolCalls(content=text, tool_calls=[])
        return ExtractedToolCalls(content=None, tool_calls=calls)

    def safe_content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("[") or START.startswith(body[:len(START)]) or body.startswith(START):
            return 0  # may be a list of calls: hold everything until the end
        return len(text)


def _calls_of(body: str) -> list[ParsedToolCall]:
    """The calls of a list expression, or [] when it is anything else (content that happens to start with '[')."""
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            return []
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        except ValueError:  # not a literal (a variable, an expression)
            return []
        if len(args) != len(node.keywords):  # **kwargs
            return []
        try:
            arguments = json.dumps(args, ensure_ascii=False)
        except TypeError:  # a literal JSON cannot hold (a set, bytes, a complex number)
            return []
        calls.append(ParsedToolCall(ast.unparse(node.func), arguments))
    return calls
