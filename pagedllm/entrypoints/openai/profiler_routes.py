"""vLLM's torch profiler routes, served only when the profiler is on (VLLM_TORCH_PROFILER_DIR set, or --profiler-config
with torch_profiler_dir), as in vLLM; otherwise they do not exist (404):

    POST /start_profile   start torch.profiler in the engine's workers; 200 (a second start while one runs: ignored)
    POST /stop_profile    stop it; 200 once every worker wrote its *.pt.trace.json.gz; 409 when none is running
"""
from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.responses import Response

from pagedllm.engine.async_engine import AsyncEngineFront
from pagedllm.entrypoints.openai.serving_common import OpenAIError
from pagedllm.worker.profiler import ProfilerError

logger = logging.getLogger("pagedllm.server")


def register_profiler_routes(app: FastAPI, engine: AsyncEngineFront) -> None:
    async def run(call, doing: str, done: str) -> Response:
        logger.info("%s profiler...", doing)
        try:
            await call()
        except ProfilerError as e:
            raise OpenAIError(str(e), code="conflict", status=409) from None
        logger.info("Profiler %s.", done)
        return Response(status_code=200)

    @app.post("/start_profile")
    async def start_profile() -> Response:
        return await run(engine.start_profile, "Starting", "started")

    @app.post("/stop_profile")
    async def stop_profile() -> Response:
        return await run(engine.stop_profile, "Stopping", "stopped")
