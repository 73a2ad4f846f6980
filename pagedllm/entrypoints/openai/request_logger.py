"""vLLM's request log (--enable-log-requests): one INFO line per request the server hands the engine."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("pagedllm.requests")


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
        if not logger.isEnabledFor(logging.INFO):
            return
        if self.max_log_len is not None:
            prompt = None if prompt is None else prompt[:self.max_log_len]
            prompt_token_ids = None if prompt_token_ids is None else prompt_token_ids[:self.max_log_len]
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s.",
                    request_id, prompt, params, prompt_token_ids, lora_request)
