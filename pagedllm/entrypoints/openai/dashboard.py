"""The live KV-cache dashboard: `GET /dashboard` (page), `/dashboard/snapshot` (JSON), `/dashboard/events` (SSE).

A snapshot is captured on the engine thread between two steps (`AsyncLLMEngine.call_between_steps`
copies refcounts and block tables: O(blocks + sequences)) and built into JSON here, on the event
loop. One broadcaster takes ~4 snapshots a second while at least one `/dashboard/events` client is
connected (fewer on pools so large that this would cost over 2 % of the time) and nothing
otherwise; a 1 Hz history of the engine's published counters (tokens/s, KV usage, fragmentation,
saved by sharing, preemptions, prefix-cache hit rate) feeds the charts.

With `--api-key`, the data routes need the key like /v1/*: `Authorization: Bearer KEY`, or
`?api_key=KEY` (EventSource cannot send headers). The page itself holds no data; it reads the key
from its own URL (`/dashboard?api_key=KEY`) or asks for it.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from pagedllm.core.kv_snapshot import KVCapture, build_kv_snapshot, capture_kv_state
from pagedllm.entrypoints.openai.serving_common import OpenAIError

logger = logging.getLogger("pagedllm.dashboard")

_STATIC = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}


@dataclass
class DashboardConfig:
    events_interval_s: float = 0.25  # ~4 Hz
    # Building + serializing a snapshot runs in the server process (holding the GIL): on large pools
    # (~16k+ blocks, tens of ms each) the broadcaster slows down so that it stays under this share.
    max_duty: float = 0.02
    history_interval_s: float = 1.0
    history_len: int = 600  # ten minutes of 1 s points
    call_timeout_s: float = 10.0


def _capture(engine) -> tuple[KVCapture, dict[str, Any], float]:
    """Runs on the engine thread: the raw copy, the engine's own counters of the same instant, and
    the seconds this took (the time the step loop was held up)."""
    t0 = time.perf_counter()
    cap, stats = capture_kv_state(engine.scheduler), engine.stats()
    return cap, stats, time.perf_counter() - t0


def history_point(stats: dict[str, Any], prev: dict[str, Any] | None, now: float) -> dict[str, Any]:
    """One chart sample from the engine's published counters (rates against the previous sample)."""
    total = stats.get("kv_blocks_total") or 1
    queries = stats.get("prefix_cache_queries", 0)
    point = {
        "t": now,
        "kv_usage": 100.0 * (total - stats.get("kv_blocks_free", total)) / total,
        "fragmentation_slots": stats.get("kv_slots_allocated", 0) - stats.get("kv_slots_filled", 0),
        "blocks_saved_by_sharing": stats.get("kv_blocks_saved_by_sharing", 0),
        "num_preemptions": stats.get("num_preemptions", 0),
        "prefix_cache_hit_rate": 100.0 * stats.get("prefix_cache_hits", 0) / queries if queries else 0.0,
        "generation_tokens_total": stats.get("generation_tokens_total", 0),
        "prompt_tokens_total": stats.get("prompt_tokens_total", 0),
        "generation_tokens_per_s": 0.0,
        "prompt_tokens_per_s": 0.0,
    }
    if prev is not None and now > prev["t"]:
        dt = now - prev["t"]
        point["generation_tokens_per_s"] = (point["generation_tokens_total"] - prev["generation_tokens_total"]) / dt
        point["prompt_tokens_per_s"] = (point["prompt_tokens_total"] - prev["prompt_tokens_total"]) / dt
    return point


@dataclass
class Dashboard:
    """Per-app dashboard state: the chart history, the snapshot broadcaster and its subscribers."""

    engine: Any  # AsyncEngineFront
    api_key: str | None = None
    config: DashboardConfig = field(default_factory=DashboardConfig)
    history: deque = field(init=False)
    _subscribers: set[asyncio.Queue] = field(init=False, default_factory=set)
    _broadcaster: asyncio.Task | None = field(init=False, default=None)
    _sampler: asyncio.Task | None = field(init=False, default=None)
    _snapshot_id: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.history = deque(maxlen=self.config.history_len)

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the 1 Hz history sampler (reads the engine's published stats; never the engine)."""
        if self._sampler is None:
            self._sampler = asyncio.ensure_future(self._sample_history())

    async def stop(self) -> None:
        for task in (self._sampler, self._broadcaster):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._sampler = self._broadcaster = None
        for q in list(self._subscribers):
            q.put_nowait(None)

    async def _sample_history(self) -> None:
        while True:
            prev = self.history[-1] if self.history else None
            self.history.append(history_point(self.engine.stats(), prev, time.time()))
            await asyncio.sleep(self.config.history_interval_s)

    # -- snapshots --------------------------------------------------------------------------------
    async def snapshot(self) -> dict[str, Any]:
        """A consistent snapshot: captured between two steps, built here (off the engine thread)."""
        try:
            cap, stats, capture_s = await asyncio.wait_for(self.engine.call_between_steps(_capture),
                                                           self.config.call_timeout_s)
        except asyncio.TimeoutError:
            raise OpenAIError("the engine did not answer in time", code="engine_unavailable", status=503,
                              type="server_error") from None
        except Exception as e:  # EngineDeadError and the like
            raise OpenAIError(f"the engine is not available: {e}", code="engine_unavailable", status=503,
                              type="server_error") from None
        t0 = time.perf_counter()
        snap = build_kv_snapshot(cap)
        build_s = time.perf_counter() - t0
        self._snapshot_id += 1
        snap.update(snapshot_id=self._snapshot_id, time=time.time(), num_steps=self.engine.num_steps, stats=stats,
                    history_point=self.history[-1] if self.history else None,
                    cost_ms={"capture": 1e3 * capture_s, "build": 1e3 * build_s})
        return snap

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(maxsize=2)
        self._subscribers.add(q)
        if self._broadcaster is None or self._broadcaster.done():
            self._broadcaster = asyncio.ensure_future(self._broadcast())
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self._subscribers.discard(q)

    async def _broadcast(self) -> None:
        """While anyone listens: one snapshot per interval, serialized once, sent to every subscriber.

        The interval stretches to keep the work under `max_duty` of the time (large pools)."""
        while self._subscribers:
            started, cost = time.monotonic(), 0.0
            try:
                snap = await self.snapshot()
                t0 = time.perf_counter()
                message = f"event: snapshot\ndata: {json.dumps(snap, separators=(',', ':'))}\n\n"
                cost = time.perf_counter() - t0 + snap["cost_ms"]["build"] / 1e3  # synchronous work here
            except OpenAIError as e:
                message = f"event: failure\ndata: {json.dumps(e.body())}\n\n"
            for q in list(self._subscribers):
                if q.full():  # a slow client skips frames rather than piling them up
                    with contextlib.suppress(asyncio.QueueEmpty):
                        q.get_nowait()
                q.put_nowait(message)
            interval = max(self.config.events_interval_s, cost / self.config.max_duty)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def events(self) -> AsyncIterator[str]:
        """The SSE stream of one client: the chart history first, then a snapshot per interval.

        Ends when the engine stops (server shutdown), so an open page never holds the server up."""
        q = self.subscribe()
        try:
            history = json.dumps(list(self.history), separators=(",", ":"))
            yield f"retry: 2000\nevent: history\ndata: {history}\n\n"
            while True:
                try:
                    message = await asyncio.wait_for(q.get(), timeout=15.0)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                if message is None:
                    return
                yield message
                if not self.engine.is_healthy:
                    return
        finally:
            self.unsubscribe(q)

    # -- auth ---------------------------------------------------------------------------------------
    def check_key(self, request: Request) -> None:
        """Same key as /v1/*: the Authorization header, or ?api_key= for EventSource / the browser."""
        if not self.api_key:
            return
        auth = request.headers.get("authorization", "")
        given = auth[len("Bearer "):] if auth.startswith("Bearer ") else request.query_params.get("api_key", "")
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise OpenAIError("Incorrect or missing API key; send 'Authorization: Bearer <key>' or ?api_key=<key>.",
                              code="invalid_api_key", status=401)


def _static(name: str) -> bytes:
    return resources.files("pagedllm.entrypoints.openai").joinpath("static", name).read_bytes()


def register_dashboard(app: FastAPI, engine: Any, api_key: str | None = None) -> Dashboard:
    """Add the dashboard routes to `app`; call `start()`/`stop()` on the result from the app's lifespan."""
    board = Dashboard(engine, api_key)
    files = {name: _static(name) for name in _STATIC}

    @app.get("/dashboard")
    async def dashboard_page() -> Response:
        return Response(files["dashboard.html"], media_type=_STATIC["dashboard.html"],
                        headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{name}")
    async def dashboard_static(name: str) -> Response:
        if name not in files or name == "dashboard.html":
            raise OpenAIError(f"no dashboard file {name!r}; there are {sorted(n for n in files if n != 'dashboard.html')}",
                              code="not_found", status=404)
        return Response(files[name], media_type=_STATIC[name], headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/snapshot")
    async def dashboard_snapshot(request: Request) -> Response:
        board.check_key(request)
        snap = await board.snapshot()
        return Response(json.dumps(snap, separators=(",", ":")), media_type="application/json")

    @app.get("/dashboard/events")
    async def dashboard_events(request: Request) -> Response:
        board.check_key(request)
        return StreamingResponse(board.events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return board
