"""The serving benchmarks run end to end on CPU against a real `pagedllm serve`: `bench serving`'s
streamed Poisson load (every request completes, its tokens counted from the stream) and
`bench http-overhead` (the same batch through HTTP and `LLM.generate`, same greedy texts)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("aiohttp")

from conftest_server import SMALL_SERVER_ARGS, RemoteServer  # noqa: E402


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SMALL_SERVER_ARGS)
    yield srv
    srv.stop()


def test_bench_serving_counts_every_streamed_token(server, tmp_path):
    out = tmp_path / "serving.json"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "serving", "--port", str(server.port),
           "--num-prompts", "6", "--request-rate", "20", "--input-len", "24", "--output-len", "12",
           "--range-ratio", "0.5", "--seed", "3", "--result-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())["result"]
    settings = json.loads(out.read_text())["settings"]
    from argparse import Namespace

    from pagedllm.benchmarks.serving import make_workload

    expected = sum(n for _, n in make_workload(Namespace(**settings)))
    assert res["completed"] == 6 and res["failed"] == 0
    assert res["total_output_tokens"] == expected  # ignore_eos: exactly the asked lengths, from the stream
    assert 0 < res["median_ttft_ms"] < res["median_e2el_ms"] and res["median_tpot_ms"] > 0
    assert "Serving Benchmark Result" in proc.stdout


def test_bench_http_overhead_same_text_both_ways(tmp_path):
    out = tmp_path / "http.json"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "bench", "http-overhead", "--num-requests", "4",
           "--input-len", "12", "--output-lens", "4", "--repeats", "1", "--num-gpu-blocks-override", "128",
           "--max-model-len", "256", "--output-json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    (res,) = json.loads(out.read_text())["results"]
    assert res["num_requests"] == 4 and res["identical_texts"] == 4
    assert res["offline_s"] > 0 and res["http_s"] > 0 and res["http_first_ttft_s"] > 0
