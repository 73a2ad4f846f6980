"""Report every Triton kernel specialisation built after the warm start (issue 16: no request pays for one).

Triton builds a binary per kernel for each combination of constexpr values and integer/pointer specialisations, on
the first launch that needs it: tens of milliseconds when the on-disk cache has it, a second or more when it does
not. The warm start compiles what the steps will reach; ``CompileWatch`` is the check that it did. Installed
after the warm start, it hears Triton's ``jit_cache_hook`` (called before every build or cache load of a
specialisation not yet in memory), keeps each event and logs one warning naming the kernel and its specialisation.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger("pagedllm")


@dataclass(frozen=True)
class CompileEvent:
    """One specialisation built (or loaded from Triton's disk cache) after the warm start."""

    kernel: str  # module.qualname
    specialization: str  # Triton's repr: launch options and each argument's type / specialisation
    at: float  # time.perf_counter() when the build started


class CompileWatch:
    """Collects the Triton builds that happen while installed (``install`` / ``uninstall``; chains a hook that was
    there before). A no-op where Triton is not importable (CPU builds of torch)."""

    def __init__(self) -> None:
        self.events: list[CompileEvent] = []
        self._previous = None
        self._installed = False

    def install(self) -> bool:
        """Start watching; False where Triton is unavailable."""
        try:
            from triton import knobs
        except ImportError:
            return False
        if not self._installed:
            self._previous = knobs.runtime.jit_cache_hook
            knobs.runtime.jit_cache_hook = self._hook
            self._installed = True
        return True

    def uninstall(self) -> None:
        if self._installed:
            from triton import knobs

            if knobs.runtime.jit_cache_hook == self._hook:
                knobs.runtime.jit_cache_hook = self._previous
            self._installed = False

    def _hook(self, *, key, repr: str, fn, compile, is_manual_warmup: bool, already_compiled: bool):  # noqa: A002
        name = f"{fn.module}.{fn.name}"
        self.events.append(CompileEvent(name, repr, time.perf_counter()))
        # The key names the specialisation (argument dtypes, alignments, 1 / multiple-of-16 integers) that a warm-up
        # did not build.
        logger.warning("Triton kernel %s compiled after the warm start (a step waits for it): %s; key %s", name, repr,
                       str(key)[:2000])
        if self._previous is not None:
            return self._previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                                  already_compiled=already_compiled)
        return False  # a true value would skip the build


@contextlib.contextmanager
def watchers_paused() -> Iterator[None]:
    """While an engine's warm start builds kernels on purpose: Triton's build hook is cleared, so that the watcher of
    another engine in this process (a benchmark's earlier or concurrent engine) does not report those builds as its
    steps waiting on the compiler; restored after. A no-op without Triton."""
    try:
        from triton import knobs
    except ImportError:
        yield
        return
    saved = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = None
    try:
        yield
    finally:
        knobs.runtime.jit_cache_hook = saved
