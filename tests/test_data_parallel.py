"""`pagedllm serve --data-parallel-size 2`: two engine-core processes behind one server, on the bundled model.

Requests spread over both ranks (each rank's process does the work of its share), every output equals the same
request served alone (batch-invariant mode, so the batch a request lands in cannot change it), /metrics sums both
ranks' pools and counters, a disconnect frees its blocks on its rank, and the offline API refuses the option."""
from __future__ import annotations

import asyncio
import signal

import httpx
import psutil
import pytest

pytest.importorskip("fastapi")

from conftest_server import MODEL_NAME, RemoteServer  # noqa: E402

from pagedllm import LLM  # noqa: E402
from pagedllm.batch_invariance import BATCH_INVARIANT_ENV  # noqa: E402
from pagedllm.engine.arg_utils import EngineArgs  # noqa: E402
from pagedllm.engine.dp_client import merge_stats, rank_process_env  # noqa: E402

BLOCKS = 64
ARGS = ["--data-parallel-size", "2", "--num-gpu-blocks-override", str(BLOCKS), "--max-model-len", "512",
        "--swap-space", "0.05", "--no-dashboard"]
PROMPTS = [f"Write one sentence about the number {i}." for i in range(8)]
MAX_TOKENS = 24


def test_merge_stats_sums_counters_and_recomputes_ratios():
    a = {"kv_blocks_total": 64, "kv_blocks_free": 60, "healthy": True, "kv_cache_dtype": "float32",
         "kv_frac_used": 0.2, "spec_decode_num_accepted_tokens": 3, "spec_decode_num_draft_tokens": 4,
         "spec_decode_acceptance_rate": 0.75}
    b = {"kv_blocks_total": 64, "kv_blocks_free": 50, "healthy": False, "kv_cache_dtype": "float32",
         "kv_frac_used": 0.4, "spec_decode_num_accepted_tokens": 1, "spec_decode_num_draft_tokens": 4,
         "spec_decode_acceptance_rate": 0.25}
    m = merge_stats([a, b])
    assert m["kv_blocks_total"] == 128 and m["kv_blocks_free"] == 110
    assert m["healthy"] is False and m["kv_cache_dtype"] == "float32"
    assert m["kv_frac_used"] == pytest.approx(0.3)
    assert m["spec_decode_acceptance_rate"] == pytest.approx(0.5)  # 4 accepted of 8 drafted, not a mean of means
    assert m["data_parallel_size"] == 2


def test_rank_environment_splits_cores_and_gpus(monkeypatch):
    args = EngineArgs(data_parallel_size=2, tensor_parallel_size=2, device="cuda")
    assert rank_process_env(1, args, 16, ["0", "1", "2", "3"]) == {"OMP_NUM_THREADS": "8",
                                                                   "CUDA_VISIBLE_DEVICES": "2,3"}
    with pytest.raises(ValueError, match="needs 4 GPUs; 3 are visible"):
        rank_process_env(0, args, 16, ["0", "1", "2"])
    cpu = EngineArgs(data_parallel_size=2, device="cpu")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert rank_process_env(0, cpu, 2, ["0"]) == {"OMP_NUM_THREADS": "1"}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")  # (tests/test_cpu_threads.py has the other cases)
    assert rank_process_env(1, cpu, 2, ["0"], [0, 1]) == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}


def test_bad_sizes_and_the_offline_api_are_refused():
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        EngineArgs(data_parallel_size=0).compat_notes()
    with pytest.raises(ValueError, match="pagedllm serve --data-parallel-size"):
        LLM(data_parallel_size=2)


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(ARGS, env={BATCH_INVARIANT_ENV: "1"})
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.tail()


def _complete(client: httpx.Client, prompt: str) -> str:
    r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                            "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def _complete_all(base_url: str) -> list[str]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        async def one(prompt: str) -> str:
            r = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt,
                                                          "max_tokens": MAX_TOKENS, "temperature": 0,
                                                          "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        return await asyncio.gather(*(one(p) for p in PROMPTS))


def _engine_cores(server: RemoteServer) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.proc.pid).children() if "spawn" in " ".join(p.cmdline())
            and "resource_tracker" not in " ".join(p.cmdline())]


def test_two_ranks_share_the_load_and_outputs_equal_each_request_alone(server):
    cores = _engine_cores(server)
    assert len(cores) == 2, [p.cmdline() for p in psutil.Process(server.proc.pid).children()]
    m = server.metrics()
    assert m["pagedllm:kv_blocks_total"] == 2 * BLOCKS  # one pool per rank, reported together
    busy_before = [sum(p.cpu_times()[:2]) for p in cores]
    together = asyncio.run(_complete_all(server.base_url))
    busy = [sum(p.cpu_times()[:2]) - b for p, b in zip(cores, busy_before)]
    # Least-loaded routing puts four of the eight concurrent requests on each rank: both processes decode.
    assert min(busy) > 0.25 * max(busy), busy
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        alone = [_complete(client, p) for p in PROMPTS]
    assert together == alone
    after = server.wait_idle(60)
    assert after["vllm:generation_tokens_total"] - m["vllm:generation_tokens_total"] == 2 * len(PROMPTS) * MAX_TOKENS
    assert after["pagedllm:kv_blocks_free"] == 2 * BLOCKS


def test_a_disconnect_frees_its_blocks_on_its_rank(server):
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            body = {"model": MODEL_NAME, "prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        break  # leave mid-stream: the server aborts the request

    asyncio.run(scenario())
    m = server.wait_idle(60)
    assert m["vllm:num_requests_running"] == 0
    assert m["pagedllm:kv_blocks_free"] == m["pagedllm:kv_blocks_total"] == 2 * BLOCKS


def test_in_process_engine_cannot_be_data_parallel():
    with pytest.raises(RuntimeError, match="cannot be combined with --disable-frontend-multiprocessing"):
        RemoteServer(["--data-parallel-size", "2", "--disable-frontend-multiprocessing", *ARGS[2:]],
                     startup_timeout=120)
