"""The FastAPI app: OpenAI routes, /health, /metrics, tokenize, auth, and OpenAI-shaped errors."""
from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Awaitable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedllm
from pagedllm.engine.metrics import CONTENT_TYPE, EngineMetrics
from pagedllm.engine.stats_logger import LoggingStatLogger
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    dump,
)
from pagedllm.entrypoints.openai.headers import RequestIdHeaderMiddleware, add_cors
from pagedllm.entrypoints.openai.request_errors import validation_error
from pagedllm.entrypoints.openai.security import ApiKeyAuth, ApiKeyMiddleware, BodySizeLimitMiddleware
from pagedllm.entrypoints.openai.server_ops import ServerLoad, ServerLoadMiddleware, add_middlewares, tokenizer_info
from pagedllm.entrypoints.openai.dashboard import register_dashboard
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat, render_messages
from pagedllm.entrypoints.openai.serving_common import OpenAIError, ServingContext, log_error_traceback
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_classification import OpenAIServingClassification
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_pooling import OpenAIServingPooling
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScore
from pagedllm.entrypoints.openai.serving_lora import (
    LoadLoRAAdapterRequest,
    OpenAIServingLoRA,
    UnloadLoRAAdapterRequest,
    runtime_lora_updating_allowed,
)
from pagedllm.entrypoints.openai.protocol_classification import ClassificationRequest
from pagedllm.entrypoints.openai.protocol_embeddings import EmbeddingRequest
from pagedllm.entrypoints.openai.protocol_pooling import PoolingRequest
from pagedllm.entrypoints.openai.protocol_score import RerankRequest, ScoreRequest
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses, ResponseStore
from pagedllm.entrypoints.openai.profiler_routes import register_profiler_routes
from pagedllm.entrypoints.openai.sleep_routes import register_sleep_routes
from pagedllm.entrypoints.openai.warm_up import warm_up_request

logger = logging.getLogger("pagedllm.server")

def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[Any]) -> tuple[bool, Any]:
    """Run `work` but cancel it (aborting its requests) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        return False, None
    return True, task.result()


class GracefulServer(uvicorn.Server):
    """On shutdown, in-flight requests get `grace` seconds, then end with an error event (never a hang)."""

    def __init__(self, config: uvicorn.Config, engine, grace: float) -> None:
        super().__init__(config)
        self.engine, self.grace = engine, grace

    async def shutdown(self, sockets=None) -> None:
        n = self.engine.num_in_flight
        if n:
            logger.info("shutting down: %d request(s) in flight get %.1f s to finish", n, self.grace)
        handle = asyncio.get_running_loop().call_later(self.grace, self._abort_rest)
        try:
            await super().shutdown(sockets)
        finally:
            handle.cancel()

    def _abort_rest(self) -> None:
        n = self.engine.abort_all("the server is shutting down")
        if n:
            logger.info("aborted %d request(s) still running at shutdown", n)


#: /invocations reads its body itself (its fields choose the request model); its schema, for clients and fuzzers.
_INVOCATIONS_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"oneOf": [
    {"$ref": f"#/components/schemas/{name}"} for name in ("ChatCompletionRequest", "CompletionRequest",
                                                          "ResponsesRequest", "EmbeddingRequest")]}}}}}

# vLLM's switch for its development routes (here: POST /reset_prefix_cache, and sleep mode's POST /sleep,
# POST /wake_up, GET /is_sleeping).
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


@dataclass(frozen=True)
class HttpOptions:
    """vLLM's HTTP flags: --enable-request-id-headers, the CORS settings (headers.py), --root-path (FastAPI's
    root_path, behind a proxy that routes a path prefix to this server) and --disable-fastapi-docs (no /docs,
    /redoc, /openapi.json); and the operational ones (server_ops.py): --enable-server-load-tracking (GET /load
    counts the requests in flight), --enable-tokenizer-info-endpoint (GET /tokenizer_info) and --middleware (the
    imported classes and async functions, added outermost, in order)."""

    enable_request_id_headers: bool = False
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""
    disable_fastapi_docs: bool = False
    enable_server_load_tracking: bool = False
    enable_tokenizer_info_endpoint: bool = False
    middleware: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"root_path must start with '/' and not end with one (e.g. '/api'), got "
                             f"{self.root_path!r}.")


def build_app(ctx: ServingContext, metrics: EngineMetrics, api_key: str | None = None,
              protect_metrics: bool = False, dashboard: bool = True, warm_up: bool = True,
              dev_mode: bool = False, http: HttpOptions = HttpOptions(), responses_store: bool = False,
              enable_lora: bool = False, log_stats_interval_s: float | None = None,
              profiler: bool = False) -> FastAPI:
    """`warm_up`: one short streamed completion through the whole app before the server binds (warm_up.py).
    `dev_mode` (``VLLM_SERVER_DEV_MODE=1``): also serve vLLM's development routes ``POST /reset_prefix_cache`` and
    sleep mode's ``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping`` (sleep_routes.py).
    `http`: response headers and CORS (HttpOptions). `responses_store`: keep /v1/responses results in memory
    (--enable-responses-api-store). `enable_lora`: the engine serves LoRA adapters (the runtime LoRA routes need
    it, and VLLM_ALLOW_RUNTIME_LORA_UPDATING). `log_stats_interval_s`: log vLLM's stats line this often once the
    server is up (None: never; engine/stats_logger.py). `profiler`: the engine's torch profiler is on
    (VLLM_TORCH_PROFILER_DIR): serve vLLM's ``POST /start_profile`` and ``POST /stop_profile`` (profiler_routes.py)."""
    completion = OpenAIServingCompletion(ctx)
    chat = OpenAIServingChat(ctx)
    responses = OpenAIServingResponses(ctx, ResponseStore() if responses_store else None)
    embedding = OpenAIServingEmbedding(ctx)
    scoring = OpenAIServingScore(ctx)
    classification = OpenAIServingClassification(ctx)
    pooling = OpenAIServingPooling(ctx)
    board = None  # the live KV-cache dashboard (set below unless turned off)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.engine.start()
        logger.info("engine loop started")
        if warm_up:
            await warm_up_request(app, ctx.served_model_names[0], api_key, pooling=ctx.runner == "pooling",
                                  classify=ctx.engine.request_checker.pooling_task == "classify",
                                  token_classify=ctx.engine.request_checker.pooling_task == "token_classify",
                                  engine=ctx.engine, metrics=metrics)
        if board is not None:
            board.start()
        stats = None  # after the warm-up: its tokens are not the clients'
        if log_stats_interval_s is not None:
            stats = asyncio.create_task(LoggingStatLogger(ctx.engine.stats).run(log_stats_interval_s))
        try:
            yield
        finally:
            logger.info("shutting down: aborting %d in-flight request(s)", ctx.engine.num_in_flight)
            if stats is not None:
                stats.cancel()
            if board is not None:
                await board.stop()
            await ctx.engine.shutdown()

    docs = {"openapi_url": None, "docs_url": None, "redoc_url": None} if http.disable_fastapi_docs else {}
    app = FastAPI(title="pagedllm OpenAI-compatible server", version=pagedllm.__version__, lifespan=lifespan, **docs)
    # As vLLM sets it (the constructor's root_path argument is deprecated): FastAPI routes the path with or without
    # the prefix, and /docs and the schema's `servers` name it.
    app.root_path = http.root_path
    # GET /load's count (0 unless tracked). Innermost: a request the key or the size limit refuses is not load.
    app.state.server_load = ServerLoad()
    if http.enable_server_load_tracking:
        app.add_middleware(ServerLoadMiddleware, load=app.state.server_load)
    # Added last = outermost: the size limit, then the key, are checked before anything reads the body.
    app.state.auth = ApiKeyAuth(api_key, protect_metrics, http.root_path) if api_key else None
    if app.state.auth is not None:
        app.add_middleware(ApiKeyMiddleware, auth=app.state.auth)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=ctx.limits.max_request_body_bytes)
    if http.enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    add_cors(app, http.allowed_origins, http.allowed_methods, http.allowed_headers, http.allow_credentials)
    add_middlewares(app, http.middleware)  # --middleware: outermost, as vLLM adds them after its own
    if dashboard:  # its data routes check the key themselves (EventSource can only send ?api_key=)
        board = register_dashboard(app, ctx.engine, api_key)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        if ctx.log_error_stack:  # --log-error-stack: a 5xx's traceback (the engine's, for a mapped error)
            log_error_traceback(logger, exc, f"{request.method} {request.url.path}")
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        kind = {404: "not_found", 413: "request_too_large"}.get(exc.status_code, "invalid_request_error")
        return error_response(OpenAIError(str(exc.detail), code=kind, status=exc.status_code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(OpenAIError("internal server error", status=500, type="server_error"))

    async def _serve(request: Request, work: Awaitable[Any]) -> Response:
        ok, result = await run_until_disconnect(request, work)
        if not ok:
            return Response(status_code=499)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/health")
    async def health() -> Response:
        if ctx.engine.is_healthy:
            return Response(status_code=200)
        reason = ctx.engine.dead_reason or "engine not running"
        return error_response(OpenAIError(reason, code="engine_unavailable", status=503, type="server_error"))

    @app.post("/ping", operation_id="ping_post")
    @app.get("/ping")
    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness route: /health under another name."""
        return await health()

    @app.post("/invocations", openapi_extra=_INVOCATIONS_BODY)
    async def invocations(request: Request) -> Response:
        """vLLM's (SageMaker's) one route for every kind of request: the body's own fields say which."""
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            raise OpenAIError("The request body is not valid JSON.", code="invalid_json") from None
        keys = body.keys() if isinstance(body, dict) else ()
        kind = next((k for k in ("messages", "prompt", "input") if k in keys), None)
        if ctx.runner == "pooling" and ctx.engine.request_checker.pooling_task == "token_classify":
            if kind not in ("messages", "input"):
                raise OpenAIError("an invocation of this token classification model needs `input` (text or token "
                                  "ids) or `messages` (a conversation) to classify token by token.", param="body")
            kind = "pooling"
        elif ctx.runner == "pooling" and ctx.engine.request_checker.pooling_task == "classify":
            if kind != "input":
                raise OpenAIError("an invocation of this classification model needs `input` (text or token ids) to "
                                  "classify.", param="body")
            kind = "classify"
        elif ctx.runner == "pooling":  # an embedding model: `input` or `messages` are what to embed
            kind = "embed" if kind in ("messages", "input") else None
            if kind is None:
                raise OpenAIError("an invocation of this embedding model needs `input` (text or token ids) or "
                                  "`messages` (a conversation) to embed.", param="body")
        elif kind is None:
            raise OpenAIError("an invocation needs `messages` (a chat completion), `prompt` (a completion) or "
                              "`input` (a response).", param="body")
        model = {"messages": ChatCompletionRequest, "prompt": CompletionRequest, "input": ResponsesRequest,
                 "embed": EmbeddingRequest, "classify": ClassificationRequest, "pooling": PoolingRequest}[kind]
        try:
            req = model.model_validate_json(raw)
        except ValidationError as e:
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
        rid = request.headers.get("x-request-id")
        work = (embedding.create_embedding(req, rid) if kind == "embed" else
                pooling.create_pooling(req, rid) if kind == "pooling" else
                classification.create_classify(req, rid) if kind == "classify" else
                chat.create_chat_completion(req, rid) if kind == "messages" else
                completion.create_completion(req, rid) if kind == "prompt" else responses.create_response(req, rid))
        return await _serve(request, work)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedllm.__version__}

    @app.get("/load")
    async def server_load() -> dict:
        """vLLM's load report: requests in flight on the generation and pooling routes, streams until their end
        (always 0 without --enable-server-load-tracking, as in vLLM)."""
        return {"server_load": app.state.server_load.value}

    if http.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def get_tokenizer_info() -> dict:
            """vLLM's /tokenizer_info (--enable-tokenizer-info-endpoint): the tokenizer's configuration, its class
            and the chat template in use."""
            return tokenizer_info(ctx.tokenizer, ctx.chat_template)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [ModelCard(id=name, root=ctx.model_path, max_model_len=ctx.max_model_len)
                 for name in ctx.served_model_names]
        cards += [ModelCard(id=name, root=lora.lora_path, parent=ctx.model_name, max_model_len=ctx.max_model_len)
                  for name, lora in ctx.lora_modules.items()]
        return dump(ModelList(data=cards))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        ctx.check_runner("generate", "/v1/completions")
        return await _serve(request, completion.create_completion(req, request.headers.get("x-request-id")))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        ctx.check_runner("generate", "/v1/chat/completions")
        return await _serve(request, chat.create_chat_completion(req, request.headers.get("x-request-id")))

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, request: Request) -> Response:
        ctx.check_runner("generate", "/v1/responses")
        return await _serve(request, responses.create_response(req, request.headers.get("x-request-id")))

    @app.post("/v1/embeddings")
    async def create_embedding(req: EmbeddingRequest, request: Request) -> Response:
        return await _serve(request, embedding.create_embedding(req, request.headers.get("x-request-id")))

    @app.post("/pooling")
    async def create_pooling(req: PoolingRequest, request: Request) -> Response:
        return await _serve(request, pooling.create_pooling(req, request.headers.get("x-request-id")))

    @app.post("/score")
    @app.post("/v1/score", operation_id="create_score_v1")
    async def create_score(req: ScoreRequest, request: Request) -> Response:
        return await _serve(request, scoring.create_score(req, request.headers.get("x-request-id"),
                                                          request.url.path))

    @app.post("/rerank")
    @app.post("/v1/rerank", operation_id="do_rerank_v1")
    @app.post("/v2/rerank", operation_id="do_rerank_v2")
    async def do_rerank(req: RerankRequest, request: Request) -> Response:
        return await _serve(request, scoring.create_rerank(req, request.headers.get("x-request-id"),
                                                           request.url.path))

    @app.post("/classify")
    async def create_classify(req: ClassificationRequest, request: Request) -> Response:
        return await _serve(request, classification.create_classify(req, request.headers.get("x-request-id"),
                                                                    request.url.path))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict:
        return responses.retrieve(response_id)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        ctx.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError("give exactly one of prompt or messages.", param="prompt")
        if req.prompt is not None:
            ids = list(ctx.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            ids = render_messages(ctx, req)
        return dump(TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids))

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        ctx.check_model(req.model)
        ctx.check_ids(req.tokens, "tokens")
        return dump(DetokenizeResponse(prompt=ctx.tokenizer.decode(req.tokens)))

    if runtime_lora_updating_allowed():
        lora = OpenAIServingLoRA(ctx, enable_lora)

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
            return Response(lora.load(req), media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
            return Response(await lora.unload(req), media_type="text/plain")

    if dev_mode:
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache(reset_running_requests: bool = False) -> Response:
            """vLLM's development route: 200 once every cached prefix is dropped, 409 while requests hold KV
            blocks."""
            if reset_running_requests:
                raise OpenAIError("reset_running_requests=true is not supported: the prefix cache is reset only "
                                  "while no request holds KV blocks; retry when the running requests finish.",
                                  param="reset_running_requests")
            logger.info("Resetting prefix cache...")
            if not await ctx.engine.reset_prefix_cache():
                raise OpenAIError("Prefix cache reset failed: requests still hold KV blocks; retry when they finish.",
                                  code="conflict", status=409)
            return Response(status_code=200)

        register_sleep_routes(app, ctx.engine)

    if profiler:
        register_profiler_routes(app, ctx.engine)

    return app

