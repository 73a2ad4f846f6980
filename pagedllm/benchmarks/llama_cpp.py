"""llama.cpp's ``llama-server`` as a throughput peer (``pagedllm bench throughput --compare llama.cpp``).

The same GGUF file and the same token-id prompts go to a ``llama-server`` child process with ``-np N``
parallel slots (continuous batching), greedy, ``ignore_eos`` and the same ``n_predict`` per request; the
client sends every request at once and times the batch. Several slot counts can be tried; the best one
is the peer's figure. Getting the binary: README.md, "llama.cpp as a CPU peer".
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Self

from pagedllm.benchmarks.throughput import Result, Workload
from pagedllm.cache_dir import pagedllm_cache_dir

SERVER_ENV = "PAGEDLLM_LLAMA_SERVER"
# --no-repack: on the Xeon of BENCHMARKS.md §20 ggml's AMX weight path (a repacked buffer) segfaults in the
# server's first batch; for Q4_1 it is the only repack there is, so this leaves llama.cpp's AVX-512 kernels.
DEFAULT_EXTRA_ARGS: tuple[str, ...] = ("--no-repack",)


def find_llama_server(explicit: str | None = None) -> str | None:
    """``explicit``, ``$PAGEDLLM_LLAMA_SERVER``, ``llama-server`` on PATH, or the pagedllm cache's build."""
    for cand in (explicit, os.environ.get(SERVER_ENV), shutil.which("llama-server"),
                 str(pagedllm_cache_dir("llama.cpp") / "build" / "bin" / "llama-server")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class LlamaServer:
    """A ``llama-server`` child process on a free local port; a context manager that stops it on exit."""

    def __init__(self, binary: str, gguf: str, parallel: int, ctx_per_slot: int, threads: int,
                 batch_size: int = 512, startup_timeout: float = 300.0,
                 extra_args: tuple[str, ...] = DEFAULT_EXTRA_ARGS) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "-np", str(parallel),
                    "-c", str(ctx_per_slot * parallel), "-t", str(threads), "-tb", str(threads), "-b",
                    str(batch_size), "-ub", str(batch_size), "-ngl", "0", "--no-warmup", "--cont-batching",
                    *extra_args]
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (the server's log, open while it runs)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"llama-server did not become healthy in {startup_timeout:.0f} s")
            time.sleep(0.2)

    def log_tail(self, n: int = 2000) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-n:]

    def complete(self, prompt: list[int], n_predict: int, timeout: float = 3600.0) -> dict:
        return _post(self.url + "/completion", {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True,
                                                "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                                                "stream": False, "return_tokens": True}, timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_llama_server(binary: str, gguf: str, wl: Workload, parallel: int, threads: int, warmup: bool = True,
                     extra_args: tuple[str, ...] = DEFAULT_EXTRA_ARGS) -> tuple[Result, list[list[int]]]:
    """Every request of ``wl`` sent at once to a server with ``parallel`` slots → (timed Result, output ids)."""
    ctx = max(len(p) + n for p, n in zip(wl.prompts, wl.output_len)) + 16
    with LlamaServer(binary, gguf, parallel, ctx, threads, extra_args=extra_args) as server:
        if warmup:
            server.complete(wl.prompts[0][:8], 2)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=min(len(wl.prompts), max(parallel, 1) * 2)) as pool:
            outs = list(pool.map(lambda pn: server.complete(pn[0], pn[1]), zip(wl.prompts, wl.output_len)))
        elapsed = time.perf_counter() - t0
    n_out = sum(int(o.get("tokens_predicted", 0)) for o in outs)
    tokens = [list(o.get("tokens") or []) for o in outs]
    return Result(f"llama.cpp-np{parallel}", elapsed, len(outs), sum(map(len, wl.prompts)), n_out), tokens
