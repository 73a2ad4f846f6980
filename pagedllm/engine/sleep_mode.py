"""vLLM's sleep mode: what an engine asleep holds, and the checks of sleep() / wake_up() arguments.

Level 1 offloads the weights to host memory and discards the KV cache; level 2 discards both (waking the
weights reloads them from the checkpoint). Each part wakes by its tag ("weights", "kv_cache"); the engine
runs requests again once every part is awake. Without ``enable_sleep_mode`` an engine refuses to sleep.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

logger = logging.getLogger("pagedllm")

SLEEP_LEVELS = (1, 2)
SLEEP_TAGS = ("weights", "kv_cache")
#: What sleep() does with requests still in flight: "abort" them (vLLM's default), or "wait" for them to finish.
SLEEP_MODES = ("abort", "wait")


class EngineSleepingError(RuntimeError):
    """A request reached an engine that is asleep (LLM.sleep / POST /sleep): wake it up first."""


def sleep_mode_disabled_error() -> ValueError:
    return ValueError("sleep mode is off for this engine: build it with enable_sleep_mode=True "
                      "(LLM(..., enable_sleep_mode=True), or --enable-sleep-mode for `pagedllm serve`).")


def check_sleep_args(level: int, mode: str = "abort") -> None:
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"level must be one of {list(SLEEP_LEVELS)} (1: offload the weights to host memory and "
                         f"discard the KV cache; 2: discard both), got {level!r}.")
    if mode not in SLEEP_MODES:
        raise ValueError(f"mode must be one of {list(SLEEP_MODES)} (what happens to requests in flight), got "
                         f"{mode!r}; vLLM's 'keep' (pause them in place) is not supported.")


def check_wake_tags(tags: list[str] | None) -> list[str]:
    """The tags to wake (every one for None), validated."""
    if tags is None:
        return list(SLEEP_TAGS)
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be a list of tag names from {list(SLEEP_TAGS)}, got {tags!r}.")
    unknown = [t for t in tags if t not in SLEEP_TAGS]
    if unknown:
        raise ValueError(f"unknown wake_up tag(s) {unknown}; allowed: {list(SLEEP_TAGS)}.")
    return list(dict.fromkeys(tags))


@dataclass
class SleepState:
    """An engine's sleep bookkeeping: the level it slept at and the parts still asleep."""

    level: int = 0
    asleep: set[str] = field(default_factory=set)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def fall_asleep(self, level: int) -> None:
        self.level, self.asleep = level, set(SLEEP_TAGS)

    def to_wake(self, tags: list[str] | None) -> list[str]:
        """The still-sleeping tags among `tags` (validated), in SLEEP_TAGS order; a warning for those awake."""
        wanted = check_wake_tags(tags)
        awake = [t for t in wanted if t not in self.asleep]
        if awake and tags is not None:
            logger.warning("wake_up: %s already awake", awake)
        return [t for t in SLEEP_TAGS if t in wanted and t in self.asleep]

    def woke(self, tags: list[str]) -> None:
        self.asleep -= set(tags)
        if not self.asleep:
            self.level = 0

    def check_awake(self) -> None:
        """Raise EngineSleepingError while any part is asleep."""
        if self.asleep:
            raise EngineSleepingError(
                f"the engine is asleep (level {self.level}; asleep: {sorted(self.asleep)}): call wake_up() "
                f"(POST /wake_up on the server) before sending requests.")
