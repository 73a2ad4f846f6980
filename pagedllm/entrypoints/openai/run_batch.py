"""`pagedllm run-batch`: vLLM's offline batch runner for OpenAI Batch API files.

Each line of the input (JSONL) is one request, ``{"custom_id": ..., "method": "POST", "url": ..., "body": {...}}``;
each line of the output answers the input line at the same place, ``{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error"}``. The requests run through the server's own handlers in this
process (no HTTP), all in flight together up to a bound, so the scheduler batches them as it would a server's
clients; a bad line is answered by an error line and the others run on.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, TextIO

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.entrypoints.openai.protocol_embeddings import EmbeddingRequest
from pagedllm.entrypoints.openai.protocol_score import RerankRequest, ScoreRequest
from pagedllm.entrypoints.openai.request_errors import validation_error
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_common import OpenAIError, ServingContext
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagedllm.entrypoints.openai.serving_score import OpenAIServingScore

Handler = Callable[[Any], Awaitable[Any]]


@dataclass(frozen=True)
class BatchRoute:
    """One URL a batch line may name: the body's request model and the handler that answers it."""

    request_model: type[BaseModel]
    handler: Handler


def batch_routes(ctx: ServingContext) -> dict[str, BatchRoute]:
    """vLLM's batch URLs (chat, embeddings, score, rerank) and /v1/completions, on `ctx`'s handlers."""
    chat, completion = OpenAIServingChat(ctx), OpenAIServingCompletion(ctx)
    embedding, scoring = OpenAIServingEmbedding(ctx), OpenAIServingScore(ctx)

    def generating(route: str, handler: Handler) -> Handler:
        async def run(req: Any) -> Any:
            ctx.check_runner("generate", route)
            return await handler(req)
        return run

    routes = {
        "/v1/chat/completions": BatchRoute(ChatCompletionRequest, generating("/v1/chat/completions",
                                                                              chat.create_chat_completion)),
        "/v1/completions": BatchRoute(CompletionRequest, generating("/v1/completions", completion.create_completion)),
        "/v1/embeddings": BatchRoute(EmbeddingRequest, embedding.create_embedding),
    }
    for path in ("/score", "/v1/score"):
        routes[path] = BatchRoute(ScoreRequest, lambda req, p=path: scoring.create_score(req, None, p))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        routes[path] = BatchRoute(RerankRequest, lambda req, p=path: scoring.create_rerank(req, None, p))
    return routes


def _output_line(custom_id: Any, status: int, body: dict | None, error: dict | None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"batch-{uuid.uuid4().hex}", "body": body},
            "error": error}


def _error_line(custom_id: Any, err: OpenAIError) -> dict:
    return _output_line(custom_id, err.status, None, err.body())


class BatchLine:
    """One input line, checked: `route` and `request` when it can run, else `error` says why."""

    def __init__(self, text: str, routes: dict[str, BatchRoute], seen_ids: set[str]) -> None:
        self.custom_id: Any = None
        self.route: BatchRoute | None = None
        self.request: Any = None
        self.error: OpenAIError | None = None
        try:
            self._parse(text, routes, seen_ids)
        except OpenAIError as e:
            self.error = e

    def _parse(self, text: str, routes: dict[str, BatchRoute], seen_ids: set[str]) -> None:
        try:
            item = json.loads(text)
        except ValueError as e:
            raise OpenAIError(f"the line is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(item, dict):
            raise OpenAIError("a batch line must be a JSON object with custom_id, method, url and body")
        self.custom_id = item.get("custom_id")
        if not isinstance(self.custom_id, str) or not self.custom_id:
            raise OpenAIError("custom_id must be a non-empty string", param="custom_id")
        if self.custom_id in seen_ids:
            raise OpenAIError(f"custom_id {self.custom_id!r} is used by an earlier line; each must be unique",
                              param="custom_id")
        seen_ids.add(self.custom_id)
        if item.get("method", "POST") != "POST":
            raise OpenAIError(f"method must be POST, got {item.get('method')!r}", param="method")
        url = item.get("url")
        self.route = routes.get(url) if isinstance(url, str) else None
        if self.route is None:
            raise OpenAIError(f"url {url!r} is not supported in a batch; supported: {', '.join(sorted(routes))}",
                              param="url")
        body = item.get("body")
        if not isinstance(body, dict):
            raise OpenAIError("body must be a JSON object (the request of that url)", param="body")
        if body.get("stream"):
            raise OpenAIError("a batch request cannot stream; drop stream or set it to false", param="stream")
        try:
            self.request = self.route.request_model.model_validate(body)
        except ValidationError as e:
            # As FastAPI reports a body's errors (loc under "body"), so the message and `param` read the same.
            errors = [{**err, "loc": ("body", *err.get("loc", ()))} for err in e.errors()]
            raise validation_error(RequestValidationError(errors)) from None


async def _answer(line: BatchLine, ctx: ServingContext) -> dict:
    if line.error is not None or line.route is None:
        return _error_line(line.custom_id, line.error or OpenAIError("the line cannot run"))
    try:
        body = await line.route.handler(line.request)
    except Exception as e:  # every failure becomes this line's error; the batch runs on
        return _error_line(line.custom_id, ctx.mapped_error(e, f"batch line {line.custom_id!r}"))
    if not isinstance(body, dict):  # a stream (the request asked for one some other way)
        return _error_line(line.custom_id, OpenAIError("a batch request cannot stream", param="stream"))
    return _output_line(line.custom_id, 200, body, None)


@dataclass
class BatchSummary:
    requests: int = 0
    failed: int = 0


async def run_batch(ctx: ServingContext, lines: list[str], output: TextIO, max_in_flight: int,
                    progress: Any = None) -> BatchSummary:
    """Answer every non-blank line of `lines`, at most `max_in_flight` at a time, writing the answers to `output`
    in input order as soon as each one's predecessors are written. `progress`: a tqdm-like bar (update per line)."""
    routes = batch_routes(ctx)
    seen: set[str] = set()
    batch = [BatchLine(text, routes, seen) for text in lines if text.strip()]
    summary = BatchSummary(requests=len(batch))
    slots = asyncio.Semaphore(max(1, max_in_flight))
    done: dict[int, dict] = {}
    next_to_write = 0

    async def run(index: int, line: BatchLine) -> None:
        nonlocal next_to_write
        async with slots:
            answer = await _answer(line, ctx)
        done[index] = answer
        if answer["error"] is not None:
            summary.failed += 1
        while next_to_write in done:  # one event loop: no lock needed between these lines
            output.write(json.dumps(done.pop(next_to_write), ensure_ascii=False) + "\n")
            next_to_write += 1
        if progress is not None:
            progress.update(1)

    await asyncio.gather(*(run(i, line) for i, line in enumerate(batch)))
    output.flush()
    return summary


def read_batch_lines(path: str) -> list[str]:
    """The input file's lines (a local path; vLLM's http(s) URLs need a network this engine does not assume)."""
    if path.startswith(("http://", "https://")):
        raise ValueError(f"--input-file {path!r}: only local files are supported; download it first")
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"--input-file {path!r} does not exist")
    return file.read_text(encoding="utf-8").splitlines()


async def run_batch_file(ctx: ServingContext, lines: list[str], output_path: str, max_in_flight: int,
                         show_progress: bool = True) -> BatchSummary:
    """Start `ctx`'s engine, answer `lines` into `output_path` (overwritten) with a progress bar, stop it."""
    from tqdm import tqdm

    ctx.engine.start()
    try:
        with open(output_path, "w", encoding="utf-8") as output, \
                tqdm(total=sum(1 for line in lines if line.strip()), unit="req", desc="Running batch",
                     disable=not show_progress) as bar:
            return await run_batch(ctx, lines, output, max_in_flight, bar)
    finally:
        await ctx.engine.shutdown()


def add_run_batch_parser(sub) -> None:
    from pagedllm.entrypoints.openai.cli_serve import add_serving_args

    p = sub.add_parser("run-batch", help="Run an OpenAI Batch API file (JSONL) offline, as vLLM's run_batch.",
                       description=__doc__.split("\n\n", 1)[1] if __doc__ else None)
    p.add_argument("-i", "--input-file", required=True,
                   help="The batch file: one JSON request per line (custom_id, method, url, body).")
    p.add_argument("-o", "--output-file", required=True,
                   help="Where the answers go, one JSON line per request, in the input's order (overwritten).")
    add_serving_args(p)
    p.set_defaults(func=run_run_batch)


def run_run_batch(args: Any) -> int:
    import logging

    from pagedllm.entrypoints.openai.cli_serve import start_serving

    lines = read_batch_lines(args.input_file)  # a missing file fails before the engine starts
    ctx, _, _ = start_serving(args, "run-batch")
    # Twice the running batch in flight, as vLLM: the scheduler always has the next requests waiting.
    in_flight = 2 * ctx.engine.request_checker.max_num_seqs
    summary = asyncio.run(run_batch_file(ctx, lines, args.output_file, in_flight))
    logging.getLogger("pagedllm.run_batch").info("%d requests, %d failed; answers in %s", summary.requests,
                                                 summary.failed, args.output_file)
    return 0
