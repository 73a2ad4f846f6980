"""Request limits checked before a request reaches the engine (400/413 with OpenAI's error body)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.entrypoints.openai.serving_common import OpenAIError

#: OpenAI's limit on the number of prompts in one completion request.
DEFAULT_MAX_PROMPTS = 2048
DEFAULT_MAX_TOTAL_PROMPT_TOKENS = 512 * 1024
DEFAULT_MAX_N = 128
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


@dataclass
class RequestLimits:
    """What one request may ask for; `pagedllm serve --max-prompts-per-request ...` sets them."""

    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS
    max_total_prompt_tokens: int = DEFAULT_MAX_TOTAL_PROMPT_TOKENS
    #: Most completions per prompt (n and best_of); the server also caps it by --max-num-seqs.
    max_n: int = DEFAULT_MAX_N
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        for name in ("max_prompts_per_request", "max_total_prompt_tokens", "max_n", "max_request_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")

    def check_prompt_count(self, n: int) -> None:
        if n > self.max_prompts_per_request:
            raise OpenAIError(
                f"this request has {n} prompts; this server takes at most {self.max_prompts_per_request} per "
                f"request (--max-prompts-per-request). Split it into several requests.",
                param="prompt", code="too_many_prompts", status=413)

    def check_total_tokens(self, total: int) -> None:
        if total > self.max_total_prompt_tokens:
            raise OpenAIError(
                f"this request's prompts hold more than {self.max_total_prompt_tokens} tokens in all "
                f"(--max-total-prompt-tokens). Split it into several requests.",
                param="prompt", code="too_many_prompt_tokens", status=413)


def blocks_needed(n_prompt: int, max_len: int, num_seqs: int, block_size: int) -> int:
    """KV blocks a request holds at most: the prompt's full blocks (shared) + each sequence's own.

    `max_len` is prompt + completion; `num_seqs` is best_of (n for beam search, which keeps n beams
    plus the candidates it forks from them: we count 2n to stay on the safe side).
    """
    shared = n_prompt // block_size
    per_seq = -(-max_len // block_size) - shared
    return shared + num_seqs * per_seq


def check_fits_pool(n_prompt: int, max_len: int, num_seqs: int, block_size: int, num_blocks: int,
                    max_tokens_param: str) -> None:
    """400 for a request that could never run to the end in the KV pool even alone (no livelock)."""
    need = blocks_needed(n_prompt, max_len, num_seqs, block_size)
    if need > num_blocks:
        raise OpenAIError(
            f"this request may need {need} KV cache blocks ({num_seqs} sequence(s) of up to {max_len} tokens, "
            f"{block_size} tokens per block) but the whole pool has {num_blocks}; it could never finish. "
            f"Lower {max_tokens_param}, n or best_of.",
            param=max_tokens_param, code="kv_cache_too_small")
