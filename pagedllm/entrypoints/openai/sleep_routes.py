"""vLLM's sleep-mode development routes (served with VLLM_SERVER_DEV_MODE=1, as in vLLM):

    POST /sleep?level=1&mode=abort     free the engine's memory (engine/sleep_mode.py); 200 once asleep
    POST /wake_up[?tags=weights&tags=kv_cache]   bring back what sleep freed (every part without tags); 200
    GET  /is_sleeping                  {"is_sleeping": bool}

While asleep, generation requests get 503 (code "engine_sleeping"); requests in flight at /sleep end with that
503 (mode "abort", vLLM's default) or finish first (mode "wait"). An engine built without --enable-sleep-mode
answers /sleep with 400 naming the flag.
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_engine import AsyncEngineFront
from pagedllm.entrypoints.openai.serving_common import error_from_exception

logger = logging.getLogger("pagedllm.server")


def register_sleep_routes(app: FastAPI, engine: AsyncEngineFront) -> None:
    @app.post("/sleep")
    async def sleep(level: int = 1, mode: str = "abort") -> Response:
        logger.info("sleep the engine with level %d (mode %s)", level, mode)
        try:
            await engine.sleep(level, mode)
        except (ValueError, TypeError) as e:
            raise error_from_exception(e) from None
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(default=None)) -> Response:
        logger.info("wake up the engine with tags %s", tags)
        try:
            await engine.wake_up(tags or None)
        except (ValueError, TypeError) as e:
            raise error_from_exception(e) from None
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})
