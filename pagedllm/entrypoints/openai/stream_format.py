"""SSE chunks of streamed completions, built as plain dicts: the per-token hot path skips pydantic.

Each chunk is the same JSON as `dump(CompletionStreamResponse(...))` / `dump(ChatCompletionStreamResponse(...))`
(tests/test_server_fast_path.py checks that), at a fraction of the cost; 64 streams × one chunk per step
otherwise spend milliseconds of every step's interpreter time validating models.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pagedllm.entrypoints.openai.protocol import dump
from pagedllm.entrypoints.openai.serving_common import sse


def _plain(value: BaseModel | None) -> dict[str, Any] | None:
    return None if value is None else dump(value)


class CompletionChunker:
    """`data: {...}` lines of one /v1/completions stream."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = {"id": request_id, "object": "text_completion", "created": created, "model": model}

    def chunk(self, index: int, text: str, logprobs: BaseModel | None = None, finish: str | None = None,
              stop_reason: int | str | None = None, usage: dict[str, int] | None = None,
              token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> str:
        choice = {"index": index, "text": text, "logprobs": _plain(logprobs), "finish_reason": finish,
                  "stop_reason": stop_reason, "prompt_token_ids": prompt_token_ids, "token_ids": token_ids}
        return sse({**self._head, "choices": [choice], "usage": usage})


class ChatChunker:
    """`data: {...}` lines of one /v1/chat/completions stream."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(self, index: int, role: str | None, content: str | None, logprobs: BaseModel | None = None,
              finish: str | None = None, stop_reason: int | str | None = None,
              usage: dict[str, int] | None = None, token_ids: list[int] | None = None,
              prompt_token_ids: list[int] | None = None, reasoning: str | None = None) -> str:
        choice = {"index": index, "delta": {"role": role, "content": content, "reasoning": reasoning,
                                            "tool_calls": None},
                  "logprobs": _plain(logprobs),
                  "finish_reason": finish, "stop_reason": stop_reason, "token_ids": token_ids}
        return sse({**self._head, "choices": [choice], "usage": usage, "prompt_token_ids": prompt_token_ids})

    def delta_chunk(self, index: int, delta: BaseModel, logprobs: BaseModel | None = None,
                    finish: str | None = None, stop_reason: int | str | None = None,
                    usage: dict[str, int] | None = None, token_ids: list[int] | None = None) -> str:
        """A chunk whose delta is a model (tool-call deltas: rare, so pydantic's dump is fine)."""
        choice = {"index": index, "delta": dump(delta), "logprobs": _plain(logprobs),
                  "finish_reason": finish, "stop_reason": stop_reason, "token_ids": token_ids}
        return sse({**self._head, "choices": [choice], "usage": usage, "prompt_token_ids": None})


class ContinuousUsage:
    """``stream_options.continuous_usage_stats`` (vLLM's): every chunk of a choice carries the usage so far, its
    prompt's tokens and the choice's completion tokens; without it, chunks carry ``"usage": null``. `on`: the
    stream's decision (ServingContext.stream_usage)."""

    def __init__(self, on: bool, prompt_tokens: list[int]) -> None:
        self.on = on
        self._prompt_tokens = prompt_tokens  # per prompt of the request

    def of(self, prompt: int, completion_tokens: int) -> dict[str, int] | None:
        if not self.on:
            return None
        p = self._prompt_tokens[prompt]
        return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}
