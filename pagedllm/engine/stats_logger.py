"""vLLM's periodic stats line (off with --disable-log-stats):

    Engine 000: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0 tokens/s, Running: 4 reqs,
    Waiting: 0 reqs, GPU KV cache usage: 12.5%, Prefix cache hit rate: 40.2%

read from the engine's stats snapshot (`AsyncEngineFront.stats()`), so it never touches the engine thread. A line
is logged at INFO while there is activity and once after it stops (its throughput back at 0), at DEBUG otherwise,
as in vLLM, so an idle server stays quiet.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger("pagedllm.stats")

#: vLLM's variable for the seconds between two lines (its default: 10).
STATS_INTERVAL_ENV = "VLLM_LOG_STATS_INTERVAL"
DEFAULT_STATS_INTERVAL_S = 10.0


def stats_interval_s() -> float:
    """Seconds between two stats lines: $VLLM_LOG_STATS_INTERVAL, else 10."""
    raw = os.environ.get(STATS_INTERVAL_ENV)
    if raw is None:
        return DEFAULT_STATS_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise ValueError(f"{STATS_INTERVAL_ENV} must be a number of seconds > 0, got {raw!r}.")
    return value


@dataclass(frozen=True)
class _Counters:
    """The snapshot's cumulative counters at one time."""

    time: float
    prompt_tokens: int
    generation_tokens: int
    prefix_queries: int
    prefix_hits: int

    @classmethod
    def of(cls, stats: dict[str, Any], now: float) -> _Counters:
        return cls(now, int(stats.get("prompt_tokens_total", 0)), int(stats.get("generation_tokens_total", 0)),
                   int(stats.get("prefix_cache_queries", 0)), int(stats.get("prefix_cache_hits", 0)))


class LoggingStatLogger:
    """Builds and logs the stats line for the time since its previous one. `snapshot` returns the engine's latest
    stats dict; `clock` is monotonic seconds (a fake one in tests)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._snapshot, self._clock = snapshot, clock
        self._last = _Counters.of(snapshot() or {}, clock())
        self._was_active = False
        self._hit_rate = 0.0  # of the latest prefix-cache lookups (kept while none happen)

    def log(self) -> str:
        """Log the line for the interval since the last call (INFO or DEBUG, see the module docstring); return
        it."""
        stats = self._snapshot() or {}
        now = _Counters.of(stats, self._clock())
        last, self._last = self._last, now
        elapsed = max(now.time - last.time, 1e-9)
        prompt_tp = (now.prompt_tokens - last.prompt_tokens) / elapsed
        generation_tp = (now.generation_tokens - last.generation_tokens) / elapsed
        queries = now.prefix_queries - last.prefix_queries
        if queries > 0:
            self._hit_rate = (now.prefix_hits - last.prefix_hits) / queries
        running, waiting = int(stats.get("num_running", 0)), int(stats.get("num_waiting", 0))
        total = int(stats.get("kv_blocks_total", 0))
        usage = 1.0 - int(stats.get("kv_blocks_free", 0)) / total if total else 0.0
        line = (f"Engine 000: Avg prompt throughput: {prompt_tp:.1f} tokens/s, Avg generation throughput: "
                f"{generation_tp:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                f"GPU KV cache usage: {usage * 100:.1f}%, Prefix cache hit rate: {self._hit_rate * 100:.1f}%")
        active = bool(prompt_tp or generation_tp or running or waiting)
        logger.log(logging.INFO if active or self._was_active else logging.DEBUG, line)
        self._was_active = active
        return line

    async def run(self, interval_s: float) -> None:
        """Log a line every `interval_s` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.log()
            except Exception:  # a broken line must not end the server's logging for good
                logger.exception("the stats line failed")
