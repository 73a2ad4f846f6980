"""Helpers for server tests: run `pagedllm serve` as a real subprocess on a free loopback port."""
from __future__ import annotations

import json
import re
import time

import httpx

from pagedllm.benchmarks.server_process import ServerProcess

# A small pool so the server starts fast and the tests exercise a full pool.
SMALL_SERVER_ARGS = ["--num-gpu-blocks-override", "256", "--max-model-len", "1024", "--swap-space", "0.05"]
MODEL_NAME = "SmolLM2-135M-Instruct"
# A `pagedllm` launcher (argv: ARM_FILE, then the CLI's arguments) whose engine raises once inside the model call
# of the next step after the test creates ARM_FILE.
FAULT_INJECTING_LAUNCHER = '''
import os, sys
from pagedllm.executor import uniproc
from pagedllm.entrypoints.cli import main

ARM = sys.argv.pop(1)
real = uniproc.UniProcExecutor.execute_model

def execute_model(self, req):
    if os.path.exists(ARM):
        os.remove(ARM)
        raise RuntimeError("injected fault in one step")
    return real(self, req)

uniproc.UniProcExecutor.execute_model = execute_model
sys.exit(main(sys.argv[1:]))
'''


class RemoteServer(ServerProcess):
    """`pagedllm serve ARGS` on 127.0.0.1:<free port>; waits until /health answers 200."""

    def __init__(self, args: list[str], startup_timeout: float = 240.0, launcher: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(args, startup_timeout, launcher, env=env)

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


def stream_chunks(server, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed request to `server` (the model's name added to `body`), [DONE] left out."""
    chunks = []
    with httpx.stream("POST", server.url(path), json={"model": MODEL_NAME, "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks

