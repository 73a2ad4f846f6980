"""Tool calling for /v1/chat/completions: model output ↔ OpenAI `tool_calls`.

* `tool_choice` "required" / a named function: the output is generated under a JSON schema built from
  the tools (`schemas.py`), so it always parses.
* `tool_choice` "auto": the output is parsed by a format parser, vLLM's names: Hermes/Qwen ``<tool_call>{...}</tool_call>``
  (`hermes.py`), Llama-3 JSON ``{"name": ..., "parameters": {...}}`` (`llama3_json.py`), Mistral ``[TOOL_CALLS]``
  (`mistral.py`), pythonic ``[f(a=1)]`` (Llama 3.2 / 4, `pythonic.py`), Phi-4-mini ``functools[...]``
  (`phi4_mini_json.py`), Qwen3-Coder's XML (`qwen3_coder.py`), Granite's ``<|tool_call|>[...]`` (`granite.py`) and
  OpenAI's harmony messages to ``functions.NAME`` (GPT-OSS, `openai.py`). `--tool-call-parser` picks one; by default
  each is tried and the first whose format the output shows is used.
"""
from pagedllm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, StreamingToolCalls, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.granite import GraniteToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.openai import OpenAIToolParser, reads_harmony
from pagedllm.entrypoints.openai.tool_parsers.phi4_mini_json import Phi4MiniJsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from pagedllm.entrypoints.openai.tool_parsers.schemas import tool_choice_structured_outputs

#: vLLM's parser names (--tool-call-parser); the order is the order of detection when none is named. Mistral's and
#: harmony's markers are special tokens: detokenization keeps special tokens for them only when the parser is named.
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "qwen3_coder": Qwen3CoderToolParser, "qwen3_xml": Qwen3CoderToolParser,
    "llama3_json": Llama3JsonToolParser, "llama4_json": Llama3JsonToolParser, "pythonic": PythonicToolParser,
    "llama4_pythonic": PythonicToolParser, "phi4_mini_json": Phi4MiniJsonToolParser, "mistral": MistralToolParser, "granite": GraniteToolParser,
    "openai": OpenAIToolParser,
}


def tool_parser_classes(name: str | None) -> list[type[ToolParser]]:
    """The parsers tool_choice "auto" tries: the named one, or each format once (in TOOL_PARSERS' order)."""
    if name is not None:
        if name not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
        return [TOOL_PARSERS[name]]
    return list(dict.fromkeys(TOOL_PARSERS.values()))


def extract_tool_calls(text: str, parsers: list[ToolParser] | None = None) -> ExtractedToolCalls:
    """Parse a finished output with the first of `parsers` (default: every format) whose format it shows (plain
    content otherwise)."""
    for parser in parsers if parsers is not None else [cls() for cls in tool_parser_classes(None)]:
        result = parser.extract(text)
        if result.tool_calls:
            return result
    return ExtractedToolCalls(content=text, tool_calls=[])


__all__ = ["ExtractedToolCalls", "GraniteToolParser", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "OpenAIToolParser", "Phi4MiniJsonToolParser", "PythonicToolParser", "Qwen3CoderToolParser", "StreamingToolCalls",
           "TOOL_PARSERS", "ToolParser", "extract_tool_calls", "reads_harmony", "tool_choice_structured_outputs",
           "tool_parser_classes"]
