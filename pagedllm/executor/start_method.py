"""How tensor-parallel worker processes are started: "spawn", or "fork" when spawn cannot work.

"spawn" re-imports the main module in every worker, so a script that builds a TP engine at module
level (no ``if __name__ == "__main__":`` guard) would run again in each worker and fail in the
multiprocessing bootstrap. Like vLLM, we then fork instead, which needs no re-import, as long as
CUDA has not been initialised in this process (a forked child cannot use the parent's CUDA
context); otherwise one clear error names the fix.
"""
from __future__ import annotations

import ast
import os
import sys
from types import FrameType

#: Set to "spawn" or "fork" to force a start method (vLLM's VLLM_WORKER_MULTIPROC_METHOD).
START_METHOD_ENV = "PAGEDLLM_WORKER_MULTIPROC_METHOD"


def _main_guard_ranges(path: str) -> list[tuple[int, int]]:
    """Line ranges of the bodies of top-level ``if __name__ == "__main__":`` blocks in `path`."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return []
    ranges = []
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_test(node.test):
            ranges.append((node.body[0].lineno, max(n.end_lineno or n.lineno for n in node.body)))
    return ranges


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return bool(names and consts)


def _main_module_frame(frame: FrameType | None) -> FrameType | None:
    """The frame running the main script's top-level code, if it is on the stack."""
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    while frame is not None:
        if (frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__"
                and main_file is not None and frame.f_code.co_filename == main_file):
            return frame
        frame = frame.f_back
    return None


def started_from_unguarded_main() -> bool:
    """True when the main script is calling us from top-level code outside a ``__main__`` guard.

    Spawned workers re-import the main module; code outside the guard would then run again there.
    """
    frame = _main_module_frame(sys._getframe(1))
    if frame is None:
        return False
    return not any(lo <= frame.f_lineno <= hi for lo, hi in _main_guard_ranges(frame.f_code.co_filename))


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def worker_start_method() -> str:
    """"spawn" by default; "fork" for an unguarded main script when that is safe; else a clear error."""
    forced = os.environ.get(START_METHOD_ENV)
    if forced:
        if forced not in ("spawn", "fork"):
            raise ValueError(f"{START_METHOD_ENV} must be 'spawn' or 'fork', got {forced!r}.")
        return forced
    if not started_from_unguarded_main():
        return "spawn"
    if _cuda_initialized():
        raise RuntimeError(
            "tensor_parallel_size > 1 was requested from the top level of a script without an "
            "`if __name__ == \"__main__\":` guard, after CUDA was initialised in this process, so the "
            "workers can neither be forked (CUDA does not survive fork) nor spawned (spawn re-runs the "
            "script). Put the code that builds the engine under `if __name__ == \"__main__\":`.")
    return "fork"
