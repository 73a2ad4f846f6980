"""HTTP headers vLLM's server sets: X-Request-Id on responses (--enable-request-id-headers) and CORS.

Plain ASGI middleware, as security.py's: the streamed hot path never goes through a per-request wrapper object.
"""
from __future__ import annotations

import re
import uuid
from typing import Sequence

from starlette.middleware.cors import CORSMiddleware

#: What a client's X-Request-Id may hold: it names the response and the engine's requests (and their log lines).
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
REQUEST_ID_RULE = "1-128 characters of letters, digits, '.', '_', ':' or '-'"


def client_request_id(value: str | None) -> str | None:
    """A client's X-Request-Id, checked (None when absent); a ValueError says what is allowed."""
    if value is None:
        return None
    if not REQUEST_ID_PATTERN.fullmatch(value):
        raise ValueError(f"X-Request-Id must be {REQUEST_ID_RULE}; got {value[:40]!r}.")
    return value


class RequestIdHeaderMiddleware:
    """Every HTTP response carries X-Request-Id: the client's own (when it sent one) or a fresh random id."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = next((v for k, v in scope["headers"] if k == b"x-request-id"), None) or uuid.uuid4().hex.encode()

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def add_cors(app, allowed_origins: Sequence[str], allowed_methods: Sequence[str], allowed_headers: Sequence[str],
             allow_credentials: bool) -> None:
    """vLLM's CORS settings (--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials; every
    origin, method and header by default). Added last, so outermost: a browser's preflight is answered before the
    API key is asked for."""
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                       allow_headers=list(allowed_headers), allow_credentials=allow_credentials)
