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
              stop_reason: int | str | None = None) -> str:
        choice = {"index": index, "text": text, "logprobs": _plain(logprobs), "finish_reason": finish,
                  "stop_reason": stop_reason}
        return sse({**self._head, "choices": [choice], "usage": None})


class ChatChunker:
    """`data: {...}` lines of one /v1/chat/completions stream."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(self, index: int, role: str | None, content: str | None, logprobs: BaseModel | None = None,
              finish: str | None = None, stop_reason: int | str | None = None) -> str:
        choice = {"index": index, "delta": {"role": role, "content": content, "tool_calls": None},
                  "logprobs": _plain(logprobs),
                  "finish_reason": finish, "stop_reason": stop_reason}
        return sse({**self._head, "choices": [choice], "usage": None})

    def delta_chunk(self, index: int, delta: BaseModel, logprobs: BaseModel | None = None,
                    finish: str | None = None, stop_reason: int | str | None = None) -> str:
        """A chunk whose delta is a model (tool-call deltas: rare, so pydantic's dump is fine)."""
        choice = {"index": index, "delta": dump(delta), "logprobs": _plain(logprobs),
                  "finish_reason": finish, "stop_reason": stop_reason}
        return sse({**self._head, "choices": [choice], "usage": None})
