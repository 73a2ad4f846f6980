"""vLLM's reasoning parsers, as the engine sees them: their names and the markers of a thinking block.

The server splits a thinking model's output at these markers (entrypoints/openai/reasoning.py); the engine starts a
request's structured-output grammar after the model's end marker (structured_output/manager.py).
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("pagedllm")

#: GPT-OSS's parser: OpenAI's harmony format, whose reasoning is its `analysis` channel.
HARMONY = "openai_gptoss"
REASONING_PARSERS = ("deepseek_r1", "qwen3", HARMONY)
THINK_START, THINK_END = "<think>", "</think>"
#: Harmony's markers around the answer: a message starts, and the `final` channel's message begins (the reasoning
#: has ended). Special tokens of GPT-OSS's tokenizer, and "final" an ordinary one.
HARMONY_START, HARMONY_CHANNEL, HARMONY_FINAL, HARMONY_MESSAGE = "<|start|>", "<|channel|>", "final", "<|message|>"

#: (start marker, end marker) of the reasoning, each a sequence of token ids.
ReasoningMarkers = tuple[tuple[int, ...], tuple[int, ...]]


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser {name!r} is not known; known: {', '.join(REASONING_PARSERS)}")


def reasoning_token_ids(tokenizer: Any, parser: str | None = None) -> ReasoningMarkers | None:
    """The reasoning's (start, end) markers as token ids of `tokenizer`: ``<think>`` and ``</think>``, or for
    harmony ``<|start|>`` and ``<|channel|>final<|message|>``. None (with a warning) when its markers are not
    single tokens of this tokenizer: the grammar of a structured request then applies from the first output token."""
    single = (HARMONY_START, HARMONY_CHANNEL, HARMONY_MESSAGE) if parser == HARMONY else (THINK_START, THINK_END)
    ids: dict[str, int] = {}
    for marker in single:
        encoded = tokenizer.encode(marker, add_special_tokens=False) if tokenizer is not None else []
        if len(encoded) != 1:
            logger.warning("the tokenizer has no single token for %r: structured outputs constrain the whole "
                           "output, thinking included", marker)
            return None
        ids[marker] = encoded[0]
    if parser != HARMONY:
        return (ids[THINK_START],), (ids[THINK_END],)
    final = tuple(tokenizer.encode(HARMONY_FINAL, add_special_tokens=False))
    return (ids[HARMONY_START],), (ids[HARMONY_CHANNEL], *final, ids[HARMONY_MESSAGE])
