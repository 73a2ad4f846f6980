"""Request fields → `StructuredOutputsParams`: OpenAI `response_format`, vLLM's `structured_outputs`
and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (at most one of them)."""
from __future__ import annotations

from typing import Any

from pagedllm.structured_output.params import StructuredOutputsParams


def structured_outputs_from_request(req: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """→ (params or None, the request field they came from). Raises ValueError naming the field."""
    given: list[tuple[str, dict[str, Any]]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        else:
            if rf.json_schema is None or rf.json_schema.json_schema is None:
                raise ValueError("response_format: type 'json_schema' needs json_schema.schema (a JSON schema).")
            given.append(("response_format", {"json": rf.json_schema.json_schema}))
    if getattr(req, "structured_outputs", None) is not None:
        given.append(("structured_outputs", dict(req.structured_outputs)))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(req, name, None)
        if value is not None:
            given.append((name, {key: value}))
    if not given:
        return None, None
    if len(given) > 1:
        raise ValueError(f"only one output constraint is allowed per request, got {[g[0] for g in given]}.")
    field, spec = given[0]
    try:
        return StructuredOutputsParams.from_dict(spec), field
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
