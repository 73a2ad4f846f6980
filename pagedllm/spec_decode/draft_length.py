"""How many draft tokens each sequence verifies in a step: the count that maximises expected tokens per second.

Verifying a draft token costs a query row in the target's forward pass. On a GPU at low load a row is nearly
free (the step is bound by reading the weights), so every proposed token is worth verifying; on a CPU with
quantized weights the GEMMs are compute-bound from a few rows on, and a row costs real time. The step time is
therefore measured, not assumed: :class:`StepCostModel` keeps the time of decode-only steps by their number of
query rows, and :func:`choose_draft_lengths` adds draft tokens, most likely first, while the step's expected
tokens per second still rises (the goodput rule of SmartSpec, Liu et al. 2024). A draft token j positions deep
is worth the probability that it and the j - 1 before it are all accepted: the sequence's own recent rate for
the first, times the engine-wide conditional rate of each deeper position (a copied span tends to continue, so
deep tokens are likelier than independent ones would be).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

_EMA = 0.2  # weight of the newest step time of a row count


@dataclass
class StepCostModel:
    """Seconds of a decode-only step by its number of query rows (per row count: the fastest recent time,
    drifting up by an exponential average when steps get slower), read through a non-decreasing envelope."""

    times: dict[int, float] = field(default_factory=dict)
    # the envelope of `times`, kept until the next record (estimate is called once per candidate draft count)
    _envelope: dict[int, float] | None = field(default=None, repr=False, compare=False)

    def record(self, rows: int, seconds: float) -> None:
        """A faster step replaces the estimate at once, a slower one moves it by `_EMA`: a one-off slow step
        (a first-time allocation, a preempted host thread) would otherwise keep a row count looking
        expensive, and a row count that looks expensive is rarely chosen, so rarely measured again."""
        old = self.times.get(rows)
        self._envelope = None
        self.times[rows] = seconds if old is None or seconds < old else old + _EMA * (seconds - old)

    def envelope(self) -> dict[int, float]:
        """The times as a non-decreasing function of rows: each row count's time, or a larger count's where that
        ran faster. More rows never make a step cheaper, so a higher time below a faster larger count is stale (a
        count chosen rarely keeps the time of a slow moment: BENCHMARKS.md §74.1 saw 13-15 rows at 25-29 ms next
        to 21 ms for 16), and left alone it would keep the choice away from that count."""
        if self._envelope is None:
            env: dict[int, float] = {}
            low = float("inf")
            for rows in sorted(self.times, reverse=True):
                low = min(low, self.times[rows])
                env[rows] = low
            self._envelope = dict(sorted(env.items()))
        return self._envelope

    def estimate(self, rows: int) -> float | None:
        """From the envelope: interpolated between the row counts seen; beyond them, the slope of the two
        nearest; with one row count seen, flat (optimistic: speculating then measures the cost). None
        before any step was seen."""
        if not self.times:
            return None
        env = self.envelope()
        if rows in env:
            return env[rows]
        seen = list(env)  # ascending
        if len(seen) == 1:
            return env[seen[0]]
        below = [r for r in seen if r < rows]
        above = [r for r in seen if r > rows]
        if not below:  # below the smallest: the step cannot cost less than the smallest one seen
            return env[above[0]]
        if above:
            lo, hi = below[-1], above[0]
            return env[lo] + (env[hi] - env[lo]) * (rows - lo) / (hi - lo)
        lo, hi = seen[-2], seen[-1]
        return env[hi] + (env[hi] - env[lo]) / (hi - lo) * (rows - hi)


def choose_draft_lengths(base_rows: int, base_tokens: int, acceptance: list[float], max_lengths: list[int],
                         cost: Callable[[int], float | None], depth: list[float] | None = None,
                         draft_seconds: float = 0.0) -> list[int]:
    """Draft tokens to verify per candidate sequence.

    `base_rows`: the step's query rows without drafts; `base_tokens`: the tokens it yields without drafts (one
    per sampling sequence); candidate i accepts its first draft token with probability `acceptance[i]` and
    proposed `max_lengths[i]` tokens; `depth[j]`: the probability that draft token j + 2 is accepted once the
    j + 1 before it were (acceptance is bursty: a copied span tends to continue; None: the same as the first
    token's, independent tokens); `cost(rows)` estimates the target's step seconds (None: unknown, then every
    draft is verified); `draft_seconds`: what a draft model's pass costs (it runs once per draft position, for
    every sequence drafting that deep: the deepest chosen length counts; 0 for proposers that cost nothing)."""
    if cost(base_rows) is None:
        return list(max_lengths)
    tokens: list[tuple[float, int]] = []
    for i, (a, k) in enumerate(zip(acceptance, max_lengths)):
        a = min(max(a, 0.0), 1.0)
        gain = a
        for j in range(k):
            if j:
                gain *= min(max(depth[j - 1], 0.0), 1.0) if depth is not None and j - 1 < len(depth) else a
            tokens.append((gain, i))
    tokens.sort(key=lambda t: -t[0])  # stable: a sequence's shallower tokens stay first
    expected = float(base_tokens)
    best_rate, best_n = expected / max(cost(base_rows), 1e-9), 0
    lengths = [0] * len(max_lengths)
    deepest = 0
    for n, (gain, i) in enumerate(tokens, 1):
        expected += gain
        lengths[i] += 1
        deepest = max(deepest, lengths[i])
        rate = expected / max(cost(base_rows + n) + draft_seconds * deepest, 1e-9)
        if rate > best_rate:
            best_rate, best_n = rate, n
    lengths = [0] * len(max_lengths)
    for _, i in tokens[:best_n]:
        lengths[i] += 1
    return lengths
