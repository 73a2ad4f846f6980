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
"""
from __future__ import annotations

import gc


def release_frozen_heap() -> None:
    """Make the heap an earlier engine froze collectable again, and collect it."""
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()


def freeze_startup_heap() -> None:
    """Collect start-up garbage, then move every surviving object out of future collections."""
    gc.collect()
    gc.freeze()
