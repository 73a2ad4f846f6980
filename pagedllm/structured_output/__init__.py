"""Structured outputs: constrain generation to a JSON schema, regex, choice list or grammar.

`StructuredOutputsParams` (pure Python) says what; `StructuredOutputManager` (engine side) compiles
grammars off the step loop and fills each step's token bitmask through a grammar engine backend
(xgrammar by default, llguidance as ``structured_outputs_backend="guidance"``).
"""
from pagedllm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
