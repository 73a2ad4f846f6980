"""A Responses API `input` → chat messages for the chat template, with a clear error for each bad item.

Served item kinds: messages (roles user, system, developer, assistant; text content as a string or
`input_text` / `output_text` parts), `function_call` (a call the model made earlier) and
`function_call_output` (its result). Consecutive calls become one assistant message, as parallel calls are."""
from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.serving_common import OpenAIError

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_KEYS = {
    "message": {"type", "role", "content", "id", "status", "phase"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
}


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (OpenAI chat JSON) of a request's `input`."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise OpenAIError("input must not be empty: give a string or at least one input item.", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind not in _KEYS:
            raise OpenAIError(f"{where}: items of type {kind!r} are not supported; this server takes 'message', "
                              f"'function_call' and 'function_call_output' items.", param="input")
        unknown = sorted(set(item) - _KEYS[kind])
        if unknown:
            raise OpenAIError(f"{where}: unknown field(s) {unknown} for a {kind!r} item.", param="input")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            output = item.get("output")
            if isinstance(output, list):
                output = _parts_text(output, f"{where}.output")
            elif not isinstance(output, str):
                raise OpenAIError(f"{where}.output must be a string or a list of text parts.", param="input")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", where), "content": output})
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise OpenAIError(f"{where}.role must be one of {list(_ROLES)}, got {role!r}.", param="input")
    content = item.get("content")
    if isinstance(content, list):
        content = _parts_text(content, f"{where}.content")
    elif not isinstance(content, str):
        raise OpenAIError(f"{where}.content must be a string or a list of text parts.", param="input")
    return {"role": role, "content": content}


def _parts_text(parts: list[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise OpenAIError(f"{where}[{j}]: only text parts ({', '.join(_TEXT_PARTS[:2])} with a `text` string) "
                              f"are supported, got {kind!r}.", param="input")
        texts.append(part["text"])
    return "\n".join(texts)  # as a chat message's text parts (vLLM's "string" content format)


def _text(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise OpenAIError(f"{where}.{key} must be a string.", param="input")
    return value
