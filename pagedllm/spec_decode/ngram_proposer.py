"""N-gram (prompt lookup) proposer: vLLM's ``ngram`` method.

The last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are searched for earlier
in the same sequence (prompt and output); the tokens that followed the most recent earlier match are
the proposal. Nothing is proposed when no suffix recurs: the sequence simply decodes one token.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


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
        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.nmax, n_tok - 1), self.nmin - 1, -1):
            suffix = arr[n_tok - n:]
            # Windows starting at 0 .. n_tok-n-1: every earlier occurrence, never the suffix itself.
            windows = sliding_window_view(arr[: n_tok - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                # The latest match that still has k tokens after it (else the latest one).
                full = hits[hits + n + k <= n_tok]
                start = int(full[-1] if full.size else hits[-1]) + n
                return arr[start : start + k].tolist()
        return []
