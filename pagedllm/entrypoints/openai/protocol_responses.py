"""Pydantic models of OpenAI's Responses API request (``POST /v1/responses``), text and function tools.

The response side is built as plain dicts in ``serving_responses.py``: its shape is OpenAI's `Response` object
and its stream events, which the official `openai` client parses."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from pagedllm.entrypoints.openai.protocol import RequestModel, SamplingExtras, Seed, Text

#: The one `include` value served: the output text's token log-probs (with `top_logprobs` per token).
INCLUDE_LOGPROBS = "message.output_text.logprobs"


class ResponsesTextFormat(RequestModel):
    """`text.format`: plain text, any JSON object, or a JSON schema (OpenAI's fields, flat)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesTextConfig(RequestModel):
    format: ResponsesTextFormat | None = None


class ResponsesReasoning(RequestModel):
    """OpenAI's `reasoning` option: `effort` becomes the chat template's `reasoning_effort` (as in chat completions);
    `summary` is accepted and not produced."""

    effort: Literal["low", "medium", "high"] | None = None
    summary: str | None = None


class ResponsesFunctionTool(RequestModel):
    """A function tool as the Responses API writes it (flat: no nested `function`)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesNamedToolChoice(RequestModel):
    type: Literal["function"]
    name: str


class ResponsesRequest(SamplingExtras):
    """OpenAI's create-response body, plus vLLM's extra sampling fields (top_k, min_p, repetition_penalty, …).

    `input` items are checked in ``responses_input.py`` (each kind gets its own clear error)."""

    model: str | None = None
    input: Text | list[dict[str, Any]]
    instructions: Text | None = None
    #: Absent: up to the context limit.
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: ResponsesTextConfig | None = None
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    truncation: Literal["disabled"] | None = None
    reasoning: ResponsesReasoning | None = None
    background: bool = False
    # vLLM's sampling extras that chat and completions also take.
    seed: Seed | None = None
    stop: Text | list[Text] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    chat_template_kwargs: dict[str, Any] | None = None
