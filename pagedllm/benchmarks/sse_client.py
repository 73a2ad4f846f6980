"""The load generator's HTTP client: OpenAI streamed completions read with aiohttp.

A serving benchmark must measure the server, not its client. At ~70 concurrent streams and a few
thousand SSE events a second, httpx (pure-Python parsing) kept the benchmark process's one core busy
and delayed the events it timed; aiohttp parses HTTP in C (vLLM's serving benchmark uses it too), and
uvloop runs the client's event loop where it is installed.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

T = TypeVar("T")


class HTTPStatusError(RuntimeError):
    """The server answered a status other than 200."""


def new_session(max_connections: int | None = None, force_close: bool = False):
    """An aiohttp session without a total timeout (streams run as long as generation takes).

    `force_close`: one connection per request, as independent clients would open."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=max_connections or 0, force_close=force_close)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


async def stream_events(session, url: str, body: dict[str, Any],
                        headers: dict[str, str] | None = None) -> AsyncIterator[dict[str, Any]]:
    """POST `body` and yield each SSE event's JSON payload until `[DONE]`; an error event raises."""
    async with session.post(url, json=body, headers=headers) as r:
        if r.status != 200:
            raise HTTPStatusError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            if not raw.startswith(b"data: "):
                continue
            data = raw[6:].strip()
            if data == b"[DONE]":
                return
            payload = json.loads(data)
            if "error" in payload:
                raise RuntimeError(f"stream error: {payload['error']}")
            yield payload


async def post_json(session, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> dict:
    async with session.post(url, json=body, headers=headers) as r:
        if r.status != 200:
            raise HTTPStatusError(f"HTTP {r.status}: {(await r.text())[:300]}")
        return await r.json()


async def get_json(session, url: str, headers: dict[str, str] | None = None) -> dict:
    async with session.get(url, headers=headers) as r:
        return await r.json()


def run(main: Callable[[], Awaitable[T]]) -> T:
    """Run the client's coroutine on uvloop where installed, else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())
