"""Tool calling for /v1/chat/completions: model output ↔ OpenAI `tool_calls`.

* `tool_choice` "required" / a named function: the output is generated under a JSON schema built from
  the tools (`schemas.py`), so it always parses.
* `tool_choice` "auto": the output is parsed by a format parser: Hermes/Qwen ``<tool_call>{...}</tool_call>``
  (`hermes.py`) or Llama-3 JSON ``{"name": ..., "parameters": {...}}`` (`llama3_json.py`); the first one
  whose format the output shows is used.
"""
from pagedllm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ToolParser, StreamingToolCalls
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.schemas import tool_choice_structured_outputs

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def extract_tool_calls(text: str) -> ExtractedToolCalls:
    """Parse a finished output with the first parser whose format it shows (plain content otherwise)."""
    for cls in TOOL_PARSERS.values():
        result = cls().extract(text)
        if result.tool_calls:
            return result
    return ExtractedToolCalls(content=text, tool_calls=[])


__all__ = ["ExtractedToolCalls", "HermesToolParser", "Llama3JsonToolParser", "StreamingToolCalls", "TOOL_PARSERS",
           "ToolParser", "extract_tool_calls", "tool_choice_structured_outputs"]
