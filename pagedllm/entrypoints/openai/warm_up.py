"""Warm the serving path before the server accepts connections.

The engine's warm start (graphs, Triton variants, one step of each kind, the sampler) runs on the main
thread inside `LLM`/`AsyncLLMEngine` construction. A fresh server's first request still paid for what that
does not cover: the first step on the engine thread, the event loop's first tokenize / detokenize, FastAPI's
first validation and routing, the first streaming response. `warm_up_request` sends one short streamed
completion through the ASGI app itself (every middleware, the route, the engine, SSE) during lifespan
startup, i.e. before uvicorn binds its socket, so no client request and no `/health` probe ever sees it.
The prompt is shorter than one KV block, so nothing of it stays in the prefix cache. It is not a client's
request, so it stays out of the request log (--enable-log-requests; request_logger.unlogged).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from pagedllm.entrypoints.openai.request_logger import unlogged

logger = logging.getLogger("pagedllm.server")

WARM_UP_PROMPT = "Hello"


async def warm_up_request(app: Any, model: str, api_key: str | None = None, max_tokens: int = 2,
                          pooling: bool = False, classify: bool = False, engine: Any = None,
                          metrics: Any = None, token_classify: bool = False) -> float:
    """Run one streamed /v1/completions request (`pooling`: one /v1/embeddings request; with `classify`, a
    classification model's: one /classify request; with `token_classify`, a token classifier's: one /pooling
    request) through `app` in-process; return its seconds. It is left out
    of the request log, and with the server's `engine` and `metrics` (EngineMetrics) out of /metrics too: the
    engine's observer (per-request counts and latencies) is detached while it runs, and the engine's counters
    (tokens, steps) are counted from after it.

    Raises RuntimeError when the request does not end in a 200 with a `[DONE]` event (an embedding: with its
    vector; a classification: with its probabilities) (the server would not serve requests either, so it must
    not report ready)."""
    path = ("/classify" if classify else "/pooling" if token_classify else "/v1/embeddings") if pooling else \
        "/v1/completions"
    expected = (b'"probs"' if classify else b'"pooling"' if token_classify else b'"embedding"') if pooling else \
        b"[DONE]"
    if pooling:
        body = json.dumps({"model": model, "input": WARM_UP_PROMPT}).encode()
    else:
        body = json.dumps({"model": model, "prompt": WARM_UP_PROMPT, "max_tokens": max_tokens,
                           "stream": True, "ignore_eos": True, "temperature": 0.0}).encode()
    headers = [(b"host", b"warm-up"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if api_key:
        headers.append((b"authorization", b"Bearer " + api_key.encode("utf-8")))
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "root_path": "", "query_string": b"", "headers": headers, "client": ("127.0.0.1", 0),
             "server": ("127.0.0.1", 0), "state": {}}
    sent = False
    status: list[int] = []
    chunks: list[bytes] = []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        # The request is over once the response is complete; until then the disconnect watcher waits here.
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    observer = getattr(engine, "observer", None)
    before = dict(engine.stats()) if engine is not None else {}
    if engine is not None:
        engine.observer = None
    t0 = time.perf_counter()
    try:
        with unlogged():
            await app(scope, receive, send)
    finally:
        if engine is not None:
            engine.observer = observer
    seconds = time.perf_counter() - t0
    if metrics is not None and engine is not None:
        # The engine loop publishes its stats before it delivers a finished request's output: these include it.
        metrics.leave_out(before, engine.stats())
    text = b"".join(chunks)
    if status != [200] or expected not in text:
        raise RuntimeError(f"the warm-up request failed (status {status}): {text[:300]!r}")
    logger.info("warm-up request through the serving path: %.1f ms", seconds * 1e3)
    return seconds

