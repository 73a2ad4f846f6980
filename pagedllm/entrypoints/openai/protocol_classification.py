"""Pydantic models of vLLM's classification API (``POST /classify``): class probabilities per input, with the
label of the most likely class (the model config's ``id2label``)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import (
    OpenAIBaseModel,
    RequestModel,
    Text,
    UsageInfo,
)


class ClassificationRequest(RequestModel):
    model: str | None = None
    input: Text | list[Text] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool = True
    activation: bool | None = None  # softmax over the labels, sigmoid for one (false: the raw logits)
    priority: int = 0
    user: str | None = None


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: UsageInfo
