"""Faults in a real `pagedllm serve` process: an exception inside one engine step (injected by a
wrapper script around the CLI) ends the requests of that step visibly (a stream gets an OpenAI error
event then one [DONE], a whole response a 500 `engine_error`), frees their blocks, and the server
keeps serving. A request still queued (no step had started it) is not failed: it runs after the fault,
and it and requests sent afterwards get the same greedy output as before the fault."""
from __future__ import annotations

import asyncio
import json
import signal
import textwrap

import httpx
import pytest

pytest.importorskip("fastapi")

from conftest_server import FAULT_INJECTING_LAUNCHER, RemoteServer  # noqa: E402
from reliability import error_body_problem  # noqa: E402

ARGS = ["--num-gpu-blocks-override", "64", "--max-model-len", "256", "--swap-space", "0.05", "--max-num-seqs", "3"]


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    d = tmp_path_factory.mktemp("fault")
    script = d / "serve_with_fault.py"
    script.write_text(textwrap.dedent(FAULT_INJECTING_LAUNCHER))
    arm = d / "arm"
    srv = RemoteServer(ARGS, launcher=[str(script), str(arm)])
    yield srv, arm
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _greedy(srv: RemoteServer) -> str:
    r = httpx.post(srv.url("/v1/completions"), timeout=60, json=GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


async def _stream(client: httpx.AsyncClient, path: str, body: dict) -> list[str]:
    events = []
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    return events


def test_step_exception_ends_in_flight_requests_visibly_and_server_recovers(faulty):
    srv, arm = faulty
    before = _greedy(srv)
    long = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
            tasks = [
                asyncio.create_task(_stream(client, "/v1/completions", {"prompt": "Once upon a time", **long})),
                asyncio.create_task(_stream(client, "/v1/chat/completions",
                                            {"messages": [{"role": "user", "content": "Hi"}], **long})),
                asyncio.create_task(client.post("/v1/completions", json={"prompt": "Tell me", **long})),
            ]
            while srv.metrics()["vllm:num_requests_running"] < 3:  # --max-num-seqs 3: all slots taken
                await asyncio.sleep(0.05)
            tasks.append(asyncio.create_task(client.post("/v1/completions", json=GREEDY)))
            while srv.metrics()["vllm:num_requests_waiting"] < 1:
                await asyncio.sleep(0.05)
            arm.touch()
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    stream_a, stream_b, whole, queued = asyncio.run(scenario())
    assert not arm.exists(), "the fault never fired"
    for events in (stream_a, stream_b):
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        objs = [json.loads(e) for e in events[:-1]]
        errors = [o["error"] for o in objs if "error" in o]
        finished = [c.get("finish_reason") for o in objs for c in o.get("choices", []) if c.get("finish_reason")]
        assert len(errors) == 1 and not finished, events[-3:]  # ended visibly, never a bare [DONE]
        assert errors[0]["code"] == "engine_error" and "injected fault" in errors[0]["message"]
    assert whole.status_code == 500, whole.text
    assert error_body_problem(500, whole.content) is None
    assert whole.json()["error"]["code"] == "engine_error"

    assert queued.status_code == 200, queued.text  # not started by the failed step: it kept its place
    assert queued.json()["choices"][0]["text"] == before

    m = srv.wait_idle(30)
    assert m["pagedllm:kv_blocks_free"] == m["pagedllm:kv_blocks_total"], "KV blocks leaked by the fault"
    assert httpx.get(srv.url("/health"), timeout=10).status_code == 200
    assert _greedy(srv) == before  # the engine's state is sound: same greedy output as before the fault
    assert "engine step failed" in srv.logs()
