"""A JSON object given to a flag or an argument: a mapping as it is, or its JSON text (the CLI's), with errors that
name the flag and what it takes."""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def parse_json_object(name: str, value: str | Mapping[str, Any], example: str = "") -> dict[str, Any]:
    """`value` (a mapping, or JSON text such as a CLI flag's) as a dict. A ValueError names `name`, and `example`
    (an object the flag takes) where given, when the text is not valid JSON or not an object."""
    such_as = f" such as {example}" if example else ""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON ({e}); give a JSON object{such_as}.") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a JSON object{such_as}, got {type(value).__name__}.")
    return dict(value)
