"""Pydantic models of vLLM's scoring APIs: ``POST /score`` (``/v1/score``) and the Jina/Cohere-style rerank API
(``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``).

A score request pairs ``text_1`` with ``text_2`` (vLLM's newer names ``queries`` / ``documents`` are accepted
too): one text against N, or N against N element by element. A rerank request scores every document against
one query and returns them most relevant first."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    RequestModel,
    Text,
    UsageInfo,
)


class ScoreRequest(RequestModel):
    model: str | None = None
    text_1: Text | list[Text] | None = None
    text_2: Text | list[Text] | None = None
    queries: Text | list[Text] | None = None  # vLLM's newer name of text_1
    documents: Text | list[Text] | None = None  # vLLM's newer name of text_2
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    activation: bool | None = None  # a cross-encoder's sigmoid (false: the raw logit)
    priority: int = 0
    user: str | None = None


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankRequest(RequestModel):
    model: str | None = None
    query: Text
    documents: list[Text]
    top_n: int = 0  # the most relevant this many; 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    activation: bool | None = None
    priority: int = 0
    user: str | None = None


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
