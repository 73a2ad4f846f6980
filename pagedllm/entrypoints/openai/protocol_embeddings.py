"""Pydantic models of the embeddings API (``POST /v1/embeddings``): OpenAI's request plus vLLM's extra fields.

As in vLLM, one body takes either OpenAI's ``input`` (a string, strings, token ids, or lists of token ids) or a
chat conversation in ``messages`` (rendered with the chat template, without a generation prompt by default)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import ChatMessageParam, OpenAIBaseModel, RequestModel, Text, UsageInfo


class EmbeddingRequest(RequestModel):
    model: str | None = None
    input: Text | list[Text] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessageParam] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's extra fields
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool | None = None  # default: True for `input`, False for `messages` (vLLM's)
    normalize: bool | None = None
    priority: int = 0
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo
