"""vLLM's operational `serve` flags: --enable-server-load-tracking (GET /load), --middleware,
--enable-tokenizer-info-endpoint (GET /tokenizer_info), --log-config-file (or VLLM_LOGGING_CONFIG_PATH),
--log-error-stack and the h11 limits; the parser, the loaders and the app in process, then one real server process
with all of them on (and an engine fault injected by a wrapper around the CLI, for --log-error-stack)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import socket
import textwrap
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("fastapi")

from conftest_server import FAULT_INJECTING_LAUNCHER, MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer  # noqa: E402

from pagedllm import log_config  # noqa: E402
from pagedllm.entrypoints import cli  # noqa: E402
from pagedllm.entrypoints.openai import cli_serve, server_ops  # noqa: E402
from pagedllm.entrypoints.openai.serving_common import (  # noqa: E402
    OpenAIError,
    ServingContext,
    error_from_exception,
    log_error_traceback,
)

MIDDLEWARE_MODULE = '''
async def stamp(request, call_next):
    """A function middleware: a header on every response."""
    response = await call_next(request)
    response.headers["x-ops-function"] = "stamped"
    return response


def not_a_middleware(request, call_next):
    return call_next(request)


VALUE = 3


class Chain:
    """An ASGI class middleware: appends its name to x-ops-chain (so the header lists the inner one first)."""

    name = "chain"

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                old = [v for k, v in headers if k == b"x-ops-chain"]
                headers = [(k, v) for k, v in headers if k != b"x-ops-chain"]
                value = (old[0] + b"," if old else b"") + self.name.encode()
                message = {**message, "headers": [*headers, (b"x-ops-chain", value)]}
            await send(message)

        await self.app(scope, receive, tagged)


class Outer(Chain):
    name = "outer"
'''


def _parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


@pytest.fixture()
def mw_module(tmp_path, monkeypatch):
    """A middleware module importable as `ops_test_mw` (from tmp_path)."""
    (tmp_path / "ops_test_mw.py").write_text(MIDDLEWARE_MODULE)
    (tmp_path / "ops_broken_mw.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "ops_test_mw"


# -- the parser ------------------------------------------------------------------------------------------------
def test_defaults_are_vllms():
    args = _parse("serve")
    assert (args.enable_server_load_tracking, args.middleware, args.enable_tokenizer_info_endpoint) == (False, [], False)
    assert (args.log_config_file, args.log_error_stack) == (None, False)
    assert (args.h11_max_incomplete_event_size, args.h11_max_header_count) == (None, None)
    http = cli_serve.http_options(args)
    assert (http.enable_server_load_tracking, http.enable_tokenizer_info_endpoint, http.middleware) == (False, False, ())


def test_the_flags_parse_and_reach_the_http_options(mw_module):
    args = _parse("serve", "--enable-server-load-tracking", "--middleware", f"{mw_module}.Chain", "--middleware",
                  f"{mw_module}.stamp", "--enable-tokenizer-info-endpoint", "--log-config-file", "/etc/log.json",
                  "--log-error-stack", "--h11-max-incomplete-event-size", "65536", "--h11-max-header-count", "100")
    assert args.middleware == [f"{mw_module}.Chain", f"{mw_module}.stamp"]
    assert (args.log_config_file, args.log_error_stack) == ("/etc/log.json", True)
    assert (args.h11_max_incomplete_event_size, args.h11_max_header_count) == (65536, 100)
    http = cli_serve.http_options(args)
    import ops_test_mw

    assert http.enable_server_load_tracking and http.enable_tokenizer_info_endpoint
    assert http.middleware == (ops_test_mw.Chain, ops_test_mw.stamp)
    # --log-error-stack is also run-batch's (a batch line's server-side error logs its traceback).
    assert _parse("run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--log-error-stack").log_error_stack is True


@pytest.mark.parametrize("flag", ["--h11-max-incomplete-event-size", "--h11-max-header-count"])
@pytest.mark.parametrize("value,why", [("0", "expected a positive integer (> 0), got 0"),
                                       ("-3", "expected a positive integer (> 0), got -3"),
                                       ("lots", "expected a positive integer, got 'lots'")])
def test_h11_limits_must_be_positive_integers(capsys, flag, value, why):
    with pytest.raises(SystemExit) as exc:
        _parse("serve", flag, value)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: {why}" in err, err


# -- --middleware ----------------------------------------------------------------------------------------------
def test_middleware_loader_takes_a_class_or_an_async_function(mw_module):
    import ops_test_mw

    assert server_ops.load_middleware(f"{mw_module}.Chain") is ops_test_mw.Chain
    assert server_ops.load_middleware(f"{mw_module}.stamp") is ops_test_mw.stamp


@pytest.mark.parametrize("path,expected", [
    ("ops_missing_mw.Mw", "--middleware 'ops_missing_mw.Mw': cannot import module 'ops_missing_mw' (No module named"),
    ("ops_test_mw.Nope", "--middleware 'ops_test_mw.Nope': module 'ops_test_mw' has no attribute 'Nope'."),
    ("Standalone", "--middleware 'Standalone': expected an import path module.Name"),
    ("ops_test_mw.", "--middleware 'ops_test_mw.': expected an import path module.Name"),
    ("ops_test_mw.not_a_middleware", "expected an ASGI middleware class (built as cls(app)) or an async function "
                                     "(request, call_next), got a function."),
    ("ops_test_mw.VALUE", "got a int."),
    ("ops_broken_mw.Mw", "importing module 'ops_broken_mw' failed: RuntimeError: broken at import"),
])
def test_a_bad_middleware_path_is_a_clear_error(mw_module, path, expected):
    with pytest.raises(ValueError) as exc:
        server_ops.load_middleware(path)
    assert expected in str(exc.value), str(exc.value)


def test_a_bad_middleware_path_stops_serve_before_the_engine_loads(capsys):
    start = time.monotonic()
    assert cli.main(["serve", "--middleware", "ops_missing_mw.Mw"]) == 2
    assert "error: --middleware 'ops_missing_mw.Mw': cannot import module" in capsys.readouterr().err
    assert time.monotonic() - start < 10  # refused up front, no model loaded


# -- the app in process ----------------------------------------------------------------------------------------
def _app(tokenizer, api_key: str | None = None, **http):
    from pagedllm.entrypoints.openai.server import HttpOptions, build_app

    ctx = ServingContext(engine=None, tokenizer=tokenizer, served_model_names=["m"], model_path="/m",
                         max_model_len=64, max_n=1)
    return build_app(ctx, metrics=None, api_key=api_key, dashboard=False, warm_up=False, http=HttpOptions(**http))


def test_load_route_always_answers_and_tokenizer_info_only_when_enabled(tokenizer):
    from fastapi.testclient import TestClient

    plain = TestClient(_app(tokenizer))  # no lifespan: these routes never reach the engine
    assert plain.get("/load").json() == {"server_load": 0}  # vLLM's /load is there without the flag: always 0
    assert plain.get("/tokenizer_info").status_code == 404
    assert "/tokenizer_info" not in plain.get("/openapi.json").json()["paths"]

    client = TestClient(_app(tokenizer, api_key="k", enable_server_load_tracking=True,
                             enable_tokenizer_info_endpoint=True))
    assert client.get("/load").json() == {"server_load": 0}  # open, as /metrics (vLLM's key guards /v1 only)
    assert client.get("/tokenizer_info").status_code == 401  # it can reveal the chat template: behind the key
    info = client.get("/tokenizer_info", headers={"Authorization": "Bearer k"}).json()
    assert info == json.loads(json.dumps(server_ops.tokenizer_info(tokenizer)))
    assert info["tokenizer_class"] == type(tokenizer).__name__


def test_tokenizer_info_is_the_loaded_tokenizer_config(tokenizer, default_model_dir):
    on_disk = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    info = server_ops.tokenizer_info(tokenizer)
    assert json.loads(json.dumps(info)) == info  # plain JSON: AddedTokens as their text, keys as strings
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    assert info["model_max_length"] == on_disk["model_max_length"] == 8192
    assert info["added_tokens_decoder"]["0"] == "<|endoftext|>"
    assert info["chat_template"] == tokenizer.chat_template
    assert not {"vocab_file", "merges_file", "tokenizer_file"} & set(info)
    # --chat-template's template is the one reported (the server renders with it).
    assert server_ops.tokenizer_info(tokenizer, "{{ messages }}")["chat_template"] == "{{ messages }}"


def test_middlewares_wrap_the_app_in_order(tokenizer, mw_module):
    from fastapi.testclient import TestClient

    import ops_test_mw

    client = TestClient(_app(tokenizer, middleware=(ops_test_mw.Chain, ops_test_mw.stamp, ops_test_mw.Outer)))
    r = client.get("/version")
    assert r.status_code == 200 and r.headers["x-ops-function"] == "stamped"
    assert r.headers["x-ops-chain"] == "chain,outer"  # the last given is outermost: it sees the inner one's header
    assert client.get("/nope").headers["x-ops-chain"] == "chain,outer"  # errors pass through them too


# -- the load counter ------------------------------------------------------------------------------------------
def test_server_load_is_thread_safe_and_never_negative():
    load = server_ops.ServerLoad()
    load.leave()
    assert load.value == 0

    def work() -> None:
        for _ in range(2000):
            load.enter()
            load.leave()

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    load.enter()
    for t in threads:
        t.join()
    assert load.value == 1


def _scope(path: str, method: str = "POST", root_path: str = "") -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": root_path,
            "query_string": b"", "headers": [], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}


def test_the_middleware_counts_a_stream_until_it_ends_or_its_client_leaves():
    """Starlette's own StreamingResponse under the middleware: counted while it streams, uncounted when its
    client disconnects (the stream is cancelled) or when it ends, or when the app fails; other routes and
    methods are not counted."""
    from starlette.responses import StreamingResponse

    async def scenario():
        load = server_ops.ServerLoad()
        proceed = asyncio.Event()

        async def tokens():
            yield "data: 1\n\n"
            await proceed.wait()
            yield "data: 2\n\n"

        async def app(scope, receive, send):
            if scope["path"] == "/classify":
                raise RuntimeError("the route failed")
            await StreamingResponse(tokens(), media_type="text/event-stream")(scope, receive, send)

        mw = server_ops.ServerLoadMiddleware(app, load)
        sent: list[dict] = []
        leave = asyncio.Event()

        async def receive():
            await leave.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        # A client that disconnects mid-stream.
        task = asyncio.create_task(mw(_scope("/v1/completions"), receive, send))
        while len(sent) < 2:
            await asyncio.sleep(0.01)
        assert load.value == 1
        leave.set()
        await asyncio.wait_for(task, 5)
        assert load.value == 0 and not proceed.is_set()

        # A stream that ends; under --root-path's prefix too.
        leave.clear()
        sent.clear()
        task = asyncio.create_task(mw(_scope("/api/v1/chat/completions", root_path="/api"), receive, send))
        while len(sent) < 2:
            await asyncio.sleep(0.01)
        assert load.value == 1
        proceed.set()
        await asyncio.wait_for(task, 5)
        assert load.value == 0 and sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}

        with pytest.raises(RuntimeError):
            await mw(_scope("/classify"), receive, send)
        assert load.value == 0

        # Not tracked: another route, a GET; their streams run without the count.
        for scope in (_scope("/tokenize"), _scope("/v1/completions", method="GET")):
            sent.clear()
            proceed.clear()
            task = asyncio.create_task(mw(scope, receive, send))
            while len(sent) < 2:
                await asyncio.sleep(0.01)
            assert load.value == 0
            proceed.set()
            await asyncio.wait_for(task, 5)

    asyncio.run(scenario())


# -- --log-error-stack -----------------------------------------------------------------------------------------
def _engine_failure() -> None:
    raise RuntimeError("boom in the engine")


def test_error_stack_logs_the_engines_traceback_for_server_errors_only(caplog):
    log = logging.getLogger("pagedllm.server")
    try:
        try:
            _engine_failure()
        except RuntimeError as e:
            raise error_from_exception(e) from None  # what the handlers do
    except OpenAIError as err:
        mapped = err
    with caplog.at_level(logging.ERROR, logger="pagedllm.server"):
        log_error_traceback(log, mapped, "POST /v1/completions")
        log_error_traceback(log, OpenAIError("bad max_tokens", param="max_tokens"), "POST /v1/completions")
    [record] = caplog.records
    assert record.getMessage() == ("POST /v1/completions failed with 500 engine_error: the engine failed on this "
                                   "request: RuntimeError: boom in the engine")
    text = caplog.text
    assert "Traceback (most recent call last)" in text and "in _engine_failure" in text

    # A stream's error event: the context logs it only with the flag.
    ctx = ServingContext(engine=None, tokenizer=None, served_model_names=["m"], model_path="/m", max_model_len=8,
                         max_n=1)
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="pagedllm.server"):
        assert ctx.mapped_error(RuntimeError("quiet"), "completion stream x").code == "engine_error"
        ctx.log_error_stack = True
        assert ctx.mapped_error(ValueError("a client's mistake"), "completion stream x").status == 400
        assert ctx.mapped_error(RuntimeError("loud"), "completion stream y").status == 500
    assert [r.getMessage() for r in caplog.records] == [
        "completion stream y failed with 500 engine_error: the engine failed on this request: RuntimeError: loud"]


# -- --log-config-file -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("text,expected", [
    (None, "no such file (expected a JSON file in logging.config.dictConfig form)"),
    ("{\"version\": 1,", "not valid JSON: Expecting property name"),
    ("[1, 2]", "expected a JSON object in logging.config.dictConfig form"),
    ("{\"handlers\": {}}", "logging.config.dictConfig refused it: dictionary doesn't specify a version"),
])
def test_a_bad_log_config_file_is_a_clear_error(tmp_path, text, expected):
    path = tmp_path / "log.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError) as exc:
        log_config.apply_log_config(str(path))
    assert str(exc.value).startswith(f"--log-config-file {str(path)!r}: ") and expected in str(exc.value)


def test_the_log_config_comes_from_the_flag_else_vllms_variable(tmp_path, monkeypatch, capsys):
    missing = str(tmp_path / "nope.json")
    monkeypatch.delenv(log_config.LOGGING_CONFIG_ENV, raising=False)
    assert cli_serve.apply_log_config_file(_parse("serve")) is None
    monkeypatch.setenv(log_config.LOGGING_CONFIG_ENV, missing)
    with pytest.raises(ValueError, match=f"^VLLM_LOGGING_CONFIG_PATH '{missing}': no such file"):
        cli_serve.apply_log_config_file(_parse("serve"))
    other = str(tmp_path / "other.json")
    with pytest.raises(ValueError, match=f"^--log-config-file '{other}': no such file"):
        cli_serve.apply_log_config_file(_parse("serve", "--log-config-file", other))
    assert cli.main(["serve", "--log-config-file", other]) == 2  # before the engine loads
    assert f"error: --log-config-file '{other}': no such file" in capsys.readouterr().err


def test_a_spawned_engine_core_applies_the_servers_log_config(tmp_path):
    """The engine core's own set-up (a fresh interpreter, as spawn makes it) reads VLLM_LOGGING_CONFIG_PATH, which
    the server sets to its --log-config-file (in its own process: dictConfig would reset this one's handlers)."""
    import subprocess
    import sys

    log_file = tmp_path / "core.log"
    config = tmp_path / "log.json"
    config.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log_file)}},
        "loggers": {"pagedllm": {"handlers": ["file"], "level": "INFO"}}}))
    code = ("import logging, sys\nfrom pagedllm.log_config import apply_log_config_from_env\n"
            "logging.basicConfig(level=logging.INFO)\napply_log_config_from_env('engine core')\n"
            "logging.getLogger('pagedllm.engine_core').info('hello from the engine core')\n"
            "open(sys.argv[1], 'w').write('[]')\n"  # changed since the server read it: said, not fatal
            "apply_log_config_from_env('engine core')\n")
    env = {**os.environ, log_config.LOGGING_CONFIG_ENV: str(config)}
    subprocess.run([sys.executable, "-c", code, str(config)], env=env, check=True, timeout=120)
    lines = log_file.read_text().splitlines()
    assert lines[0] == "hello from the engine core"
    assert lines[1].startswith(f"engine core: VLLM_LOGGING_CONFIG_PATH {str(config)!r}: expected a JSON object")


def test_tensor_parallel_workers_apply_the_servers_log_config(tmp_path, monkeypatch):
    """A tensor-parallel worker (spawned) applies VLLM_LOGGING_CONFIG_PATH too: its load lines reach the file's
    handler, stamped with the worker's pid."""
    from test_tensor_parallel import TINY_KW

    from pagedllm import LLM

    log_file = tmp_path / "all.log"
    config = tmp_path / "log.json"
    config.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"pid": {"format": "%(process)d %(name)s %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log_file), "formatter": "pid"}},
        "loggers": {"pagedllm": {"handlers": ["file"], "level": "INFO"}}}))
    monkeypatch.setenv(log_config.LOGGING_CONFIG_ENV, str(config))
    llm = LLM(_tiny_tp_model(tmp_path), tensor_parallel_size=2, distributed_executor_backend="mp", **TINY_KW)
    (worker,) = llm.llm_engine.executor.worker_pids
    pids = {line.split()[0] for line in log_file.read_text().splitlines()}
    assert str(worker) in pids, (worker, pids)


def _tiny_tp_model(tmp_path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    path = tmp_path / "tiny"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


# -- the h11 limits --------------------------------------------------------------------------------------------
def test_h11_options(caplog):
    import inspect

    import uvicorn

    assert server_ops.h11_options(None, None) == {"h11_max_incomplete_event_size": 4194304} | (
        {"h11_max_header_count": 256} if "h11_max_header_count" in inspect.signature(uvicorn.Config).parameters
        else {})
    assert server_ops.h11_options(65536, None)["http"] == "h11"  # httptools would ignore the limit
    with caplog.at_level(logging.WARNING, logger="pagedllm.serve"):
        options = server_ops.h11_options(None, 100)
    if "h11_max_header_count" in inspect.signature(uvicorn.Config).parameters:
        assert options["h11_max_header_count"] == 100 and options["http"] == "h11"
    else:  # this uvicorn has no header-count limit: accepted, ignored, said
        assert "http" not in options and "--h11-max-header-count 100 is ignored" in caplog.text


def test_the_incomplete_event_limit_holds_in_uvicorn():
    """A real uvicorn with h11_options: a request whose headers outgrow the limit is refused, others served."""
    import uvicorn

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off",
                            **server_ops.h11_options(16384, None))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}/"
        assert httpx.get(url, headers={"x-small": "a" * 1000}).text == "ok"
        big = {f"x-big-{i}": "b" * 1000 for i in range(600)}  # more than one read: an incomplete event
        try:
            status = httpx.get(url, headers=big).status_code
        except httpx.ReadError:  # the 400 and the close came while the client still sent: a reset
            status = None
        assert status in (400, None), status  # refused, never served
        assert httpx.get(url).text == "ok"
    finally:
        server.should_exit = True
        thread.join(10)


# -- one real server with every flag on ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("ops")
    (d / "ops_test_mw.py").write_text(MIDDLEWARE_MODULE)
    script = d / "serve_with_fault.py"
    script.write_text(textwrap.dedent(FAULT_INJECTING_LAUNCHER))
    log_file = d / "server.log"
    (d / "log.json").write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(name)s: %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log_file), "formatter": "plain"}},
        "loggers": {"pagedllm": {"handlers": ["file"], "level": "INFO"}},
    }))
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--no-dashboard", "--enable-server-load-tracking",
                        "--middleware", "ops_test_mw.Chain", "--middleware", "ops_test_mw.stamp",
                        "--enable-tokenizer-info-endpoint", "--log-config-file", str(d / "log.json"),
                        "--log-error-stack", "--h11-max-incomplete-event-size", "65536",
                        "--h11-max-header-count", "64"],
                       launcher=[str(script), str(d / "arm")],
                       env={"PYTHONPATH": os.pathsep.join(p for p in (str(d), os.environ.get("PYTHONPATH")) if p)})
    yield SimpleNamespace(srv=srv, arm=d / "arm", log_file=log_file)
    rc = srv.stop(signal.SIGTERM)
    assert rc == 0, srv.logs()[-3000:]


def _load(srv: RemoteServer) -> int:
    return httpx.get(srv.url("/load"), timeout=10).json()["server_load"]


def _wait_load(srv: RemoteServer, value: int, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout
    load = _load(srv)
    while load != value and time.monotonic() < deadline:
        time.sleep(0.05)
        load = _load(srv)
    return load


def _body(max_tokens: int, **extra) -> dict:
    return {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, **extra}


async def _stream(client: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None) -> list[str]:
    events = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if started is not None:
                    started.set()
    return events


def test_load_counts_requests_until_their_responses_and_streams_end(server):
    srv = server.srv
    assert httpx.get(srv.url("/load"), timeout=10).json() == {"server_load": 0}  # idle, after the warm-up request

    async def scenario():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
            whole = asyncio.create_task(client.post("/v1/completions", json=_body(16)))
            started = [asyncio.Event() for _ in range(3)]
            streams = [asyncio.create_task(_stream(client, _body(16), e)) for e in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            during = (await client.get("/load")).json()["server_load"]
            return during, await whole, await asyncio.gather(*streams)

    during, whole, streams = asyncio.run(scenario())
    assert during == 4  # three streams mid-way and the whole request they run beside
    assert whole.status_code == 200 and whole.headers["x-ops-function"] == "stamped"
    assert all(events[-1] == "[DONE]" for events in streams)
    assert _wait_load(srv, 0, timeout=5) == 0

    # Refused requests leave no load behind.
    assert httpx.post(srv.url("/v1/completions"), json=_body(-1), timeout=30).status_code == 400
    unknown = httpx.post(srv.url("/v1/completions"), json={**_body(4), "model": "nope"}, timeout=30)
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert _load(srv) == 0


def test_a_client_that_leaves_mid_stream_is_no_longer_load(server):
    srv = server.srv
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", srv.url("/v1/completions"), json=_body(900, stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    assert _load(srv) == 1
                    break  # closes the connection mid-stream (900 tokens would take minutes)
    assert _wait_load(srv, 0) == 0
    # A whole request whose client gave up (a read timeout) is uncounted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url("/v1/completions"), json=_body(900), timeout=httpx.Timeout(60, read=1.0))
    assert _wait_load(srv, 0) == 0
    m = srv.wait_idle(30)  # the engine aborted both
    assert m["vllm:num_requests_running"] == 0


def test_middlewares_tokenizer_info_and_h11_flags(server, tokenizer):
    srv = server.srv
    for r in (httpx.get(srv.url("/health"), timeout=10), httpx.get(srv.url("/nope"), timeout=10)):
        assert r.headers["x-ops-function"] == "stamped" and r.headers["x-ops-chain"] == "chain", r.headers
    with httpx.stream("POST", srv.url("/v1/completions"), json=_body(2, stream=True), timeout=60) as r:
        assert r.headers["x-ops-chain"] == "chain" and r.headers["x-ops-function"] == "stamped"
        assert list(r.iter_lines())

    info = httpx.get(srv.url("/tokenizer_info"), timeout=10).json()
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert (info["eos_token"], info["model_max_length"]) == ("<|im_end|>", 8192)
    assert info["chat_template"] == tokenizer.chat_template
    assert info == json.loads(json.dumps(server_ops.tokenizer_info(tokenizer)))  # the same files, as loaded

    logs = srv.logs()
    assert "uvicorn runs its h11 HTTP parser" in logs
    import inspect

    import uvicorn

    if "h11_max_header_count" not in inspect.signature(uvicorn.Config).parameters:
        assert "--h11-max-header-count 64 is ignored" in logs


def test_log_config_file_and_error_stack(server):
    srv, arm = server.srv, server.arm

    async def scenario():
        async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
            stream = asyncio.create_task(_stream(client, _body(200)))
            whole = asyncio.create_task(client.post("/v1/completions", json=_body(200)))
            deadline = time.monotonic() + 60
            while srv.metrics()["vllm:num_requests_running"] < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            arm.touch()
            return await asyncio.wait_for(stream, 120), await asyncio.wait_for(whole, 120)

    events, whole = asyncio.run(scenario())
    assert not arm.exists(), "the fault never fired"
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "engine_error"
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert len(errors) == 1 and errors[0]["code"] == "engine_error"
    assert _wait_load(srv, 0) == 0

    deadline = time.monotonic() + 10
    text = server.log_file.read_text()
    while text.count("Traceback (most recent call last)") < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
        text = server.log_file.read_text()
    # The config file's handler got the server's lines (the forked engine core's too: its step's traceback) ...
    assert "INFO pagedllm.serve: logging configured from" in text and "INFO pagedllm.server: engine loop started" in text
    # ... and --log-error-stack's two tracebacks: the whole request's 500 and the stream's error event.
    for head in (r"POST /v1/completions failed with 500 engine_error: ", r"completion stream cmpl-\w+ failed with "
                                                                         r"500 engine_error: "):
        # The record's line, then the traceback: its frames (indented), then the exception's line.
        m = re.search(f"ERROR pagedllm.server: {head}[^\n]*\nTraceback \\(most recent call last\\):\n"
                      f"((?:  [^\n]*\n)+)([^\n]*)", text)
        assert m is not None, text[-3000:]
        assert "merge_streams" in m.group(1) and "injected fault in one step" in m.group(2)
