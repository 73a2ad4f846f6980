"""Tool calling in /v1/chat/completions: the request's tools → a constraint, outputs → `tool_calls`
(whole messages, or stream deltas shaped as OpenAI sends them)."""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagedllm.entrypoints.openai.tool_parsers import (
    StreamingToolCalls,
    ToolParser,
    extract_tool_calls,
    tool_choice_structured_outputs,
    tool_parser_classes,
)
from pagedllm.entrypoints.openai.tool_parsers.base import ParsedToolCall, new_tool_call_id
from pagedllm.structured_output.params import StructuredOutputsParams

ROLE = "assistant"


class ChatTools:
    """One request's tool handling. `mode`: None (no tools or tool_choice "none"), "auto", "named", "required".
    `tool_call_parser`: the one format "auto" parses (a name of `parsers`, the server's mapping: built-in parsers
    and --tool-parser-plugin ones; default the built-in ones); None: each format is tried.
    `exclude_tools_when_none`: with tool_choice "none" the chat template gets no tools (vLLM's
    --exclude-tools-when-tool-choice-none)."""

    def __init__(self, req: ChatCompletionRequest, tool_call_parser: str | None = None,
                 parsers: Mapping[str, type[ToolParser]] | None = None, exclude_tools_when_none: bool = False) -> None:
        self.tools = req.tools or []
        self.parser_classes = tool_parser_classes(tool_call_parser, parsers)
        self._hide_tools = exclude_tools_when_none and req.tool_choice == "none"
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if self.tools else "none")
        self.constraint: StructuredOutputsParams | None
        self.constraint, mode = tool_choice_structured_outputs(self.tools, choice, req.parallel_tool_calls is not False)
        self.mode = mode or ("auto" if self.tools and choice == "auto" else None)
        self.name = choice.function.name if mode == "named" else None
        if self.mode == "auto" and tool_call_parser is not None and self.parser_classes[0].needs_special_tokens:
            req.skip_special_tokens = False  # the format's markers are special tokens (Mistral's [TOOL_CALLS])
        self._streams: dict[int, Any] = {}

    def _parsers(self) -> list:
        return [cls(self.tools) for cls in self.parser_classes]

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template receives them (OpenAI's JSON); None with tool_choice "none" under
        --exclude-tools-when-tool-choice-none."""
        if self._hide_tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    # -- whole responses ---------------------------------------------------------------------------
    def message(self, text: str, finish_reason: str | None) -> tuple[ChatMessage, str | None]:
        calls = self._calls(text)
        if calls is None:
            return ChatMessage(role=ROLE, content=text), finish_reason
        content, parsed = calls
        msg = ChatMessage(role=ROLE, content=content, tool_calls=[
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed])
        return msg, _finish(self.mode, finish_reason, bool(parsed))

    def _calls(self, text: str) -> tuple[str | None, list[ParsedToolCall]] | None:
        if self.mode == "named":
            return None, [ParsedToolCall(self.name or "", text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:  # cut by max_tokens
                return text, []
            return None, [ParsedToolCall(it["name"], json.dumps(it["parameters"], ensure_ascii=False))
                          for it in items if isinstance(it, dict) and "name" in it]
        if self.mode == "auto":
            result = extract_tool_calls(text, self._parsers())
            return result.content, result.tool_calls
        return None

    # -- streaming ---------------------------------------------------------------------------------
    def deltas(self, index: int, text: str, finished: bool) -> list[DeltaMessage]:
        """The deltas to send for choice `index` whose text is now `text`."""
        st = self._streams.setdefault(index, {"sent": 0, "id": new_tool_call_id(), "auto": None})
        out: list[DeltaMessage] = []
        if self.mode == "named":
            if st["sent"] == 0 and (text or finished):
                out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                    index=0, id=st["id"], type="function", function=DeltaFunctionCall(name=self.name, arguments=""))]))
            if len(text) > st["sent"]:
                out.append(DeltaMessage(tool_calls=[DeltaToolCall(
                    index=0, function=DeltaFunctionCall(arguments=text[st["sent"]:]))]))
                st["sent"] = len(text)
            return out
        if self.mode == "required":
            if finished:
                content, calls = self._calls(text) or (None, [])
                out.extend(_call_deltas(calls))
                if not calls and content:
                    out.append(DeltaMessage(content=content))
            return out
        # auto
        if st["auto"] is None:
            st["auto"] = StreamingToolCalls(self._parsers())
        streamer: StreamingToolCalls = st["auto"]
        delta = streamer.content_delta(text)
        if delta:
            out.append(DeltaMessage(content=delta))
        if finished:
            rest, calls = streamer.finish(text)
            if rest:
                out.append(DeltaMessage(content=rest))
            out.extend(_call_deltas(calls))
            st["calls"] = bool(calls)
        return out

    def stream_finish_reason(self, index: int, finish_reason: str | None) -> str | None:
        st = self._streams.get(index, {})
        called = st.get("calls", self.mode == "required")
        return _finish(self.mode, finish_reason, bool(called))


def _call_deltas(calls: list[ParsedToolCall]) -> list[DeltaMessage]:
    out = []
    for i, c in enumerate(calls):
        out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=i, id=c.id, type="function",
                                                          function=DeltaFunctionCall(name=c.name, arguments=""))]))
        out.append(DeltaMessage(tool_calls=[DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=c.arguments))]))
    return out


def _finish(mode: str | None, finish_reason: str | None, called: bool) -> str | None:
    """OpenAI: "tool_calls" when the model chose to call tools (auto/required); a forced named call stops."""
    if called and mode in ("auto", "required") and finish_reason == "stop":
        return "tool_calls"
    return finish_reason
