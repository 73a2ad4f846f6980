"""`pagedllm chat` and `pagedllm complete`: vLLM's interactive clients of a running OpenAI-compatible server.

As vLLM's (``vllm/entrypoints/cli/openai.py``): the `openai` package talks to ``--url`` (default
``http://localhost:8000/v1``) with ``--api-key`` (else ``$OPENAI_API_KEY``, else ``EMPTY``) and ``--model-name``
(else the first model of ``GET /models``, announced as ``Using model: NAME``). Replies are streamed and printed as
they come. `chat` keeps the conversation (``--system-prompt`` first), `complete` sends each prompt alone
(``--max-tokens``); ``-q/--quick`` sends one message or prompt and exits, else a REPL reads lines after ``> ``
until EOF (Ctrl-D) or Ctrl-C, which end it with status 0. No sampling flags: the server's defaults apply.

Unlike vLLM, an unreachable server or an API error (a wrong key, an unknown model) is one ``error: ...`` line on
stderr and status 1, not a traceback.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

DEFAULT_URL = "http://localhost:8000/v1"


def _add_query_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL,
                   help=f"Base URL of the running OpenAI-compatible server (default: {DEFAULT_URL}).")
    p.add_argument("--model-name", default=None,
                   help="The model to ask (default: the first model the server lists at GET /models).")
    p.add_argument("--api-key", default=None,
                   help="API key sent as a Bearer token (default: $OPENAI_API_KEY, else 'EMPTY'); it applies to the "
                        "OpenAI-compatible routes the server protects with its --api-key.")
    p.add_argument("--stats", action="store_true", help="Print TTFT and TPS statistics after each response.")


def add_client_parsers(sub) -> None:
    """Register `chat` and `complete` (vLLM's flags)."""
    desc = "Generate chat completions via the running API server."
    chat = sub.add_parser("chat", help=desc, description=desc)
    _add_query_options(chat)
    chat.add_argument("--system-prompt", default=None,
                      help="A system message put first in the conversation (for models whose template takes one).")
    chat.add_argument("-q", "--quick", metavar="MESSAGE", default=None,
                      help="Send MESSAGE as a single prompt, print the reply, then exit.")
    chat.set_defaults(func=run_chat)

    desc = "Generate text completions based on the given prompt via the running API server."
    complete = sub.add_parser("complete", help=desc, description=desc)
    _add_query_options(complete)
    complete.add_argument("--max-tokens", type=int, default=None,
                          help="Most tokens to generate per completion (default: the server's).")
    complete.add_argument("-q", "--quick", metavar="PROMPT", default=None,
                          help="Send a single prompt, print the completion, then exit.")
    complete.set_defaults(func=run_complete)


def run_chat(args: argparse.Namespace) -> int:
    """`pagedllm chat`: one message (``--quick``) or a REPL that keeps the conversation."""

    def session(client: Any, model: str) -> None:
        conversation: list[dict[str, str]] = []
        if args.system_prompt is not None:
            conversation.append({"role": "system", "content": args.system_prompt})

        def turn(message: str) -> None:
            conversation.append({"role": "user", "content": message})
            stream = client.chat.completions.create(model=model, messages=conversation,
                                                    **_stream_kwargs(args.stats))
            reply = _print_stream(stream, lambda choice: choice.delta.content, args.stats)
            conversation.append({"role": "assistant", "content": reply})

        if args.quick is not None:
            turn(args.quick)
        else:
            _repl("Please enter a message for the chat model:", turn)

    return _run_client(args, session)


def run_complete(args: argparse.Namespace) -> int:
    """`pagedllm complete`: one prompt (``--quick``) or a REPL of independent prompts."""

    def session(client: Any, model: str) -> None:
        extra = {} if args.max_tokens is None else {"max_tokens": args.max_tokens}

        def one(prompt: str) -> None:
            stream = client.completions.create(model=model, prompt=prompt, **extra, **_stream_kwargs(args.stats))
            _print_stream(stream, lambda choice: choice.text, args.stats)

        if args.quick is not None:
            one(args.quick)
        else:
            _repl("Please enter prompt to complete:", one)

    return _run_client(args, session)


def _stream_kwargs(stats: bool) -> dict[str, Any]:
    return {"stream": True, **({"stream_options": {"include_usage": True}} if stats else {})}


def _repl(banner: str, handle: Callable[[str], None]) -> None:
    """Read lines after a ``> `` prompt until EOF, passing each to `handle`."""
    if sys.stdin.isatty():
        try:  # line editing and history at a terminal
            import readline  # noqa: F401
        except ImportError:
            pass
    print(banner)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return
        handle(line)


def _print_stream(stream: Iterable[Any], text_of: Callable[[Any], str | None], stats: bool) -> str:
    """Print each chunk's text as it arrives, then a newline (and TTFT / TPS with `stats`); returns the text."""
    start = time.perf_counter()
    ttft: float | None = None
    completion_tokens = 0
    parts: list[str] = []
    for chunk in stream:
        if getattr(chunk, "usage", None) is not None:
            completion_tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        text = text_of(chunk.choices[0])
        if text:
            if ttft is None:
                ttft = time.perf_counter() - start
            parts.append(text)
            print(text, end="", flush=True)
    print()
    total = time.perf_counter() - start
    if stats and ttft is not None and total > 0:
        print(f"{'TTFT:':<5} {ttft * 1000:.2f} ms")
        print(f"{'TPS:':<5} {completion_tokens / total:.2f} tokens/s ({completion_tokens} tokens in {total:.2f}s)")
    return "".join(parts)


def _run_client(args: argparse.Namespace, session: Callable[[Any, str], None]) -> int:
    """Connect, pick the model, run `session(client, model)`; API and connection errors become one stderr line."""
    try:
        import openai
    except ImportError:
        print(f"error: pagedllm {args.command} needs the openai package (pip install openai)", file=sys.stderr)
        return 1
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:  # no "HTTP Request: ..." / retry lines per turn
        for name in ("openai", "httpx", "httpcore", "httpx2", "httpcore2"):  # openai 3.x's client is httpx2
            logging.getLogger(name).setLevel(logging.WARNING)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY", "EMPTY")
    try:
        client = openai.OpenAI(api_key=api_key, base_url=args.url)
        if args.model_name:
            model = args.model_name
        else:
            models = client.models.list().data
            if not models:
                print(f"error: the server at {args.url} lists no models; pass --model-name", file=sys.stderr)
                return 1
            model = models[0].id
        print(f"Using model: {model}", flush=True)
        session(client, model)
    except KeyboardInterrupt:
        print()
        return 0
    except openai.APIError as e:
        print(f"error: {describe_api_error(e, args.url)}", file=sys.stderr)
        return 1
    return 0


def describe_api_error(e: Exception, base_url: str) -> str:
    """One line for an `openai` exception: what failed, where, and the server's message."""
    import openai

    request = getattr(e, "request", None)
    where = f"{request.method} {request.url}" if request is not None else base_url
    if isinstance(e, openai.APITimeoutError):
        text = f"no answer from the server at {base_url} in time ({where})"
    elif isinstance(e, openai.APIConnectionError):
        cause = e.__cause__ or e.__context__
        text = f"cannot reach the server at {base_url} ({where}): {cause or e}"
    elif isinstance(e, openai.APIStatusError):
        text = f"{where} answered {e.status_code}: {_server_message(e)}"
        if e.status_code == 401:
            text += " (check --api-key or $OPENAI_API_KEY)"
    else:  # e.g. an error event inside a stream
        text = f"{where}: {getattr(e, 'message', None) or e}"
    return " ".join(text.split())


def _server_message(e: Any) -> str:
    """The `message` of an OpenAI-style error body, else the body or the exception's text."""
    body = e.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
    return str(body) if body else str(e.message)
