"""Reliability suite, fast subset (the 1 000-stream version is benchmarks/soak.py): schema fuzzing and
hostile bodies never give a 5xx or a dropped connection; a load of concurrent streams with mixed n,
best_of, stop strings, prefix caching, disconnects and aborts ends every request exactly once, and every greedy
or seeded request with the text it gets served alone (the server runs with VLLM_BATCH_INVARIANT=1, so preemption
cannot change it); the pool comes back whole; SIGTERM lets in-flight requests finish or ends them visibly."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("schemathesis")

from conftest_server import RemoteServer  # noqa: E402

from pagedllm.batch_invariance import BATCH_INVARIANT_ENV  # noqa: E402
from reliability import constraint_problem, fuzz_schema, run_load, send_hostile  # noqa: E402

KEY = "rel-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SHUTDOWN_TIMEOUT = 2.0
# A pool of 32 blocks x 16 tokens under 32 concurrent sequences: preemption is routine. A short
# context keeps every valid fuzzed request (max_tokens null = up to the context) quick.
ARGS = ["--num-gpu-blocks-override", "32", "--max-model-len", "128", "--swap-space", "0.05", "--max-num-seqs", "32",
        "--enable-prefix-caching", "--api-key", KEY, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)]


@pytest.fixture(scope="module")
def server():
    # Batch-invariant (pagedllm/batch_invariance.py): a preempted request recomputes its tokens in other chunks, and
    # only then do its greedy and seeded outputs equal themselves served alone on every CPU, bit for bit.
    srv = RemoteServer(ARGS, env={BATCH_INVARIANT_ENV: "1"})
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


def _assert_idle(server: RemoteServer) -> None:
    m = server.wait_idle(60)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["pagedllm:kv_blocks_free"] == m["pagedllm:kv_blocks_total"], "KV blocks leaked"


def _serves_normally(server: RemoteServer) -> None:
    r = httpx.post(server.url("/v1/completions"), headers=AUTH, timeout=60,
                   json={"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_schema_fuzz_never_5xx(server):
    statuses, failures = fuzz_schema(server.base_url, AUTH, max_examples=30, seed=17)
    print("schemathesis statuses:", dict(statuses))
    assert sum(statuses.values()) >= 250  # the issue asks CI for "a few hundred" cases
    assert failures == [], "\n".join(failures[:10])
    _assert_idle(server)
    _serves_normally(server)


def test_hostile_bodies_are_clean_4xx(server):
    statuses, failures = send_hostile(server.base_url, AUTH)
    print("hostile statuses:", dict(statuses))
    assert failures == [], "\n".join(failures)
    assert statuses[413] >= 1 and statuses[400] >= 20
    _assert_idle(server)
    _serves_normally(server)


def test_load_every_request_ends_exactly_once(server):
    before = server.metrics()
    res = asyncio.run(run_load(server.base_url, AUTH, n_requests=150, max_tokens=6, seed=17, check_seeded=True))
    after = server.wait_idle(60)
    print("load outcomes:", dict(res.outcomes), "p99 %.2f s" % res.p(0.99),
          "preemptions", after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"])
    assert res.lost == 0 and res.problems == [], "\n".join(res.problems[:10])
    assert sum(res.outcomes.values()) == res.sent
    assert res.outcomes["completed"] >= res.sent // 2
    # Constrained outputs that their grammar ended were checked against it (_check_outputs), each form at least once.
    print("constrained outputs:", dict(res.constrained))
    ended = {k.split(":")[0] for k, v in res.constrained.items() if k.endswith((":stop", ":tool_calls")) and v}
    assert ended == {"choice", "regex", "json", "tool"}
    assert res.constrained["allowed:length"] > 0  # allowed_token_ids + logit_bias outputs, every one checked
    _assert_idle(server)
    _serves_normally(server)


def test_the_load_catches_an_output_that_breaks_its_constraint():
    assert constraint_problem("choice", "green") is None and constraint_problem("choice", "purple")
    assert constraint_problem("regex", "123-45") is None and constraint_problem("regex", "123-456")
    assert constraint_problem("json", '{"id": 7}') is None
    for bad in ('{"id": 7', '{"id": "7"}', '{"id": 1000}', '{"id": 7, "x": 1}', "[7]"):
        assert constraint_problem("json", bad), bad
    words = [" red", " blue"]
    assert constraint_problem("allowed", " red blue red", words) is None
    assert constraint_problem("allowed", " red green", words) and constraint_problem("allowed", " redblue x", words)


# Its own server: the long streams must still be decoding when the shutdown timeout runs out on the fastest CPU
# (120 tokens, all the module server's context allows, took under 2 s on one CI machine), so they ask for 1 500.
SIGTERM_ARGS = ["--num-gpu-blocks-override", "256", "--max-model-len", "2048", "--max-num-seqs", "8",
                "--api-key", KEY, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT)]
SHORT_TOKENS, LONG_TOKENS = 4, 1500


def test_sigterm_in_flight_finish_or_end_visibly():
    """Short streams in flight finish; long ones end with a visible error, never a bare [DONE]."""
    server = RemoteServer(SIGTERM_ARGS)

    async def one(client, max_tokens, events):
        body = {"prompt": "Tell me a story.", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "temperature": 0}
        async with client.stream("POST", server.url("/v1/completions"), json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        return events

    async def scenario():
        async with httpx.AsyncClient(timeout=120, headers=AUTH) as client:
            streams = [[] for _ in range(4)]
            tasks = [asyncio.create_task(one(client, m, ev)) for m, ev in zip(lengths, streams)]
            # Signal once the long streams are decoding. The short ones may already be done by then (a 4-token
            # request can finish between two polls, so "4 running" may never be seen): they must end as
            # "length" either way.
            deadline = time.monotonic() + 60
            while not (streams[2] and streams[3]):
                assert time.monotonic() < deadline, f"the long streams never started: {streams}"
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            return results, time.monotonic() - t0

    lengths = (SHORT_TOKENS, SHORT_TOKENS, LONG_TOKENS, LONG_TOKENS)
    try:
        results, elapsed = asyncio.run(scenario())
        assert elapsed < SHUTDOWN_TIMEOUT + 10
        for events, max_tokens in zip(results, lengths):
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            objs = [json.loads(e) for e in events[:-1]]
            finished = [c["finish_reason"] for o in objs for c in o.get("choices", []) if c.get("finish_reason")]
            errors = [o["error"] for o in objs if "error" in o]
            if max_tokens == SHORT_TOKENS:
                assert finished == ["length"] and not errors  # in flight and short: finished
            else:
                # Cut by the shutdown: the client is told, never a bare [DONE].
                assert not finished and errors and "shutting down" in errors[0]["message"], objs[-3:]
        assert server.proc.wait(30) == 0, server.logs()[-3000:]
    finally:
        server.kill()
