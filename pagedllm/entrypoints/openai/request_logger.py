"""vLLM's request log (--enable-log-requests): one INFO line per request the server hands the engine.

Requests the server sends itself (the start-up warm-up, warm_up.py) run inside :func:`unlogged` and are left out:
the log shows what clients sent.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("pagedllm.requests")

# True inside `unlogged()`: per asyncio task (a context variable), so a client's request served alongside never
# inherits it.
_UNLOGGED = contextvars.ContextVar("pagedllm_request_log_unlogged", default=False)


@contextlib.contextmanager
def unlogged() -> Iterator[None]:
    """Requests handled in this context (and the tasks it starts) are not written to the request log."""
    token = _UNLOGGED.set(True)
    try:
        yield
    finally:
        _UNLOGGED.reset(token)


@dataclass(frozen=True)
class RequestLogger:
    """Logs each received request as vLLM does: its id, prompt, parameters, prompt token ids and LoRA adapter;
    with `log_outputs` (--enable-log-outputs) also each finished completion: its text, token ids and finish
    reason. `max_log_len` (--max-log-len) keeps the first that many characters and token ids (None: all)."""

    max_log_len: int | None = None
    log_outputs: bool = False

    def __post_init__(self) -> None:
        if self.max_log_len is not None and (isinstance(self.max_log_len, bool) or self.max_log_len < 0):
            raise ValueError(f"max_log_len must be an int >= 0 (or None for no limit), got {self.max_log_len!r}.")

    def log_inputs(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None, params: Any,
                   lora_request: Any = None) -> None:
        if _UNLOGGED.get() or not logger.isEnabledFor(logging.INFO):
            return
        if self.max_log_len is not None:
            prompt = None if prompt is None else prompt[:self.max_log_len]
            prompt_token_ids = None if prompt_token_ids is None else prompt_token_ids[:self.max_log_len]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s.",
                    request_id, prompt, params, prompt_token_ids, lora_request)

    def log_output(self, request_id: str, text: str, token_ids: list[int], finish_reason: str | None) -> None:
        """One finished completion, whole (streamed or not)."""
        if _UNLOGGED.get() or not logger.isEnabledFor(logging.INFO):
            return
        if self.max_log_len is not None:
            text, token_ids = text[:self.max_log_len], token_ids[:self.max_log_len]
        logger.info("Generated response %s: output: %r, output_token_ids: %s, finish_reason: %s.", request_id,
                    text, token_ids, finish_reason)


class OutputLoggingStream:
    """A request's AsyncStream that logs each completion once it finishes (--enable-log-outputs); everything
    else is the wrapped stream's. The server's streams hand out cumulative outputs, so the finished one is whole."""

    def __init__(self, stream: Any, request_id: str, request_logger: RequestLogger) -> None:
        self._stream = stream
        self._request_id = request_id
        self._logger = request_logger
        self._logged: set[int] = set()  # completions already logged (later outputs repeat finished ones)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __aiter__(self) -> OutputLoggingStream:
        return self

    async def __anext__(self) -> Any:
        out = await self._stream.__anext__()
        completions = [c for c in getattr(out, "outputs", None) or () if hasattr(c, "token_ids")]  # not pooling
        for c in completions:
            if c.finish_reason is not None and c.index not in self._logged:
                self._logged.add(c.index)
                rid = self._request_id if len(completions) == 1 else f"{self._request_id}[{c.index}]"
                self._logger.log_output(rid, c.text, list(c.token_ids), c.finish_reason)
        return out
