"""vLLM's operational server flags: --enable-server-load-tracking (GET /load), --middleware,
--enable-tokenizer-info-endpoint (GET /tokenizer_info) and the h11 parser limits (--h11-max-incomplete-event-size,
--h11-max-header-count). --log-config-file is pagedllm/log_config.py's, --log-error-stack serving_common's."""
from __future__ import annotations

import importlib
import inspect
import logging
import threading
from typing import Any, Callable

from starlette.routing import get_route_path

logger = logging.getLogger("pagedllm.serve")

#: The routes whose requests /load counts: vLLM's load-aware generation and pooling routes that this server has
#: (/invocations runs one of them).
LOAD_TRACKED_PATHS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/classify", "/score",
    "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/invocations", "/pooling",
})
#: vLLM's defaults for uvicorn's h11 parser: 4 MiB of an incomplete event (a request line and its headers), and
#: 256 headers.
H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT = 4 * 1024 * 1024
H11_MAX_HEADER_COUNT_DEFAULT = 256
#: tokenizer_config.json fields that are file paths on this server, left out of /tokenizer_info (as vLLM does).
_TOKENIZER_PATH_FIELDS = ("vocab_file", "merges_file", "tokenizer_file")


class ServerLoad:
    """Requests in flight on the generation and pooling routes (vLLM's ``server_load_metrics``, GET /load).

    Thread-safe; it stays 0 unless ServerLoadMiddleware counts into it (--enable-server-load-tracking)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0

    @property
    def value(self) -> int:
        return self._in_flight

    def enter(self) -> None:
        with self._lock:
            self._in_flight += 1

    def leave(self) -> None:
        with self._lock:
            if self._in_flight > 0:
                self._in_flight -= 1


class ServerLoadMiddleware:
    """Counts a POST to a tracked route from its arrival until the app is done with it: the response sent (a
    stream's last chunk), an error answered, or the client gone (a cancelled stream). Plain ASGI, so the count is
    exact for streams, where a route-level hook would see only the start."""

    def __init__(self, app, load: ServerLoad, paths: frozenset[str] = LOAD_TRACKED_PATHS) -> None:
        self.app, self.load, self.paths = app, load, paths

    async def __call__(self, scope, receive, send) -> None:
        # get_route_path: the path without --root-path's prefix, as the router sees it.
        if scope["type"] != "http" or scope.get("method") != "POST" or get_route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        self.load.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.leave()


# -- --middleware ------------------------------------------------------------------------------------------------
def load_middleware(path: str) -> type | Callable[..., Any]:
    """The object --middleware names (``package.module.Name``): an ASGI middleware class, added with
    ``app.add_middleware(cls)``, or an async function ``(request, call_next)``, added as
    ``@app.middleware("http")`` (vLLM's rule). A ValueError names the flag, the path and what was wrong."""
    module_name, _, name = path.strip().rpartition(".")
    if not module_name or not name:
        raise ValueError(f"--middleware {path!r}: expected an import path module.Name "
                         "(e.g. mypackage.middleware.TimingMiddleware).")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--middleware {path!r}: cannot import module {module_name!r} ({e}); is it on "
                         "PYTHONPATH?") from e
    except Exception as e:  # the module itself fails while importing
        raise ValueError(f"--middleware {path!r}: importing module {module_name!r} failed: "
                         f"{type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        raise ValueError(f"--middleware {path!r}: module {module_name!r} has no attribute {name!r}.")
    value = getattr(module, name)
    if inspect.isclass(value) or inspect.iscoroutinefunction(value):
        return value
    raise ValueError(f"--middleware {path!r}: expected an ASGI middleware class (built as cls(app)) or an async "
                     f"function (request, call_next), got a {type(value).__name__}.")


def add_middlewares(app, middlewares: tuple[Any, ...]) -> None:
    """Add --middleware's objects in the order given (so the last one given is outermost)."""
    for middleware in middlewares:
        if inspect.isclass(middleware):
            app.add_middleware(middleware)
        else:
            app.middleware("http")(middleware)


# -- GET /tokenizer_info -----------------------------------------------------------------------------------------
def tokenizer_info(tokenizer: Any, chat_template: str | None = None) -> dict[str, Any]:
    """vLLM's /tokenizer_info body: the tokenizer's configuration as loaded (tokenizer_config.json: special tokens
    as their text, model_max_length, added_tokens_decoder, ...) less its file paths, plus ``tokenizer_class`` and
    the chat template in use (`chat_template`, --chat-template, over the tokenizer's own)."""
    init = getattr(tokenizer, "init_kwargs", None) or {}
    info = {key: _jsonable(value) for key, value in init.items() if key not in _TOKENIZER_PATH_FIELDS}
    info["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or info.get("chat_template") or getattr(tokenizer, "chat_template", None)
    if template:
        info["chat_template"] = _jsonable(template)
    return info


def _jsonable(value: Any) -> Any:
    """`value` as JSON can carry it: an AddedToken as its text, mapping keys as strings, anything else as str."""
    content = getattr(value, "content", None)
    if isinstance(content, str):  # tokenizers' AddedToken
        return content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)


# -- h11 limits --------------------------------------------------------------------------------------------------
def h11_options(max_incomplete_event_size: int | None, max_header_count: int | None) -> dict[str, Any]:
    """uvicorn.Config settings for --h11-max-incomplete-event-size and --h11-max-header-count (None: not given,
    vLLM's default). Either limit given pins uvicorn to its h11 parser: its default (httptools, when installed)
    ignores both. A header count this uvicorn has no setting for is ignored with a warning."""
    import uvicorn

    supported = inspect.signature(uvicorn.Config).parameters
    options: dict[str, Any] = {
        "h11_max_incomplete_event_size": max_incomplete_event_size or H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT}
    pin = max_incomplete_event_size is not None
    if "h11_max_header_count" in supported:
        options["h11_max_header_count"] = max_header_count or H11_MAX_HEADER_COUNT_DEFAULT
        pin = pin or max_header_count is not None
    elif max_header_count is not None:
        logger.warning("--h11-max-header-count %d is ignored: uvicorn %s has no header-count limit (its "
                       "h11_max_header_count setting); --h11-max-incomplete-event-size bounds the size of a request's "
                       "headers instead.", max_header_count, uvicorn.__version__)
    if pin:
        options["http"] = "h11"
        logger.info("uvicorn runs its h11 HTTP parser, which the --h11-* limits apply to.")
    return options
