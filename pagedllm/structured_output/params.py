"""`StructuredOutputsParams`: which constraint a request's output must satisfy (vLLM's shape).

Pure Python (no torch, no grammar engine): the engine's `StructuredOutputManager` turns it into a grammar.
"""
from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

#: Grammar engines (vLLM's names). "auto" is xgrammar, as in vLLM: llguidance fills a batch's masks 1.6x (CPU)
#: to 4x (H100 host) faster and compiles 10-20x faster, but lets a bounded JSON number take unbounded digits
#: (the bundled model then ran to max_tokens on 1 of 200 sample generations), where xgrammar bounds its
#: precision (BENCHMARKS §13, §19, §25).
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")


def resolve_backend(name: str) -> str:
    """The grammar engine a `structured_outputs_backend` value selects; ValueError naming the allowed ones."""
    if name not in STRUCTURED_OUTPUTS_BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of {list(STRUCTURED_OUTPUTS_BACKENDS)}, got {name!r}.")
    return "xgrammar" if name == "auto" else name

#: The constraint kinds, in the order they are reported in errors.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one of:

    * ``json``: a JSON schema (dict, or its JSON text; a pydantic model class is accepted too);
    * ``regex``: a regular expression the whole output must match;
    * ``choice``: a list of strings, the output is exactly one of them;
    * ``grammar``: a context-free grammar in GBNF/EBNF (llama.cpp's format, as vLLM's xgrammar backend);
    * ``json_object=True``: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).

    ``disable_any_whitespace`` (default True, unlike vLLM) makes JSON compact: small models otherwise
    tend to emit whitespace until ``max_tokens``.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()  # a pydantic model class
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (an object), got {type(self.json).__name__}.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}.")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of non-empty strings, got {self.choice!r}.")
            self.choice = list(self.choice)
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}.")
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}.")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str, bool]:
        """(kind, canonical spec text, compact) — compiled grammars are cached under it."""
        kind = self.kind
        if kind == "json":
            spec = _json.dumps(self.json)  # key order is kept: it is the output order
        elif kind == "choice":
            spec = _json.dumps(self.choice)
        elif kind == "json_object":
            spec = ""
        else:
            spec = getattr(self, kind)
        return kind, spec, self.disable_any_whitespace

    @classmethod
    def from_dict(cls, value: Any) -> "StructuredOutputsParams":
        """From a dict with the same keys (unknown keys are a ValueError naming them)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}.")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {unknown}; allowed: "
                             f"{sorted(cls.__dataclass_fields__)}.")
        return cls(**value)
