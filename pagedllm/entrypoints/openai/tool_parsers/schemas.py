"""tool_choice "required" / a named function → the JSON schema the output is generated under."""
from __future__ import annotations

from typing import Any

from pagedllm.structured_output.params import StructuredOutputsParams

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def tool_choice_structured_outputs(tools: list[Any], tool_choice: Any,
                                   parallel_tool_calls: bool = True) -> tuple[StructuredOutputsParams | None, str | None]:
    """→ (constraint, mode): mode "named" (the output is the named function's arguments), "required"
    (a JSON array of {"name", "parameters"}), or (None, None) for "auto" / "none".
    Raises ValueError naming `tool_choice` when it names an unknown function or has no tools."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None, None
    if not tools:
        raise ValueError(f"tool_choice {tool_choice!r} needs `tools`.")
    if tool_choice == "required":
        items = {"anyOf": [{
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.function.name]},
                           "parameters": t.function.parameters or _ANY_OBJECT},
            "required": ["name", "parameters"],
        } for t in tools]}
        schema = {"type": "array", "items": items, "minItems": 1}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema), "required"
    name = tool_choice.function.name
    for t in tools:
        if t.function.name == name:
            return StructuredOutputsParams(json=t.function.parameters or _ANY_OBJECT), "named"
    raise ValueError(f"tool_choice names function {name!r}, which is not in tools "
                     f"({[t.function.name for t in tools]}).")
