"""API-key authentication and the request-body size limit, as plain ASGI middleware plus a
FastAPI dependency (for routes added later). The dashboard checks the same key itself, since a
browser's EventSource can only send it as ?api_key=."""
from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagedllm.entrypoints.openai.serving_common import OpenAIError

#: Routes that serve or reveal the model. /health, /version, /docs and /openapi.json stay open
#: (as in vLLM, whose key guards /v1 only); /metrics is open unless `protect_metrics`.
PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info", "/reset_prefix_cache", "/invocations",
                      "/pooling", "/classify", "/score", "/rerank", "/v2/rerank", "/sleep", "/wake_up", "/is_sleeping",
                      "/start_profile", "/stop_profile")
#: A body above the limit is read and dropped up to this many bytes (so the client, which is
#: still sending, gets the 413 instead of a reset connection); beyond it the connection is closed.
_DRAIN_LIMIT = 64 * 1024 * 1024


def _unauthorized() -> OpenAIError:
    return OpenAIError("Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
                       code="invalid_api_key", status=401)


@dataclass(frozen=True)
class ApiKeyAuth:
    """Checks `Authorization: Bearer <key>` in constant time. `root_path` (--root-path): a request the proxy passed
    with the prefix still on (``/api/v1/models``) reaches ``/v1/models`` (FastAPI strips the root path when routing),
    so the key is checked on the path without it."""

    api_key: str
    protect_metrics: bool = False
    root_path: str = ""

    def protects(self, path: str) -> bool:
        root = self.root_path
        if root and (path == root or path.startswith(root + "/")):
            path = path[len(root):] or "/"
        if self.protect_metrics and (path == "/metrics" or path.startswith("/metrics/")):
            return True
        return any(path == p or path.startswith(p + "/") for p in PROTECTED_PREFIXES)

    def authorized(self, header: bytes | None) -> bool:
        expected = b"Bearer " + self.api_key.encode("utf-8")
        return hmac.compare_digest(header or b"", expected)

    async def dependency(self, request: Request) -> None:
        """FastAPI dependency: `Depends(auth.dependency)` on a route guards it with the key."""
        raw = request.headers.get("authorization")
        if not self.authorized(None if raw is None else raw.encode("latin-1")):
            raise _unauthorized()


class ApiKeyMiddleware:
    """Refuses unauthenticated requests to protected paths before their body is read."""

    def __init__(self, app, auth: ApiKeyAuth) -> None:
        self.app, self.auth = app, auth

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS" and self.auth.protects(scope["path"]):
            header = dict(scope.get("headers") or []).get(b"authorization")
            if not self.auth.authorized(header):
                err = _unauthorized()
                await JSONResponse(err.body(), status_code=err.status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _too_large(limit: int) -> OpenAIError:
    return OpenAIError(f"the request body is larger than {limit} bytes (--max-request-body-bytes).",
                       code="request_too_large", status=413)


class BodySizeLimitMiddleware:
    """413 for bodies above `max_bytes`, decided from Content-Length or while streaming, never
    after buffering the whole body."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        declared = int(length) if length is not None and length.isdigit() else None
        if declared is not None and declared > self.max_bytes:
            await _drain(receive, declared)
            err = _too_large(self.max_bytes)
            await JSONResponse(err.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)
            return
        received = 0
        limit = self.max_bytes

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    if message.get("more_body", False):
                        await _drain(receive, _DRAIN_LIMIT)
                    # FastAPI re-raises HTTPException from the body read; the app's handler shapes it.
                    raise HTTPException(413, detail=_too_large(limit).message)
            return message

        await self.app(scope, limited_receive, send)


async def _drain(receive, declared: int) -> None:
    if declared > _DRAIN_LIMIT:
        return
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
