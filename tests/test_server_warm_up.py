"""The server's warm-up request (entrypoints/openai/warm_up.py) goes through a real ASGI app: every
middleware, the route's body, a streamed response; it fails loudly when the app cannot serve."""
import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from pagedllm.entrypoints.openai.warm_up import WARM_UP_PROMPT, warm_up_request  # noqa: E402


def _app(seen: list, fail: bool = False) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = json.loads(await request.body())
        seen.append((body, request.headers.get("authorization")))
        if fail:
            return JSONResponse({"error": {"message": "engine down"}}, status_code=503)

        async def events():
            yield 'data: {"choices": [{"text": "x"}]}\n\n'
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return app


def test_warm_up_streams_one_completion_through_the_app_with_the_key():
    seen: list = []
    seconds = asyncio.run(warm_up_request(_app(seen), "m", api_key="k1", max_tokens=2))
    assert seconds > 0
    (body, auth), = seen
    assert body["model"] == "m" and body["prompt"] == WARM_UP_PROMPT and body["stream"] is True
    assert body["max_tokens"] == 2 and auth == "Bearer k1"


def test_warm_up_raises_when_the_app_cannot_serve():
    with pytest.raises(RuntimeError, match="warm-up request failed.*503"):
        asyncio.run(warm_up_request(_app([], fail=True), "m"))
