"""vLLM's ``collective_rpc``: run a method of every worker, by name or as a function of the worker.

A method given by name runs as ``getattr(worker, method)(*args, **kwargs)``; a callable runs as
``method(worker, *args, **kwargs)``. To reach worker processes a callable travels as cloudpickle bytes
(lambdas and closures included, as in vLLM); its result must pickle. A worker's exception comes back as a
`WorkerRPCError` naming the rank, and the workers keep serving.
"""
from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable
from typing import Any

from pagedllm.worker.worker import Worker


class WorkerRPCError(RuntimeError):
    """A collective_rpc method raised on a worker (the message holds its traceback)."""


def check_rpc_method(method: str | Callable, args: tuple, kwargs: dict | None) -> dict:
    """Validate the call before anything is sent: a known Worker method name or a callable; returns kwargs."""
    if isinstance(method, str):
        if method.startswith("_") or not callable(getattr(Worker, method, None)):
            public = sorted(n for n in dir(Worker) if not n.startswith("_") and callable(getattr(Worker, n)))
            raise ValueError(f"collective_rpc: the worker has no method {method!r}; its methods: {public} (or pass "
                             f"a callable taking the worker as its first argument).")
    elif not callable(method):
        raise ValueError(f"collective_rpc: method must be a Worker method name or a callable, got "
                         f"{type(method).__name__}.")
    if not isinstance(args, (tuple, list)):
        raise ValueError(f"collective_rpc: args must be a tuple, got {type(args).__name__}.")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError(f"collective_rpc: kwargs must be a dict or None, got {type(kwargs).__name__}.")
    return dict(kwargs or {})


def pack_method(method: str | Callable) -> str | bytes:
    """What crosses to a worker process: a name as such, a callable as cloudpickle bytes."""
    if isinstance(method, str):
        return method
    import cloudpickle  # (only needed for callables across processes)

    return cloudpickle.dumps(method)


def run_method(worker: Worker, method: str | bytes | Callable, args: tuple, kwargs: dict) -> Any:
    """Run one collective_rpc call on `worker` (`method` as `pack_method` sent it, or as given in-process)."""
    if isinstance(method, bytes):
        import cloudpickle

        method = cloudpickle.loads(method)
    if isinstance(method, str):
        return getattr(worker, method)(*args, **kwargs)
    return method(worker, *args, **kwargs)


def run_method_guarded(worker: Worker, method: str | bytes, args: tuple, kwargs: dict) -> tuple[str, Any]:
    """`run_method` for a worker process: ("ok", result) or ("err", traceback) — an exception in the user's method
    must not stop the rank, as an exception in a step does."""
    try:
        result = run_method(worker, method, args, kwargs)
        pickle.dumps(result)  # it must reach the driver: a result that does not pickle is this call's error
    except Exception:
        return "err", traceback.format_exc()
    return "ok", result


def unpack_results(results: list[tuple[str, Any]]) -> list[Any]:
    """Every rank's result in rank order; WorkerRPCError naming the first rank that raised."""
    for rank, (status, value) in enumerate(results):
        if status != "ok":
            raise WorkerRPCError(f"collective_rpc failed on worker rank {rank}:\n{value}")
    return [value for _, value in results]
