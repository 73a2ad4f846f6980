"""The dashboard's data, without a browser: the block snapshot of a hand-built BlockManager state, and
the JSON / SSE routes of a real `pagedllm serve` process (auth, schema, agreement with the engine)."""
from __future__ import annotations

import json
import signal
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.kv_snapshot import build_kv_snapshot, capture_kv_state
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus


def _computed(bm: BlockManager, seq: Sequence, n_new: int) -> None:
    bm.allocate_slots(seq, n_new)
    seq.num_computed_tokens += n_new
    bm.cache_computed_blocks(seq)


def _hand_built_state():
    """Block size 4, 16 device / 8 CPU blocks, prefix caching:
    A: 10-token prompt, forked (n=2) -> 3 blocks with refcount 2;
    B: shares A's first 8 tokens through the prefix cache (2 blocks at refcount 3) + 3 own tokens;
    C: 6 tokens, swapped out to the CPU pool (its one full block stays cached-free on the device);
    D: 8 tokens, finished and freed (2 cached-free blocks)."""
    bm = BlockManager(block_size=4, num_gpu_blocks=16, num_cpu_blocks=8, enable_caching=True)
    a1 = Sequence(1, list(range(10)))
    _computed(bm, a1, 10)
    a2 = a1.fork(2)
    bm.fork(a1, a2)
    a = SequenceGroup("req-A", [a1, a2], None, 0.0)
    b1 = Sequence(3, list(range(8)) + [100, 101, 102])
    b1.num_computed_tokens = bm.allocate_cached_prefix(b1)
    assert b1.num_computed_tokens == 8
    _computed(bm, b1, 3)
    b = SequenceGroup("req-B", [b1], None, 1.0)
    c1 = Sequence(4, list(range(200, 206)))
    _computed(bm, c1, 6)
    c = SequenceGroup("req-C", [c1], None, 2.0)
    c_blocks = list(bm.block_tables[4])
    bm.swap_out(c)
    c1.status = SequenceStatus.SWAPPED
    d1 = Sequence(5, list(range(300, 308)))
    _computed(bm, d1, 8)
    d_blocks = list(bm.block_tables[5])
    bm.free(d1)
    for s in (a1, a2, b1):
        s.status = SequenceStatus.RUNNING
    bm.check_invariants()
    sched = SimpleNamespace(block_manager=bm, running=[a, b], waiting=[], swapped=[c])
    return bm, sched, c_blocks, d_blocks


def test_snapshot_of_hand_built_state():
    bm, sched, c_blocks, d_blocks = _hand_built_state()
    snap = build_kv_snapshot(capture_kv_state(sched))
    a_table, b_table = bm.block_tables[1], bm.block_tables[3]
    gpu, counts = snap["gpu"], snap["counts"]
    rc = gpu["ref_counts"]
    assert [rc[x] for x in a_table] == [3, 3, 2]
    assert rc[b_table[2]] == 1 and b_table[:2] == a_table[:2]
    assert gpu["owners"][str(a_table[0])] == ["req-A", "req-B"]
    assert gpu["owners"][str(a_table[2])] == ["req-A"]
    assert gpu["owners"][str(b_table[2])] == ["req-B"]
    assert [gpu["fill"][x] for x in a_table] == [4, 4, 2] and gpu["fill"][b_table[2]] == 3
    # C's full block and D's two blocks stay in the prefix cache; C's partial block is plain free.
    assert gpu["cached_free"] == sorted([c_blocks[0], *d_blocks])
    assert c_blocks[1] not in gpu["cached_free"] or c_blocks[1] in d_blocks
    assert counts == {
        "kv_blocks_total": 16, "kv_blocks_free": 12, "kv_blocks_free_uncached": 9, "kv_blocks_cached_free": 3,
        "kv_blocks_used": 1, "kv_blocks_shared": 3, "kv_blocks_saved_by_sharing": 5,
        "kv_slots_allocated": 16, "kv_slots_filled": 13, "kv_slots_empty_in_last_blocks": 3,
        "cpu_blocks_total": 8, "cpu_blocks_used": 2, "cpu_blocks_free": 6,
        "num_running": 2, "num_waiting": 0, "num_swapped": 1,
    }
    assert counts["kv_blocks_shared"] == bm.num_shared_blocks()
    assert counts["kv_blocks_saved_by_sharing"] == bm.num_blocks_saved_by_sharing()
    assert counts["kv_blocks_free"] == bm.get_num_free_gpu_blocks()
    assert counts["cpu_blocks_free"] == bm.get_num_free_cpu_blocks()
    cpu_table = bm.cpu_block_tables[4]
    assert snap["cpu"]["owners"] == {str(x): ["req-C"] for x in cpu_table}
    running = snap["queues"]["running"]
    assert [r["request_id"] for r in running] == ["req-A", "req-B"]
    assert [s["blocks"] for s in running[0]["seqs"]] == [a_table, a_table]
    swapped = snap["queues"]["swapped"][0]["seqs"][0]
    assert swapped["blocks"] == [] and swapped["cpu_blocks"] == cpu_table and swapped["status"] == "swapped"
    json.dumps(snap)  # JSON-ready


def test_capture_is_a_copy():
    bm, sched, _, _ = _hand_built_state()
    cap = capture_kv_state(sched)
    before = build_kv_snapshot(cap)
    for seq_id in (1, 2, 3):
        bm.free(SimpleNamespace(seq_id=seq_id))
    assert build_kv_snapshot(cap) == before  # later changes do not leak into a taken capture
    after = build_kv_snapshot(capture_kv_state(sched))
    assert after["counts"]["kv_blocks_used"] == after["counts"]["kv_blocks_shared"] == 0


def test_broadcaster_slows_down_on_large_pools():
    """Build + JSON of an 8k-block snapshot takes milliseconds: the stream stretches its interval so
    that this work stays under `max_duty` of the time (here 1 %: a build of over 0.5 ms, which any machine
    takes for 8k blocks, then stretches the interval past the nominal 0.05 s), instead of the nominal 0.05 s."""
    import asyncio

    pytest.importorskip("fastapi")
    from pagedllm.benchmarks.dashboard_overhead import _synthetic_scheduler
    from pagedllm.entrypoints.openai.dashboard import Dashboard, DashboardConfig

    class Engine:  # the AsyncLLMEngine surface the dashboard uses
        scheduler, num_steps, is_healthy = _synthetic_scheduler(8192), 0, True

        def stats(self):
            return {}

        async def call_between_steps(self, fn):
            return fn(self)

    async def three_snapshots():
        board = Dashboard(Engine(), config=DashboardConfig(events_interval_s=0.05, max_duty=0.01))
        stream = board.events()
        got = []
        async for message in stream:
            if message.startswith("event: snapshot"):
                got.append((time.monotonic(), json.loads(message.split("data: ", 1)[1])))
                if len(got) == 3:
                    break
        await stream.aclose()
        await board.stop()
        return got

    got = asyncio.run(three_snapshots())
    for (t0, s0), (t1, _) in zip(got, got[1:]):
        assert s0["counts"]["kv_blocks_total"] == 8192
        assert t1 - t0 >= 0.9 * s0["cost_ms"]["build"] / 1e3 / 0.01 > 0.05


# -- the routes, on a real server -----------------------------------------------------------------------
pytest.importorskip("fastapi")
from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer  # noqa: E402

KEY = "dash-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    # Dev mode also serves vLLM's POST /reset_prefix_cache (test_reset_prefix_cache_route_in_dev_mode).
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--enable-prefix-caching", "--api-key", KEY],
                       env={"VLLM_SERVER_DEV_MODE": "1"})
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


def _sse_events(server: RemoteServer, n: int) -> list[tuple[str, dict | list]]:
    events, name = [], None
    with httpx.stream("GET", server.url(f"/dashboard/events?api_key={KEY}"), timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
                if len(events) >= n:
                    return events
    return events


@pytest.mark.parametrize("path", ["/dashboard/snapshot", "/dashboard/events"])
def test_data_routes_need_the_api_key(server, path):
    for kw in ({}, {"headers": {"Authorization": "Bearer wrong"}}, {"params": {"api_key": "wrong"}}):
        r = httpx.get(server.url(path), timeout=10, **kw)
        assert r.status_code == 401, kw
        assert r.json()["error"]["code"] == "invalid_api_key"
    page = httpx.get(server.url("/dashboard"), timeout=10)  # the page holds no data; it asks for the key
    assert page.status_code == 200 and "dashboard.js" in page.text
    js = httpx.get(server.url("/dashboard/static/dashboard.js"), timeout=10)
    assert js.status_code == 200 and "EventSource" in js.text
    assert httpx.get(server.url("/dashboard/static/nope.js"), timeout=10).status_code == 404


def test_snapshot_json_agrees_with_engine_while_sharing_and_after(server):
    # The prompt fills more than one 16-token block: its full blocks stay shared by the 4 samples for the
    # whole request. (A prompt shorter than a block is shared only until the first decode step's
    # copy-on-write, a window of one step that a poll can miss.)
    prompt = ("The three primary colors are red, yellow and blue. In painting, mixing two of them gives a "
              "secondary color, and the three secondary colors are")
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 40, "n": 4,
            "temperature": 0.9, "seed": 3, "ignore_eos": True}
    done: list[int] = []
    t = threading.Thread(target=lambda: done.append(
        httpx.post(server.url("/v1/completions"), json=body, headers=AUTH, timeout=120).status_code))
    t.start()
    seen_shared = False
    try:
        for _ in range(400):
            snap = httpx.get(server.url("/dashboard/snapshot"), headers=AUTH, timeout=10).json()
            c, st = snap["counts"], snap["stats"]
            for key in ("kv_blocks_total", "kv_blocks_free", "kv_blocks_shared", "kv_blocks_saved_by_sharing",
                        "kv_slots_allocated", "kv_slots_filled", "num_running", "num_waiting", "num_swapped"):
                assert c[key] == st[key], key
            if c["kv_blocks_shared"] > 0:
                seen_shared = True
                req = snap["queues"]["running"][0]
                assert len(req["seqs"]) == 4 and req["request_id"].startswith("cmpl-")
                first = req["seqs"][0]["blocks"][0]
                assert snap["gpu"]["ref_counts"][first] == 4
                assert snap["gpu"]["owners"][str(first)] == [req["request_id"]]
            if not t.is_alive():
                break
    finally:
        t.join(120)
    assert done == [200] and seen_shared
    server.wait_idle()
    snap = httpx.get(server.url("/dashboard/snapshot"), params={"api_key": KEY}, timeout=10).json()
    assert snap["counts"]["kv_blocks_free"] == snap["counts"]["kv_blocks_total"] == snap["gpu"]["num_blocks"]
    assert snap["queues"] == {"running": [], "waiting": [], "swapped": []}
    metrics = server.metrics()
    assert metrics["pagedllm:kv_blocks_free"] == snap["counts"]["kv_blocks_free"]


def test_events_stream_history_then_snapshots(server):
    events = _sse_events(server, 4)
    assert [name for name, _ in events] == ["history", "snapshot", "snapshot", "snapshot"]
    history = events[0][1]
    assert history and {"t", "kv_usage", "generation_tokens_per_s", "prefix_cache_hit_rate"} <= set(history[-1])
    ids = [data["snapshot_id"] for _, data in events[1:]]
    assert ids == sorted(ids) and len(set(ids)) == 3
    times = [data["time"] for _, data in events[1:]]
    assert 0.1 < (times[-1] - times[0]) / 2 < 1.0  # ~4 Hz


def test_reset_prefix_cache_route_in_dev_mode(server):
    """VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache (behind the API key) drops every cached prefix when no
    request holds blocks (200: a repeated prompt then hits nothing), answers 409 while one does, 400 for
    reset_running_requests=true. Without dev mode the route does not exist (test_server_openai)."""
    url = server.url("/reset_prefix_cache")
    assert httpx.post(url, timeout=30).status_code == 401
    prompt = ("A cache keeps what was computed so that it need not be computed again. A prefix cache keeps the "
              "keys and values of a prompt's leading blocks, and a later prompt that starts the same way reuses")
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0}

    def hits_of_one_request() -> float:
        before = server.metrics()["vllm:prefix_cache_hits_total"]
        assert httpx.post(server.url("/v1/completions"), json=body, headers=AUTH, timeout=60).status_code == 200
        return server.metrics()["vllm:prefix_cache_hits_total"] - before

    hits_of_one_request()
    assert hits_of_one_request() >= 16  # at least one 16-token block reused
    server.wait_idle()
    assert httpx.post(url, headers=AUTH, timeout=30).status_code == 200
    assert hits_of_one_request() == 0
    r = httpx.post(url, params={"reset_running_requests": "true"}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reset_running_requests"
    long_body = {**body, "max_tokens": 200, "ignore_eos": True}
    with httpx.stream("POST", server.url("/v1/completions"), json={**long_body, "stream": True}, headers=AUTH,
                      timeout=120) as stream:
        lines = stream.iter_lines()
        while not next(lines).startswith("data: "):  # the request runs and holds blocks
            pass
        r = httpx.post(url, headers=AUTH, timeout=30)
        assert r.status_code == 409 and "Prefix cache reset failed" in r.json()["error"]["message"]
    server.wait_idle()  # the closed stream aborted the request and freed its blocks
    assert hits_of_one_request() > 0  # the refused reset dropped nothing


def test_no_dashboard_flag_removes_the_routes():
    from pagedllm.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "--no-dashboard"])
    assert args.no_dashboard is True
    from pagedllm.entrypoints.openai.server import build_app

    from pagedllm.entrypoints.openai.limits import RequestLimits

    ctx = SimpleNamespace(engine=None, limits=RequestLimits())
    paths = {r.path for r in build_app(ctx, metrics=None, dashboard=False).routes}
    assert "/v1/completions" in paths and not any(p.startswith("/dashboard") for p in paths)
    paths = {r.path for r in build_app(ctx, metrics=None).routes}
    assert {"/dashboard", "/dashboard/snapshot", "/dashboard/events"} <= paths
