"""Keep the engine's start-up heap out of Python's full garbage collections.

A full (generation-2) collection walks every tracked object. After start-up that is mostly the imports,
the model and the engine (~300 k objects), and CPython runs one whenever the survivors of younger
collections grow by a quarter of that: a few times in a run of a thousand requests, 100-250 ms each,
inside a step (issue 16's short workload lost ~0.7 s of 3.9 s to three of them on the H100).
``gc.freeze()`` moves the start-up heap to the permanent generation, which collections skip (vLLM's
EngineCore does the same after start-up).

Frozen objects are never collected, so a later engine in the same process first unfreezes and collects:
an earlier engine's KV pool and weights, kept alive only by reference cycles, go before the new engine
measures free device memory.

While the engine steps, young collections are made rarer (``fewer_young_collections``): a step allocates
thousands of short-lived objects (outputs, token lists, scheduler records) that die by reference counting
within a step or two, but at Python's default threshold (700 allocations) many are still alive when a
collection runs, so they are traversed and promoted, and the older generations' collections follow: 1 300
collections and 130-180 ms of one H100 run of 1 000 requests (2.8 s). With 50 000 allocations between young
collections most of them are gone before one runs.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

#: Allocations between young (generation-0) collections while the engine steps (Python's default: 700).
STEPPING_GEN0_THRESHOLD = 50_000


def release_frozen_heap() -> None:
    """Make the heap an earlier engine froze collectable again, and collect it."""
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()


def freeze_startup_heap() -> None:
    """Collect start-up garbage, then move every surviving object out of future collections."""
    gc.collect()
    gc.freeze()


def step_with_fewer_young_collections(threshold0: int = STEPPING_GEN0_THRESHOLD) -> tuple[int, ...]:
    """A young collection every `threshold0` allocations at most from now on (the older generations' thresholds
    unchanged), for a process that does nothing but step an engine (the engine-core process); returns the
    thresholds it replaced."""
    old = gc.get_threshold()
    gc.set_threshold(max(threshold0, old[0]), *old[1:])
    return old


@contextlib.contextmanager
def fewer_young_collections(threshold0: int = STEPPING_GEN0_THRESHOLD) -> Iterator[None]:
    """`step_with_fewer_young_collections` within the block; the interpreter's thresholds are restored on exit."""
    old = step_with_fewer_young_collections(threshold0)
    try:
        yield
    finally:
        gc.set_threshold(*old)
