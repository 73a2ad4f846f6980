"""Tool calling for /v1/chat/completions: model output ↔ OpenAI `tool_calls`.

* `tool_choice` "required" / a named function: the output is generated under a JSON schema built from
  the tools (`schemas.py`), so it always parses.
* `tool_choice` "auto": the output is parsed by a format parser, vLLM's names: Hermes/Qwen ``<tool_call>{...}</tool_call>``
  (`hermes.py`), Llama-3 JSON ``{"name": ..., "parameters": {...}}`` (`llama3_json.py`), Mistral ``[TOOL_CALLS]``
  (`mistral.py`), pythonic ``[f(a=1)]`` (Llama 3.2 / 4, `pythonic.py`), Phi-4-mini ``functools[...]``
  (`phi4_mini_json.py`), Qwen3-Coder's XML (`qwen3_coder.py`), Granite's ``<|tool_call|>[...]`` (`granite.py`) and
  OpenAI's harmony messages to ``functions.NAME`` (GPT-OSS, `openai.py`). `--tool-call-parser` picks one; by default
  each is tried and the first whose format the output shows is used.
* ``--tool-parser-plugin FILE``: parsers of one's own (`plugin.py`): ``@ToolParserManager.register_module(["name"])``
  on a `ToolParser` subclass; the server's mapping (`tool_parser_registry`) adds them to the built-in ones.
"""
from collections.abc import Mapping
from types import MappingProxyType

from pagedllm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, StreamingToolCalls, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.granite import GraniteToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.openai import OpenAIToolParser, reads_harmony
from pagedllm.entrypoints.openai.tool_parsers.phi4_mini_json import Phi4MiniJsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.plugin import ToolParserManager, load_tool_parser_plugin
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from pagedllm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from pagedllm.entrypoints.openai.tool_parsers.schemas import tool_choice_structured_outputs

#: vLLM's parser names (--tool-call-parser); the order is the order of detection when none is named. Mistral's and
#: harmony's markers are special tokens: detokenization keeps special tokens for them only when the parser is named.
TOOL_PARSERS: Mapping[str, type[ToolParser]] = MappingProxyType({
    "hermes": HermesToolParser, "qwen3_coder": Qwen3CoderToolParser, "qwen3_xml": Qwen3CoderToolParser,
    "llama3_json": Llama3JsonToolParser, "llama4_json": Llama3JsonToolParser, "pythonic": PythonicToolParser,
    "llama4_pythonic": PythonicToolParser, "phi4_mini_json": Phi4MiniJsonToolParser, "mistral": MistralToolParser, "granite": GraniteToolParser,
    "openai": OpenAIToolParser,
})


def tool_parser_registry(plugin: str | None = None) -> dict[str, type[ToolParser]]:
    """A server's parsers by name: the built-in ones, then those `plugin` (a --tool-parser-plugin file) registers.
    ValueError for a plugin that fails to load or reuses a built-in name."""
    parsers = dict(TOOL_PARSERS)
    if plugin is None:
        return parsers
    added = load_tool_parser_plugin(plugin)
    clash = sorted(set(added) & set(TOOL_PARSERS))
    if clash:
        raise ValueError(f"--tool-parser-plugin {plugin!r}: parser name(s) {clash} are built-in parsers; register "
                         f"under other names (built-in: {', '.join(sorted(TOOL_PARSERS))}).")
    return {**parsers, **added}


def tool_parser_classes(name: str | None,
                        parsers: Mapping[str, type[ToolParser]] | None = None) -> list[type[ToolParser]]:
    """The parsers tool_choice "auto" tries: the named one, or each format once (in the mapping's order). `parsers`:
    the server's mapping (tool_parser_registry); default: the built-in ones."""
    parsers = TOOL_PARSERS if parsers is None else parsers
    if name is not None:
        if name not in parsers:
            raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(parsers))}")
        return [parsers[name]]
    return list(dict.fromkeys(parsers.values()))


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
           "TOOL_PARSERS", "ToolParser", "ToolParserManager", "extract_tool_calls", "load_tool_parser_plugin",
           "reads_harmony", "tool_choice_structured_outputs", "tool_parser_classes", "tool_parser_registry"]
