"""Process helpers for tests that check no process outlives its owner (Linux /proc)."""
from __future__ import annotations

import os
import time


def pid_running(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    """The pids of `pids` still running after waiting up to `timeout_s` for all of them to end."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_running(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if pid_running(p)]


def child_pids(pid: int) -> list[int]:
    """The children of `pid` started by multiprocessing's spawn (workers, the engine-core process)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode()
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            if ppid == pid and "spawn_main" in cmdline:
                children.append(int(entry))
    return children
