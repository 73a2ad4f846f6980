"""vLLM's reasoning parsers, as the engine sees them: their names and the markers of a thinking block.

The server splits a thinking model's output at these markers (entrypoints/openai/reasoning.py); the engine starts a
request's structured-output grammar after the model's end marker (structured_output/manager.py).
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("pagedllm")

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser {name!r} is not known; known: {', '.join(REASONING_PARSERS)}")


def reasoning_token_ids(tokenizer: Any) -> tuple[int, int] | None:
    """(<think>, </think>) as single token ids of `tokenizer`, or None (with a warning) when it has no such tokens:
    the grammar of a structured request then applies from the first output token."""
    ids = []
    for marker in (THINK_START, THINK_END):
        encoded = tokenizer.encode(marker, add_special_tokens=False) if tokenizer is not None else []
        if len(encoded) != 1:
            logger.warning("the tokenizer has no single token for %r: structured outputs constrain the whole "
                           "output, thinking included", marker)
            return None
        ids.append(encoded[0])
    return ids[0], ids[1]
