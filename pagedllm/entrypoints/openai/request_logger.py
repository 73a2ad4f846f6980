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
    """Logs each received request as vLLM does: its id, prompt, parameters, prompt token ids and LoRA adapter.
    `max_log_len` (--max-log-len) keeps the first that many prompt characters and token ids (None: all)."""

    max_log_len: int | None = None

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
