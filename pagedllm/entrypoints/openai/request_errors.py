"""Turn pydantic's validation errors into one OpenAI-shaped 400 that names the field."""
from __future__ import annotations

from fastapi.exceptions import RequestValidationError

from pagedllm.entrypoints.openai.serving_common import OpenAIError

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}

#: OpenAI fields this server knows of but does not implement: refused with the reason, never ignored.
UNSUPPORTED_FIELDS = {
    "tools": "tool calling is available on /v1/chat/completions",
    "tool_choice": "tool calling is available on /v1/chat/completions",
    "parallel_tool_calls": "tool calling is available on /v1/chat/completions",
    "functions": "the deprecated `functions` is not supported; use `tools`",
    "function_call": "the deprecated `function_call` is not supported; use `tool_choice`",
    "modalities": "only text output is supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
}


def param_of(loc: tuple) -> str | None:
    """'messages.0.role' from pydantic's loc ('body', 'messages', 0, 'role'), dropping union tags."""
    parts = [str(p) for p in loc[1:] if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "-" in p))]
    return ".".join(parts) or None


def _message(error: dict, param: str) -> str:
    kind = error.get("type")
    if kind == "extra_forbidden":
        name = param.rsplit(".", 1)[-1]
        reason = UNSUPPORTED_FIELDS.get(name) if "." not in param else None
        return f"Unrecognized request argument supplied: {param}" + (f" ({reason})" if reason else "")
    msg = str(error.get("msg", "invalid value"))
    return f"{param}: {msg.removeprefix('Value error, ')}"


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """One 400 for all of a request's validation errors; `param` is the first offending field."""
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        return OpenAIError("The request body is not valid JSON.", code="invalid_json")
    if not errors:
        return OpenAIError("The request body is invalid.")
    first_param = param_of(tuple(errors[0].get("loc", ())))
    seen, parts = set(), []
    for e in errors:
        param = param_of(tuple(e.get("loc", ()))) or "body"
        if param not in seen:  # a union reports once per branch: the first says the most
            seen.add(param)
            parts.append(_message(e, param))
    kind = str(errors[0].get("type"))
    code = {"missing": "missing", "extra_forbidden": "unknown_parameter"}.get(
        kind, "invalid_type" if kind.endswith("_type") else "invalid_value")
    return OpenAIError("; ".join(parts[:4]), param=first_param, code=code)
