"""Helpers for server tests: run `pagedllm serve` as a real subprocess on a free loopback port."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

# A small pool so the server starts fast and the tests exercise a full pool.
SMALL_SERVER_ARGS = ["--num-gpu-blocks-override", "256", "--max-model-len", "1024", "--swap-space", "0.05"]
MODEL_NAME = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`pagedllm serve ARGS` on 127.0.0.1:<free port>; waits until /health answers 200."""

    def __init__(self, args: list[str], startup_timeout: float = 240.0, launcher: list[str] | None = None) -> None:
        """`launcher` replaces `-m pagedllm.entrypoints.cli` (a script that wraps the CLI, e.g. to inject faults)."""
        self.port = free_port()
        self.host = "127.0.0.1"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagedllm-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, *(launcher or ["-m", "pagedllm.entrypoints.cli"]), "serve", "--host", self.host,
               "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._wait_ready(startup_timeout)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def logs(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()[-4000:]}")
            try:
                if httpx.get(self.url("/health"), timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.kill()
        raise RuntimeError(f"server did not become healthy in {timeout} s:\n{self.logs()[-4000:]}")

    def metrics(self) -> dict[str, float]:
        """Prometheus samples summed over labels: {'vllm:num_requests_running': 0.0, ...}."""
        text = httpx.get(self.url("/metrics"), timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)", line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and the pool is whole; returns the last sample."""
        deadline = time.monotonic() + timeout
        m = self.metrics()
        while time.monotonic() < deadline:
            m = self.metrics()
            busy = m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] + m["vllm:num_requests_swapped"]
            if busy == 0 and m["pagedllm:kv_blocks_free"] == m["pagedllm:kv_blocks_total"]:
                return m
            time.sleep(0.2)
        return m

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Send `sig` and wait for the exit status."""
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
