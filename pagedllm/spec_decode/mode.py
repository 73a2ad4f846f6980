"""Speculate, or run plain asynchronous steps: whichever measured more tokens per second.

A step that speculates with host-side drafts (n-gram) is synchronous: the host needs the previous step's tokens
to propose, so it waits for the device, and the device waits while the host schedules, proposes and verifies.
Without speculation an engine with asynchronous scheduling overlaps the two (the next step is launched before the
previous one's tokens reach the host). At low acceptance, or when long prefills stall the batch, the overlap is
worth more than the accepted drafts (BENCHMARKS.md §29.1: 0.80-0.84x at 4 concurrent on an H200). The
per-sequence policies (acceptance cooldown, goodput draft lengths) cannot see this: they compare speculating
with not speculating *within* synchronous steps.

So the engine measures both modes in windows of steps (tokens emitted ÷ wall time of the windows' `step()`
calls), keeps an exponential average per mode, runs the faster one, and after `explore_every` windows runs
one window of the other so that its figure stays current; each look that confirms the leader doubles the
interval (up to `max_explore_every`), so a mode that keeps losing (speculation on text with no repeats, whose
synchronous steps propose nothing) costs ever less. Engines with asynchronous scheduling choose so, and so do
engines whose drafts come from a model (a draft checkpoint, self-speculation): the goodput rule prices its
passes and the verification rows, but not all a speculating step costs (BENCHMARKS.md §88.6). Synchronous n-gram
engines always allow speculation (its cost is then decided per sequence).
"""
from __future__ import annotations

from dataclasses import dataclass, field

_EMA = 0.5  # weight of the newest window in a mode's rate


@dataclass
class SpecModeChooser:
    """Per step: `speculate()` says which mode to run; `record()` adds the step's tokens and seconds."""

    window: int = 32  # steps per measurement window
    explore_every: int = 8  # windows of the leading mode before one window of the other (doubles, see above)
    max_explore_every: int = 128
    rates: dict[bool, float] = field(default_factory=dict)  # tokens per second by mode (True: speculation)
    mode: bool = True
    _steps: int = 0
    _tokens: int = 0
    _seconds: float = 0.0
    _windows_in_mode: int = 0
    _interval: int = 0  # the current exploration interval (explore_every until a look confirms the leader)
    _exploring: bool = False  # the current window is a look at the trailing mode

    def speculate(self) -> bool:
        return self.mode

    def record(self, speculated: bool, tokens: int, seconds: float) -> None:
        """One `step()` call: whether it ran in speculation mode, the tokens it emitted, its wall time. Steps
        of the other mode (a window's first step after a switch may still complete one) are not counted."""
        if speculated != self.mode:
            return
        self._steps += 1
        self._tokens += tokens
        self._seconds += seconds
        if self._steps < self.window:
            return
        rate = self._tokens / max(self._seconds, 1e-9)
        old = self.rates.get(self.mode)
        self.rates[self.mode] = rate if old is None else old + _EMA * (rate - old)
        self._steps, self._tokens, self._seconds = 0, 0, 0.0
        self._windows_in_mode += 1
        self.mode = self._next_mode()

    def _next_mode(self) -> bool:
        other = not self.mode
        interval = self._interval or self.explore_every
        if other not in self.rates:  # the other mode was never measured: measure it now
            self._windows_in_mode = 0
            return other
        best = self.rates[True] >= self.rates[False]
        if self._exploring:  # a look at the trailing mode ended
            self._exploring = False
            # It stayed behind: look less often. It took the lead: it runs now, and looks start over.
            self._interval = min(2 * interval, self.max_explore_every) if best != self.mode else self.explore_every
        if self.mode != best:  # measured slower than the other: back to the faster one
            self._windows_in_mode = 0
            return best
        if self._windows_in_mode >= (self._interval or self.explore_every):  # the leader for a while: look again
            self._windows_in_mode = 0
            self._exploring = True
            return other
        return self.mode
