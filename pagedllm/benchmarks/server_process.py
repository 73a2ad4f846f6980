"""`pagedllm serve` as a real subprocess on a loopback port, for benchmarks and the server tests."""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`pagedllm serve FLAGS` on 127.0.0.1 (a free port unless `port` is given); ready once /health answers 200.

    `launcher` replaces `-m pagedllm.entrypoints.cli` (a script that wraps the CLI, e.g. to inject faults).
    `env`: variables set for the server on top of this process's (e.g. ``VLLM_BATCH_INVARIANT``).
    The server's stdout and stderr go to a temporary log file (`logs()`, `tail()`).
    """

    def __init__(self, flags: list[str], startup_timeout: float = 240.0, launcher: list[str] | None = None,
                 port: int | None = None, env: dict[str, str] | None = None) -> None:
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagedllm-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, *(launcher or ["-m", "pagedllm.entrypoints.cli"]), "serve", "--host", self.host,
               "--port", str(self.port), *flags]
        logger.info("starting: %s", " ".join(cmd))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
        self._wait_ready(startup_timeout)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def logs(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def tail(self, n: int = 4000) -> str:
        return self.logs()[-n:]

    def _wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagedllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url("/health"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.kill()
        raise RuntimeError(f"pagedllm serve was not healthy after {timeout} s:\n{self.tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int | None:
        """Send `sig` and wait for the exit status (kill after `timeout` s)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
