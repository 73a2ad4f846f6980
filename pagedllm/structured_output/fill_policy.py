"""Serial or threaded bitmask fills, whichever the measurements say is cheaper per row.

A cheap grammar state fills its row in 1-3 µs; handing 64 such rows to a pool of native threads costs
more than the work itself (xgrammar: 1.4 µs/row on one thread vs 12-16 µs/row on 2-8 threads on the
bundled model's vocabulary, BENCHMARKS §31). An expensive state (a long bounded repetition, a big
grammar) takes 100+ µs per row, where threads pay off. The policy keeps a moving average of the cost per
row of each thread count, uses the cheaper one, and every 256 fills re-measures the other (a threaded fill of
cheap rows costs ~0.8 ms at 64 rows: ~0.2 % of 256 GPU steps).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class FillThreadPolicy:
    choices: tuple[int, ...]  # thread counts to pick from, e.g. (1, 8)
    explore_every: int = 256  # every this many fills, one goes to a choice that is not the current best
    smoothing: float = 0.2  # weight of the newest measurement in the moving average
    cost_per_row: dict[int, float] = field(default_factory=dict)  # seconds
    _fills: int = 0

    def pick(self) -> int:
        """The thread count for the next fill."""
        self._fills += 1
        for choice in self.choices:
            if choice not in self.cost_per_row:
                return choice
        best = min(self.choices, key=self.cost_per_row.__getitem__)
        if len(self.choices) > 1 and self._fills % self.explore_every == 0:
            others = [c for c in self.choices if c != best]
            return others[(self._fills // self.explore_every) % len(others)]
        return best

    def record(self, threads: int, seconds: float, rows: int) -> None:
        if rows <= 0:
            return
        per_row = seconds / rows
        old = self.cost_per_row.get(threads)
        self.cost_per_row[threads] = per_row if old is None else old + self.smoothing * (per_row - old)
