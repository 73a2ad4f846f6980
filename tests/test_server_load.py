"""Concurrency, client disconnects and shutdown against a real server process."""
from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from conftest_server import SMALL_SERVER_ARGS, RemoteServer  # noqa: E402


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--shutdown-timeout", "2"])
    yield srv
    srv.stop(signal.SIGTERM)


async def _stream_completion(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """Read one SSE completion stream; returns text, finish reasons, usage and the number of [DONE]s."""
    text, finishes, usage, dones, ids = "", [], None, 0, set()
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if line == "data: [DONE]":
                dones += 1
                continue
            payload = json.loads(line[6:])
            assert "error" not in payload, payload
            ids.add(payload["id"])
            if payload.get("usage"):
                usage = payload["usage"]
            for ch in payload["choices"]:
                text += ch["text"]
                if ch["finish_reason"]:
                    finishes.append(ch["finish_reason"])
    return {"text": text, "finishes": finishes, "usage": usage, "dones": dones, "ids": ids}


@pytest.mark.slow
def test_many_concurrent_streams_all_complete(server):
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    bodies = []
    for i in range(120):
        prompt = f"Request {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(1, 80)))
        bodies.append({"prompt": prompt, "max_tokens": rng.randint(2, 12), "temperature": 0.0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}})

    async def run_all():
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*[_stream_completion(client, server.url("/v1/completions"), b)
                                          for b in bodies])

    before = server.metrics()
    results = asyncio.run(run_all())
    all_ids = set()
    for body, res in zip(bodies, results):
        assert res["dones"] == 1
        assert res["finishes"] == ["length"]
        assert res["usage"]["completion_tokens"] == body["max_tokens"]
        assert len(res["ids"]) == 1
        all_ids |= res["ids"]
    assert len(all_ids) == len(bodies)  # none dropped or duplicated
    after = server.wait_idle()
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:num_requests_swapped"] == 0
    assert after["pagedllm:kv_blocks_free"] == after["pagedllm:kv_blocks_total"] == 256
    assert after["vllm:gpu_cache_usage_perc"] == 0.0
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert generated >= sum(b["max_tokens"] for b in bodies)
    assert after["vllm:request_success_total"] - before.get("vllm:request_success_total", 0) == len(bodies)


def test_disconnect_frees_blocks_and_server_keeps_serving(server):
    """Streams closed mid-flight (and before their first token) are aborted; their blocks come back."""
    long_prompt = "word " * 400

    async def scenario() -> tuple[dict, dict]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"prompt": "Tell me a long story.", "max_tokens": 900, "ignore_eos": True, "stream": True}
            opened = []
            for _ in range(8):  # mid-flight: read a few tokens, then leave
                cm = client.stream("POST", server.url("/v1/completions"), json=body)
                r = await cm.__aenter__()
                lines = r.aiter_lines()
                got = 0
                while got < 3:
                    if (await lines.__anext__()).startswith("data: {"):
                        got += 1
                opened.append((cm, lines))  # keep the line iterator alive: collecting it closes the stream
            early = []
            for _ in range(2):  # before the first token: leave as soon as the headers arrive
                cm = client.stream("POST", server.url("/v1/completions"),
                                   json={**body, "prompt": long_prompt, "max_tokens": 100})
                await cm.__aenter__()
                early.append((cm, None))
            busy = server.metrics()
            for cm, _ in opened + early:
                await cm.__aexit__(None, None, None)
            return busy, server.wait_idle(timeout=30)

    before = server.metrics()
    busy, idle = asyncio.run(scenario())
    assert busy["pagedllm:kv_blocks_free"] < busy["pagedllm:kv_blocks_total"]  # they really held blocks
    assert busy["vllm:num_requests_running"] + busy["vllm:num_requests_waiting"] >= 8
    assert idle["vllm:num_requests_running"] == 0 and idle["vllm:num_requests_waiting"] == 0
    assert idle["pagedllm:kv_blocks_free"] == idle["pagedllm:kv_blocks_total"]
    assert idle["pagedllm:request_aborted_total"] - before["pagedllm:request_aborted_total"] >= 10
    # Far fewer tokens than 8 x 900 were generated: the requests were stopped, not run to the end.
    assert idle["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 8 * 200
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_non_streaming_disconnect_aborts(server):
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), timeout=2.0,
                   json={"prompt": "Count to a thousand:", "max_tokens": 900, "ignore_eos": True})
    idle = server.wait_idle(timeout=30)
    assert idle["pagedllm:kv_blocks_free"] == idle["pagedllm:kv_blocks_total"]
    assert idle["pagedllm:request_aborted_total"] - before["pagedllm:request_aborted_total"] >= 1
    assert idle["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 600


def test_health_and_metrics_answer_while_busy(server):
    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"prompt": "word " * 300, "max_tokens": 24, "ignore_eos": True}
            jobs = [asyncio.create_task(client.post(server.url("/v1/completions"), json=body)) for _ in range(4)]
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            health = await client.get(server.url("/health"))
            metrics = await client.get(server.url("/metrics"))
            latency = time.monotonic() - t0
            running = [j for j in jobs if not j.done()]
            results = await asyncio.gather(*jobs)
            return health, metrics, latency, len(running), results

    health, metrics, _latency, n_running, results = asyncio.run(scenario())
    assert health.status_code == 200 and metrics.status_code == 200
    assert n_running > 0  # the engine was busy while /health and /metrics answered
    assert all(r.status_code == 200 for r in results)


def test_sigterm_with_inflight_requests_exits_zero(server):
    """SIGTERM: in-flight streams end (finished or with an error event + [DONE]); the process exits 0."""
    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"prompt": "Tell me a story.", "max_tokens": 900, "ignore_eos": True, "stream": True}
            async with client.stream("POST", server.url("/v1/completions"), json=body) as r:
                lines = r.aiter_lines()
                first = await lines.__anext__()
                server.proc.send_signal(signal.SIGTERM)
                rest = [first] + [ln async for ln in lines]
            return [ln for ln in rest if ln]

    t0 = time.monotonic()
    lines = asyncio.run(scenario())
    assert lines[-1] == "data: [DONE]"
    assert any('"error"' in ln and "shutting down" in ln for ln in lines)
    assert server.proc.wait(30) == 0, server.logs()[-3000:]
    assert time.monotonic() - t0 < 30
    assert "server stopped cleanly" in server.logs()
