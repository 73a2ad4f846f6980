"""`pagedllm serve`: build the engine, log what was loaded, run uvicorn, shut down cleanly on signals."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.config_file import add_config_arg
from pagedllm.entrypoints.openai.reasoning import ReasoningParser
from pagedllm.json_object import parse_json_object

if TYPE_CHECKING:
    from pagedllm.engine.metrics import EngineMetrics
    from pagedllm.entrypoints.openai.server import HttpOptions
    from pagedllm.entrypoints.openai.serving_common import ServingContext

logger = logging.getLogger("pagedllm.serve")
#: vLLM's switch for keeping /v1/responses results (--enable-responses-api-store).
RESPONSES_STORE_ENV = "VLLM_ENABLE_RESPONSES_API_STORE"


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="Serve a model over an OpenAI-compatible HTTP API.",
                       description="Serve a model over an OpenAI-compatible HTTP API (FastAPI + uvicorn).")
    p.add_argument("--host", default="127.0.0.1", help="Address to bind (default: 127.0.0.1).")
    p.add_argument("--port", type=int, default=8000, help="Port to bind (default: 8000).")
    p.add_argument("--api-key", default=os.environ.get("PAGEDLLM_API_KEY"),
                   help="Require 'Authorization: Bearer KEY' on /v1/* routes (default: $PAGEDLLM_API_KEY).")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="Add X-Request-Id to every response: the client's own X-Request-Id, else a random id.")
    p.add_argument("--allowed-origins", type=_json_list, default=["*"],
                   help='CORS: origins allowed, a JSON list (default: ["*"]).')
    p.add_argument("--allowed-methods", type=_json_list, default=["*"],
                   help='CORS: methods allowed, a JSON list (default: ["*"]).')
    p.add_argument("--allowed-headers", type=_json_list, default=["*"],
                   help='CORS: request headers allowed, a JSON list (default: ["*"]).')
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth).")
    p.add_argument("--uvicorn-log-level", default="warning", help="uvicorn's log level (default: warning).")
    p.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="Seconds in-flight requests may run after SIGINT/SIGTERM before they are aborted "
                        "(default: 5).")
    p.add_argument("--enable-responses-api-store", action="store_true",
                   default=os.environ.get(RESPONSES_STORE_ENV, "0") == "1",
                   help="Keep /v1/responses results in memory (the most recent 10 000) for GET /v1/responses/{id} "
                        f"and previous_response_id (vLLM's {RESPONSES_STORE_ENV}=1 does the same). Off: requests' "
                        "`store` is ignored and nothing is kept.")
    _add_http_args(p)
    p.add_argument("--no-dashboard", action="store_true",
                   help="Turn off the live KV-cache dashboard (/dashboard, /dashboard/snapshot, /dashboard/events).")
    p.add_argument("--no-warm-up-request", action="store_true",
                   help="Skip the one short streamed request sent through the app before the server binds "
                        "(it warms what the first client request would otherwise pay for).")
    add_serving_args(p)
    p.set_defaults(func=run_serve)


def add_serving_args(p: argparse.ArgumentParser) -> None:
    """The flags of the request handlers and their engine, shared by `serve` and `run-batch`."""
    p.add_argument("model_tag", nargs="?", default=None, help="Model to serve (same as --model).")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="Model name(s) the API answers to (default: the model's name).")
    p.add_argument("--chat-template", default=None, help="A Jinja chat template, or a file holding one.")
    p.add_argument("--default-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help="Template variables every chat request gets unless its chat_template_kwargs set them, as "
                        "vLLM's (e.g. '{\"enable_thinking\": false}' for a Qwen3 model).")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="Logprob tokens as 'token_id:N' strings (a request's return_tokens_as_token_ids overrides).")
    _add_chat_template_args(p)
    _add_tool_args(p)
    _add_limit_args(p)
    _add_log_args(p)
    _add_response_args(p)
    p.add_argument("--disable-frontend-multiprocessing", action="store_true",
                   help="Run the engine on a thread of this process instead of an engine-core process of "
                        "its own (the default splits them, as vLLM does, so request handling and the step loop never "
                        "share one interpreter lock).")
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve (with --enable-lora), as vLLM's: name=path, or a JSON object "
                        "'{\"name\": ..., \"path\": ...}'; a request whose model is NAME runs with that adapter.")
    add_config_arg(p)
    EngineArgs.add_cli_args(p)


def _lora_module(text: str) -> tuple[str, str]:
    """(name, path) of one --lora-modules entry."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules: not valid JSON: {e}") from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(value.get("path"), str):
            raise argparse.ArgumentTypeError(f"--lora-modules: a JSON entry needs string 'name' and 'path', got {text!r}")
        return value["name"], value["path"]
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules entries are name=path, got {text!r}")
    return name, path


def _lora_requests(modules: list[tuple[str, str]] | None, enable_lora: bool, served: list[str]) -> dict:
    """--lora-modules as {name: LoRARequest}, ids 1, 2, … in the given order."""
    from pagedllm.lora.request import LoRARequest

    if not modules:
        return {}
    if not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora.")
    names = [n for n, _ in modules]
    clash = sorted({n for n in names if names.count(n) > 1 or n in served})
    if clash:
        raise ValueError(f"--lora-modules names must be unique and differ from the served model name; repeated: {clash}")
    missing = [path for _, path in modules if not (Path(path) / "adapter_config.json").is_file()]
    if missing:
        raise ValueError(f"--lora-modules: no PEFT adapter (adapter_config.json) at {missing}")
    return {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(modules, start=1)}


def _add_chat_template_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.chat_content_format import CONTENT_FORMAT_OPTIONS

    g = p.add_argument_group("chat template (vLLM's flags; --chat-template is above)")
    g.add_argument("--chat-template-content-format", choices=CONTENT_FORMAT_OPTIONS, default="auto",
                   help="How a message's content reaches the chat template: 'string' (text parts joined into one "
                        "string), 'openai' (a list of parts, [{\"type\": \"text\", \"text\": ...}]), or 'auto' "
                        "(default): 'openai' when the template loops over message content, else 'string'.")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="Let a request bring its own chat_template (Jinja run on the server); without this flag "
                        "such a request is a 400, as in vLLM.")


def _add_tool_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

    g = p.add_argument_group("tool calling")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="Accepted for vLLM's command lines: tool_choice \"auto\" is always on here (with tools in a "
                        "request, the output is parsed into tool_calls).")
    # No argparse choices: a --tool-parser-plugin may add names; tool_options checks the name once it has loaded.
    g.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="The format tool_choice \"auto\" parses, as vLLM's parser of that name: "
                        f"{', '.join(sorted(TOOL_PARSERS))}, or one a --tool-parser-plugin registers (default: every "
                        "format is tried, the first the output shows is used).")
    g.add_argument("--tool-parser-plugin", default=None, metavar="FILE",
                   help="A Python file defining tool parsers (vLLM's flag): ToolParser subclasses decorated with "
                        "@ToolParserManager.register_module([\"name\"]) (both from "
                        "pagedllm.entrypoints.openai.tool_parsers); --tool-call-parser may then name them. Names "
                        "of built-in parsers are refused.")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="A request with tool_choice \"none\" renders its prompt without its tools (vLLM's flag; "
                        "default: the chat template gets them either way).")


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.openai import limits as L

    g = p.add_argument_group("request limits and security")
    g.add_argument("--max-prompts-per-request", type=int, default=L.DEFAULT_MAX_PROMPTS,
                   help=f"Most prompts in one /v1/completions request; more is a 413 (default: {L.DEFAULT_MAX_PROMPTS}).")
    g.add_argument("--max-total-prompt-tokens", type=int, default=L.DEFAULT_MAX_TOTAL_PROMPT_TOKENS,
                   help="Most prompt tokens in one request, all prompts together; more is a 413 "
                        f"(default: {L.DEFAULT_MAX_TOTAL_PROMPT_TOKENS}).")
    g.add_argument("--max-n", type=int, default=L.DEFAULT_MAX_N,
                   help=f"Most completions per prompt (n, best_of), also capped by --max-num-seqs "
                        f"(default: {L.DEFAULT_MAX_N}).")
    g.add_argument("--max-request-body-bytes", type=int, default=L.DEFAULT_MAX_BODY_BYTES,
                   help="Request bodies above this size get a 413 before they are parsed "
                        f"(default: {L.DEFAULT_MAX_BODY_BYTES}, 8 MiB).")
    g.add_argument("--protect-metrics", action="store_true",
                   help="With --api-key, require the key on /metrics too (default: /metrics and /health are open).")


def _add_log_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging (vLLM's flags; --disable-log-stats is with the engine's)")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="Log a line for each request handed to the engine, as vLLM: its id, prompt, sampling "
                        "parameters, prompt token ids and LoRA adapter (default: off).")
    # Declared after --enable-log-requests, whose default the shared dest keeps.
    g.add_argument("--disable-log-requests", dest="enable_log_requests", action="store_false", default=False,
                   help="vLLM's older flag: no request log (the default).")
    g.add_argument("--enable-log-outputs", action=argparse.BooleanOptionalAction, default=False,
                   help="With --enable-log-requests: also log each finished completion (its text, token ids and "
                        "finish reason; a stream's once it ends), as vLLM (default: off).")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="With --enable-log-requests: log at most this many prompt characters and prompt token "
                        "ids (default: all).")
    g.add_argument("--log-error-stack", action=argparse.BooleanOptionalAction, default=False,
                   help="Log the full traceback of every server-side error answered to a client (a 5xx response, a "
                        "stream's error event, a batch line's error), as vLLM; unexpected exceptions log theirs "
                        "always (default: off).")
    p.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="The only hosts an http(s) image_url may be fetched from, redirects refused (vLLM's flag; "
                        "default: any host).")
    # --allowed-local-media-path is an engine argument (EngineArgs), as in vLLM: the offline LLM takes it too.


def _add_http_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP server (vLLM's flags)")
    g.add_argument("--root-path", default=None,
                   help="FastAPI's root_path, behind a proxy that routes a path prefix (e.g. /api) to this server: "
                        "routes answer with and without the prefix, and /docs points at it.")
    g.add_argument("--ssl-keyfile", default=None, help="HTTPS: the private key file (PEM).")
    g.add_argument("--ssl-certfile", default=None, help="HTTPS: the certificate file (PEM); turns HTTPS on.")
    g.add_argument("--ssl-ca-certs", default=None, help="HTTPS: CA certificates that client certificates are "
                                                        "checked against.")
    g.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                   help="HTTPS: whether a client certificate is required (Python's ssl.VerifyMode: 0 none, "
                        "1 optional, 2 required; default: 0).")
    g.add_argument("--disable-fastapi-docs", action=argparse.BooleanOptionalAction, default=False,
                   help="Serve no OpenAPI schema, Swagger UI or ReDoc (/openapi.json, /docs, /redoc).")
    _add_server_ops_args(p)


def _add_server_ops_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.entrypoints.openai import server_ops as ops
    from pagedllm.log_config import LOGGING_CONFIG_ENV

    g = p.add_argument_group("server operations (vLLM's flags)")
    g.add_argument("--enable-server-load-tracking", action=argparse.BooleanOptionalAction, default=False,
                   help="Count the requests in flight on the generation and pooling routes (/v1/completions, "
                        "/v1/chat/completions, /v1/responses, /v1/embeddings, /classify, /score, /rerank, "
                        "/invocations; a stream until its end or its client's disconnect) for GET /load "
                        "({\"server_load\": N}); without it /load answers 0, as in vLLM.")
    g.add_argument("--middleware", action="append", default=[], metavar="IMPORT.PATH",
                   help="Add an ASGI middleware class (app.add_middleware(cls)) or an async function (request, "
                        "call_next) (@app.middleware(\"http\")) by import path, e.g. mypkg.mw.TimingMiddleware; "
                        "repeatable, each added outside the server's own, the last given outermost. A path that "
                        "does not import is an error at start-up.")
    g.add_argument("--enable-tokenizer-info-endpoint", action=argparse.BooleanOptionalAction, default=False,
                   help="Serve GET /tokenizer_info: the tokenizer's configuration (tokenizer_config.json as loaded, "
                        "less file paths), tokenizer_class and the chat template; it may expose the chat template, "
                        "so it is off by default and behind --api-key.")
    g.add_argument("--log-config-file", default=None, metavar="PATH",
                   help="A JSON logging config (logging.config.dictConfig's form, with \"version\": 1) applied at "
                        f"start-up, before the engine loads, in this process and the engine-core one (default: "
                        f"${LOGGING_CONFIG_ENV}, as vLLM). Loggers it does not name are disabled unless it sets "
                        "\"disable_existing_loggers\": false.")
    g.add_argument("--h11-max-incomplete-event-size", type=_positive_int, default=None, metavar="BYTES",
                   help="Most bytes uvicorn's h11 parser buffers of an incomplete event (a request line and its "
                        f"headers); larger is a 400 (default: {ops.H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT}, vLLM's). "
                        "Given, it makes uvicorn use its h11 parser (httptools, its default when installed, has no "
                        "such limit).")
    g.add_argument("--h11-max-header-count", type=_positive_int, default=None, metavar="N",
                   help=f"Most headers in a request (default: {ops.H11_MAX_HEADER_COUNT_DEFAULT}, vLLM's), where "
                        "uvicorn has the setting; the installed one may not, and then the flag is accepted and "
                        "ignored with a warning (--h11-max-incomplete-event-size bounds the headers' size).")


def _positive_int(text: str) -> int:
    """A flag's integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer (> 0), got {value}")
    return value


def _add_response_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("responses (vLLM's flags)")
    g.add_argument("--response-role", default="assistant",
                   help="The role of the chat reply when the request adds the generation prompt (else the role of "
                        "the message it continues) (default: assistant).")
    g.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction, default=False,
                   help="Usage of /v1/completions and /v1/chat/completions (streamed too) gets "
                        "prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache served.")
    g.add_argument("--enable-force-include-usage", action=argparse.BooleanOptionalAction, default=False,
                   help="Every streamed completion ends with a usage chunk, as if the request set "
                        "stream_options.include_usage.")


def _json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object of template variables by name, e.g. '{"enable_thinking": false}'."""
    try:
        return parse_json_object("the value", text, '{"enable_thinking": false}')
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_list(text: str) -> list[str]:
    """A flag's JSON list of strings, e.g. '["https://a.example", "https://b.example"]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"*\"]'; {e}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def _default_name(model: str | None) -> str:
    from pagedllm.model.loader import DEFAULT_MODEL

    if model is None:
        return DEFAULT_MODEL
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else (path.name or model)


def _chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value).expanduser()
    return path.read_text() if path.is_file() else value


def http_options(args: argparse.Namespace) -> HttpOptions:
    """The app's HTTP options from the serve flags; --middleware's paths are imported here, so a bad one is a
    ValueError before the engine starts."""
    from pagedllm.entrypoints.openai.server import HttpOptions
    from pagedllm.entrypoints.openai.server_ops import load_middleware

    return HttpOptions(enable_request_id_headers=args.enable_request_id_headers,
                       allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
                       allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
                       root_path=(args.root_path or "").rstrip("/"), disable_fastapi_docs=args.disable_fastapi_docs,
                       enable_server_load_tracking=args.enable_server_load_tracking,
                       enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                       middleware=tuple(load_middleware(path) for path in args.middleware or ()))


def ssl_options(args: argparse.Namespace) -> dict[str, Any]:
    """uvicorn's TLS settings from --ssl-*: empty without a certificate; a ValueError for files that are not
    there."""
    files = {"--ssl-keyfile": args.ssl_keyfile, "--ssl-certfile": args.ssl_certfile,
             "--ssl-ca-certs": args.ssl_ca_certs}
    missing = [f"{flag} {path}" for flag, path in files.items() if path is not None and not Path(path).is_file()]
    if missing:
        raise ValueError(f"no such file: {', '.join(missing)}.")
    if args.ssl_certfile is None:
        if args.ssl_keyfile or args.ssl_ca_certs:
            raise ValueError("--ssl-keyfile and --ssl-ca-certs need --ssl-certfile (HTTPS is on with a certificate).")
        return {}
    if args.ssl_cert_reqs not in {int(m) for m in ssl.VerifyMode}:
        raise ValueError(f"--ssl-cert-reqs must be one of {sorted(int(m) for m in ssl.VerifyMode)} "
                         f"(ssl.VerifyMode), got {args.ssl_cert_reqs}.")
    return {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile, "ssl_ca_certs": args.ssl_ca_certs,
            "ssl_cert_reqs": args.ssl_cert_reqs}


def apply_log_config_file(args: argparse.Namespace) -> str | None:
    """--log-config-file, else vLLM's $VLLM_LOGGING_CONFIG_PATH, applied with logging.config.dictConfig: the file's
    path, or None when neither names one. A ValueError names the flag or the variable and what is wrong. The
    variable is set to the file for the engine-core process, which applies it too (as vLLM's processes do)."""
    from pagedllm.log_config import LOGGING_CONFIG_ENV, apply_log_config

    if args.log_config_file:
        path, source = args.log_config_file, "--log-config-file"
    elif os.environ.get(LOGGING_CONFIG_ENV):
        path, source = os.environ[LOGGING_CONFIG_ENV], LOGGING_CONFIG_ENV
    else:
        return None
    apply_log_config(path, source)
    os.environ[LOGGING_CONFIG_ENV] = str(Path(path).expanduser().resolve())
    logger.info("logging configured from %s (%s)", path, source)
    return path


def stats_log_interval(engine_args: EngineArgs) -> float | None:
    """Seconds between vLLM's periodic stats lines (None: --disable-log-stats)."""
    from pagedllm.engine.stats_logger import stats_interval_s

    return None if engine_args.disable_log_stats else stats_interval_s()


def serving_options(args: argparse.Namespace) -> dict[str, Any]:
    """ServingContext fields from vLLM's response and request-log flags."""
    from pagedllm.entrypoints.openai.request_logger import RequestLogger

    if not args.response_role:
        raise ValueError("--response-role must not be empty (e.g. assistant).")
    if args.enable_log_outputs and not args.enable_log_requests:
        logger.warning("--enable-log-outputs logs nothing without --enable-log-requests (as in vLLM).")
    defaults = args.default_chat_template_kwargs
    if defaults:
        from pagedllm.tokenizer import check_chat_template_options

        try:
            check_chat_template_options(True, False, defaults)
        except ValueError as e:
            raise ValueError(f"--default-chat-template-kwargs: {e}") from None
    return {"response_role": args.response_role, "enable_prompt_tokens_details": args.enable_prompt_tokens_details,
            "default_chat_template_kwargs": defaults or None,
            "enable_force_include_usage": args.enable_force_include_usage,
            "request_logger": (RequestLogger(args.max_log_len, log_outputs=args.enable_log_outputs)
                               if args.enable_log_requests else None),
            "media_limits": _media_limits(args.allowed_media_domains, args.allowed_local_media_path),
            "chat_template_content_format": args.chat_template_content_format,
            "trust_request_chat_template": args.trust_request_chat_template}


def tool_options(args: argparse.Namespace) -> dict[str, Any]:
    """ServingContext fields from the tool-calling flags: --tool-parser-plugin loaded, --tool-call-parser checked
    against the parsers it leaves (ValueError naming the known ones)."""
    from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, tool_parser_classes, tool_parser_registry

    parsers = tool_parser_registry(args.tool_parser_plugin)
    try:
        tool_parser_classes(args.tool_call_parser, parsers)
    except ValueError as e:
        raise ValueError(f"--tool-call-parser: {e}") from None
    if args.tool_parser_plugin is not None:
        logger.info("tool parser plugin %s: %s", args.tool_parser_plugin,
                    ", ".join(n for n in parsers if n not in TOOL_PARSERS))
    return {"tool_call_parser": args.tool_call_parser, "tool_parsers": parsers,
            "exclude_tools_when_tool_choice_none": args.exclude_tools_when_tool_choice_none}


def _media_limits(domains: list[str] | None, local_path: str | None = None) -> Any:
    from pagedllm.multimodal.media import MediaLimits, resolve_local_media_dir

    if domains is not None and not all(d.strip() for d in domains):
        raise ValueError("--allowed-media-domains: every entry must be a host name (e.g. upload.wikimedia.org).")
    return MediaLimits(allowed_domains=tuple(d.strip().lower() for d in domains) if domains is not None else None,
                       allowed_local_media_path=resolve_local_media_dir(local_path))


def start_serving(args: argparse.Namespace, command: str) -> tuple[ServingContext, EngineMetrics, EngineArgs]:
    """The engine (an engine-core process, or a thread with --disable-frontend-multiprocessing) and the request
    handlers' context, from the flags of add_serving_args. `command` names the caller in errors."""
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.engine.core_client import AsyncMPClient
    from pagedllm.engine.metrics import EngineMetrics
    from pagedllm.entrypoints.openai.limits import RequestLimits
    from pagedllm.entrypoints.openai.serving_common import ServingContext
    from pagedllm.tokenizer import get_tokenizer

    if args.model_tag is not None:
        args.model = args.model_tag
    limits = RequestLimits(max_prompts_per_request=args.max_prompts_per_request,
                           max_total_prompt_tokens=args.max_total_prompt_tokens, max_n=args.max_n,
                           max_request_body_bytes=args.max_request_body_bytes)
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.compat_notes()  # its errors before the engine starts (the engine logs the notes)
    structured = engine_args.structured_outputs_settings()  # --reasoning-parser folded in; its errors now too
    extras = {**serving_options(args), **tool_options(args)}
    names = args.served_model_name or [_default_name(engine_args.model)]
    loras = _lora_requests(args.lora_modules, engine_args.enable_lora, names)
    metrics = EngineMetrics(names[0])
    if engine_args.data_parallel_size > 1:
        if args.disable_frontend_multiprocessing:
            raise ValueError("--data-parallel-size > 1 runs one engine-core process per rank; it cannot be combined "
                             "with --disable-frontend-multiprocessing (one engine on a thread of the server).")
        from pagedllm.engine.dp_client import DPAsyncMPClient

        engine = DPAsyncMPClient.from_engine_args(engine_args, observer=metrics)
    elif args.disable_frontend_multiprocessing:
        engine = AsyncLLMEngine.from_engine_args(engine_args, observer=metrics)
    else:
        engine = AsyncMPClient.from_engine_args(engine_args, observer=metrics)
    metrics.set_snapshot(engine.stats)
    info = engine.info
    if not info.has_tokenizer:
        raise ValueError(f"pagedllm {command} needs a tokenizer; drop --skip-tokenizer-init.")
    # The event loop's own tokenizer (the engine detokenizes with its own).
    tokenizer = get_tokenizer(info.model_dir, engine_args.tokenizer)
    checker = info.checker
    ctx = ServingContext(
        engine=engine, tokenizer=tokenizer, served_model_names=names, model_path=info.model_dir,
        max_model_len=info.max_seq_len, max_n=min(limits.max_n, checker.max_num_seqs),
        chat_template=_chat_template(args.chat_template), limits=limits,
        block_size=checker.block_size, num_gpu_blocks=checker.num_gpu_blocks,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        default_sampling=dict(info.default_sampling_params), max_logprobs=checker.max_logprobs,
        reasoning_parser=ReasoningParser(structured.reasoning_parser) if structured.reasoning_parser else None,
        lora_modules=loras, log_error_stack=args.log_error_stack, **extras,
    )
    logger.info(
        "model %s (%s) on %s, dtype %s; KV pool %d blocks x %d tokens = %d tokens; max_model_len %d",
        names[0], info.model_dir, info.device, info.dtype, checker.num_gpu_blocks, checker.block_size,
        checker.num_gpu_blocks * checker.block_size, ctx.max_model_len,
    )
    _log_content_format(ctx)
    return ctx, metrics, engine_args


def _log_content_format(ctx: ServingContext) -> None:
    """One line naming the content format "auto" found in the server's default chat template."""
    from pagedllm.chat_content_format import detect_content_format, template_text

    if ctx.chat_template_content_format != "auto":
        return
    template = template_text(ctx.tokenizer, ctx.chat_template)
    processor = getattr(ctx.engine, "mm_processor", None)
    if template is None and processor is not None:
        template = processor.chat_template
    if template is None:
        return
    logger.info("chat template content format: auto detected %r for the %s chat template "
                "(--chat-template-content-format overrides)", detect_content_format(template),
                "--chat-template" if ctx.chat_template else "model's")


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedllm.engine.gc_heap import freeze_startup_heap
    from pagedllm.entrypoints.openai.server import DEV_MODE_ENV, GracefulServer, build_app
    from pagedllm.entrypoints.openai.server_ops import h11_options
    from pagedllm.worker.profiler import TorchProfilerConfig

    if args.protect_metrics and not args.api_key:
        raise ValueError("--protect-metrics needs --api-key (there is no key to protect /metrics with).")
    log_config = apply_log_config_file(args)  # first: the engine's start-up lines go through it too
    http, tls = http_options(args), ssl_options(args)
    # The config was applied once, here; uvicorn's own default would reset its loggers' handlers.
    uvicorn_opts = {**h11_options(args.h11_max_incomplete_event_size, args.h11_max_header_count),
                    **({"log_config": None} if log_config else {})}
    ctx, metrics, engine_args = start_serving(args, "serve")
    engine, names = ctx.engine, ctx.served_model_names
    log_stats = stats_log_interval(engine_args)
    app = build_app(ctx, metrics, api_key=args.api_key, protect_metrics=args.protect_metrics,
                    dashboard=not args.no_dashboard, warm_up=not args.no_warm_up_request,
                    dev_mode=os.environ.get(DEV_MODE_ENV, "0") == "1", http=http,
                    responses_store=args.enable_responses_api_store, enable_lora=engine_args.enable_lora,
                    log_stats_interval_s=log_stats,
                    profiler=TorchProfilerConfig.from_env(engine_args.profiler_config).enabled)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5.0, access_log=False, **tls,
                            **uvicorn_opts)
    server = GracefulServer(config, engine, args.shutdown_timeout)
    # uvicorn re-raises the signal it caught after its graceful shutdown; these no-op handlers
    # (restored by uvicorn before it re-raises) turn that into a normal return, so we exit 0.
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: received.append(s))
    base = f"{'https' if tls else 'http'}://{args.host}:{args.port}{http.root_path}"
    logger.info("serving %s on %s (auth %s)", names[0], base, "on" if args.api_key else "off")
    if not args.no_dashboard:
        logger.info("live KV-cache dashboard: %s/dashboard", base)
    freeze_startup_heap()  # the API process too: no 100+ ms full collections while it streams (engine/gc_heap.py)
    server.run()
    if not server.started:
        logger.error("the server could not start (is %s:%d free?)", args.host, args.port)
        return 1
    logger.info("server stopped cleanly")
    return 0
