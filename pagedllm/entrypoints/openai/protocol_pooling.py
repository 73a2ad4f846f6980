"""Pydantic models of vLLM's generic pooling API (``POST /pooling``): an embedding request's `input` or `messages`
plus the pooling `task`; each result's `data` is the pooled vector, or one row per prompt token for the token
tasks."""
from __future__ import annotations

from typing import Literal

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo
from pagedllm.entrypoints.openai.protocol_embeddings import EmbeddingRequest


class PoolingRequest(EmbeddingRequest):
    # None: the model's own task (embed, classify, or token_classify for a token classifier), as in vLLM
    task: Literal["embed", "classify", "score", "token_embed", "token_classify"] | None = None
    activation: bool | None = None  # a classifier's softmax/sigmoid (false: the raw logits)
    # vLLM's newer name: a classifier's activation, or an embedding's normalization
    use_activation: bool | None = None


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[list[float]] | list[float] | str


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo
