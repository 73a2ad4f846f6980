"""A vLLM user's `vllm serve ...` command line on `pagedllm serve`: the YAML --config file and its precedence, the
logging flags (request log, periodic stats line), the HTTP flags (--root-path, --ssl-*, --disable-fastapi-docs), the
response flags (--response-role, --enable-prompt-tokens-details, --enable-force-include-usage) and the model-source
flags accepted without effect (--trust-remote-code, --revision, ...) or with one (--hf-overrides); unit level, then
one real server process that combines them."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import signal
import subprocess
import time
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("fastapi")

from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer, stream_chunks  # noqa: E402

from pagedllm.engine.arg_utils import EngineArgs  # noqa: E402
from pagedllm.engine.stats_logger import LoggingStatLogger, stats_interval_s  # noqa: E402
from pagedllm.entrypoints import cli  # noqa: E402
from pagedllm.entrypoints.openai import cli_serve  # noqa: E402
from pagedllm.entrypoints.openai.protocol import (  # noqa: E402
    ChatCompletionRequest,
    StreamOptions,
    UsageInfo,
    dump,
)
from pagedllm.entrypoints.openai.request_logger import RequestLogger  # noqa: E402
from pagedllm.entrypoints.openai.serving_common import ServingContext  # noqa: E402
from pagedllm.multimodal.media import MediaLimits  # noqa: E402


def _parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


def _write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# -- the parser ------------------------------------------------------------------------------------------------
def test_a_vllm_command_line_parses_and_lands_in_engine_http_and_serving_options(tmp_path):
    config = _write(tmp_path, "serve.yaml", "port: 9123\nenable_prefix_caching: true\ngpu-memory-utilization: 0.8\n")
    args = _parse(
        "serve", "/models/smol", "--config", config, "--disable-log-requests", "--trust-remote-code",
        "--max-model-len", "512", "--enable-prompt-tokens-details", "--hf-overrides", '{"rope_theta": 20000.0}',
        "--root-path", "/api", "--revision", "main", "--tokenizer-revision", "v1", "--download-dir", "/cache",
        "--hf-token", "--tokenizer-mode", "slow", "-tp", "1", "-pp", "1", "--max-seq-len-to-capture", "8192",
        "--disable-log-stats", "--response-role", "bot", "--enable-force-include-usage", "--disable-fastapi-docs",
        "--max_num_seqs", "8",  # vLLM takes underscores in flag names too
    )
    assert args.model_tag == "/models/smol" and args.port == 9123 and args.config == config

    engine = EngineArgs.from_cli_args(args)
    assert (engine.max_model_len, engine.max_num_seqs, engine.enable_prefix_caching) == (512, 8, True)
    assert engine.gpu_memory_utilization == 0.8
    assert json.loads(engine.hf_overrides) == {"rope_theta": 20000.0}
    assert (engine.trust_remote_code, engine.revision, engine.tokenizer_revision) == (True, "main", "v1")
    assert (engine.download_dir, engine.hf_token, engine.tokenizer_mode) == ("/cache", True, "slow")
    assert (engine.tensor_parallel_size, engine.pipeline_parallel_size, engine.max_seq_len_to_capture) == (1, 1, 8192)
    assert engine.disable_log_stats is True
    assert cli_serve.stats_log_interval(engine) is None

    http = cli_serve.http_options(args)
    assert http.root_path == "/api" and http.disable_fastapi_docs is True
    extras = cli_serve.serving_options(args)
    assert extras == {"response_role": "bot", "enable_prompt_tokens_details": True, "enable_force_include_usage": True,
                      "request_logger": None, "media_limits": MediaLimits(), "default_chat_template_kwargs": None,
                      "chat_template_content_format": "auto", "trust_request_chat_template": False}
    assert cli_serve.ssl_options(args) == {}


def test_defaults_match_vllm():
    args = _parse("serve")
    engine = EngineArgs.from_cli_args(args)
    assert engine.disable_log_stats is False and cli_serve.stats_log_interval(engine) == 10.0
    assert cli_serve.serving_options(args) == {"response_role": "assistant", "enable_prompt_tokens_details": False,
                                               "enable_force_include_usage": False, "request_logger": None,
                                               "media_limits": MediaLimits(), "default_chat_template_kwargs": None,
                                               "chat_template_content_format": "auto",
                                               "trust_request_chat_template": False}
    http = cli_serve.http_options(args)
    assert http.root_path == "" and http.disable_fastapi_docs is False
    assert engine.compat_notes() == []  # nothing to warn about


def test_request_log_flags():
    assert cli_serve.serving_options(_parse("serve", "--enable-log-requests"))["request_logger"] == RequestLogger()
    limits = cli_serve.serving_options(_parse("serve", "--allowed-media-domains", "Images.Example", "cdn.example"))
    assert limits["media_limits"] == MediaLimits(allowed_domains=("images.example", "cdn.example"))
    logger = cli_serve.serving_options(_parse("serve", "--enable-log-requests", "--max-log-len", "7"))["request_logger"]
    assert logger == RequestLogger(max_log_len=7)
    # vLLM's two spellings share one switch: the last one given wins.
    assert _parse("serve", "--enable-log-requests", "--disable-log-requests").enable_log_requests is False
    assert _parse("serve", "--disable-log-requests", "--enable-log-requests").enable_log_requests is True


def test_default_chat_template_kwargs_flag():
    """vLLM's --default-chat-template-kwargs: a JSON object, checked at start-up like a request's kwargs."""
    opts = cli_serve.serving_options(_parse("serve", "--default-chat-template-kwargs", '{"enable_thinking": false}'))
    assert opts["default_chat_template_kwargs"] == {"enable_thinking": False}
    for bad in ('[1, 2]', '{"enable_thinking": fals'):
        with pytest.raises(SystemExit):
            _parse("serve", "--default-chat-template-kwargs", bad)
    with pytest.raises(ValueError, match="--default-chat-template-kwargs: .*may not set \\['tools'\\]"):
        cli_serve.serving_options(_parse("serve", "--default-chat-template-kwargs", '{"tools": []}'))


def test_config_file_values_yield_to_the_command_line(tmp_path):
    config = _write(tmp_path, "c.yml", "\n".join([
        "model: /from/config",
        "max_model_len: 256",
        "enforce-eager: true",
        "served-model-name: [first, second]",
        "allowed-origins: ['https://a.example']",
        "speculative-config: {method: ngram, num_speculative_tokens: 3}",
        "no-dashboard: true",
        "uvicorn-log-level: info",
        "api-key: ~",  # null: the flag's default
    ]))
    args = _parse("serve", "--config", config, "--max-model-len", "512", "--no-enforce-eager",
                  "--served-model-name", "cli")
    assert args.model == "/from/config" and args.model_tag is None
    assert args.max_model_len == 512 and args.enforce_eager is False and args.served_model_name == ["cli"]
    assert args.allowed_origins == ["https://a.example"] and args.no_dashboard is True
    assert json.loads(args.speculative_config) == {"method": "ngram", "num_speculative_tokens": 3}
    assert args.uvicorn_log_level == "info" and args.api_key is None

    file_only = _parse("serve", f"--config={config}")
    assert (file_only.max_model_len, file_only.enforce_eager, file_only.served_model_name) == (256, True,
                                                                                              ["first", "second"])


def test_config_file_works_for_generate_too(tmp_path):
    config = _write(tmp_path, "g.yaml", "prompt: [Hello, Bonjour]\nmax-tokens: 3\nchat: false\n")
    args = _parse("generate", "--config", config, "--max-tokens", "5")
    assert args.prompt == ["Hello", "Bonjour"] and args.max_tokens == 5 and args.chat is False


@pytest.mark.parametrize("name,text,expected", [
    ("typo.yaml", "max-modle-len: 5\n", ["unknown key 'max-modle-len'", "Did you mean 'max-model-len'?",
                                          "Allowed keys", "enable-prompt-tokens-details"]),
    ("broken.yaml", "served-model-name: [a\n", ["not valid YAML", "line 2"]),
    ("list.yaml", "- enforce-eager\n", ["expected a mapping of flag names to values", "list"]),
    ("switch.yaml", "enforce-eager: sometimes\n", ["key 'enforce-eager'", "switch: give true or false"]),
    ("value.yaml", "max-model-len: lots\n", ["--max-model-len: invalid int value: 'lots'", "(in --config"]),
    ("config.json", "{}", ["a config file is YAML, named *.yaml or *.yml"]),
    ("nested.yaml", "config: other.yaml\n", ["unknown key 'config'"]),
])
def test_config_file_errors_name_the_problem(tmp_path, capsys, name, text, expected):
    path = _write(tmp_path, name, text)
    with pytest.raises(SystemExit) as exc:
        _parse("serve", "--config", path)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert path in err and all(part in err for part in expected), err


def test_missing_config_file(capsys):
    with pytest.raises(SystemExit):
        _parse("serve", "--config", "/nonexistent/serve.yaml")
    assert "cannot read it" in capsys.readouterr().err


# -- engine options accepted for vLLM's sake ---------------------------------------------------------------------
def test_mistral_tokenizers_and_bad_overrides_are_clear_errors(capsys):
    with pytest.raises(ValueError, match="not mistral_common's; allowed: auto, hf, slow"):
        EngineArgs(tokenizer_mode="mistral").compat_notes()
    with pytest.raises(ValueError, match="hf_overrides is not valid JSON"):
        EngineArgs(hf_overrides="{max_position_embeddings: 1}").compat_notes()
    # The CLI reports them before any engine starts.
    assert cli.main(["serve", "--no-warm-up-request", "--tokenizer-mode", "mistral"]) == 2
    assert "not mistral_common's" in capsys.readouterr().err


def test_pipeline_parallel_size_reaches_the_engine_config():
    """-pp is vLLM's short flag (model/pipeline.py serves it); a non-positive size is a clear error."""
    args = _parse("serve", "-pp", "2", "-tp", "1")
    config = EngineArgs(pipeline_parallel_size=args.pipeline_parallel_size).create_engine_config(2048)
    assert (config.parallel_config.pipeline_parallel_size, config.parallel_config.world_size) == (2, 2)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer, got 0"):
        EngineArgs(pipeline_parallel_size=0).create_engine_config(2048)


def test_options_without_effect_are_one_note_each_and_the_token_is_hidden():
    notes = EngineArgs(trust_remote_code=True, revision="main", download_dir="/d", hf_token="hf_secret",
                       tokenizer_mode="slow", max_seq_len_to_capture=4096).compat_notes()
    text = "; ".join(notes)
    assert len(notes) == 6 and "hf_secret" not in text
    for name in ("trust_remote_code=True", "revision='main'", "download_dir='/d'", "hf_token=***",
                 "tokenizer_mode='slow'", "max_seq_len_to_capture=4096"):
        assert name in text


def test_llm_keyword_arguments_of_vllm_are_accepted():
    args = EngineArgs.from_kwargs(trust_remote_code=True, disable_log_stats=True, hf_overrides={"a": 1},
                                  pipeline_parallel_size=1, tokenizer_mode="auto")
    assert args.disable_log_stats is True and args.hf_overrides == {"a": 1}


def test_hf_overrides_set_config_fields_when_the_model_loads(default_model_dir):
    from transformers import LlamaConfig

    from pagedllm.model.loader import apply_hf_overrides, load_config

    plain = load_config(default_model_dir)
    config = load_config(default_model_dir, hf_overrides='{"max_position_embeddings": 512, "rope_theta": 5000.0}')
    assert (config.max_position_embeddings, config.rope_theta) == (512, 5000.0)
    assert plain.max_position_embeddings != 512 and config.hidden_size == plain.hidden_size

    # A nested object updates a sub-config field by field; a function (the Python API) returns the config.
    outer = LlamaConfig(hidden_size=64)
    outer.text_config = LlamaConfig(hidden_size=32, num_hidden_layers=3)
    apply_hf_overrides(outer, {"text_config": {"hidden_size": 48}})
    assert (outer.text_config.hidden_size, outer.text_config.num_hidden_layers, outer.hidden_size) == (48, 3, 64)
    assert apply_hf_overrides(outer, lambda c: "replaced") == "replaced"
    with pytest.raises(ValueError, match="hf_overrides must be a JSON object such as .*, got list"):
        load_config(default_model_dir, hf_overrides="[1, 2]")
    with pytest.raises(ValueError, match="must be an object of config fields"):
        load_config(default_model_dir, hf_overrides=[1, 2])


def test_hf_overrides_reach_the_engine() -> None:
    """The engine reads its config through the overrides: the context length follows max_position_embeddings."""
    from pagedllm import LLM

    llm = LLM(hf_overrides={"max_position_embeddings": 384}, num_gpu_blocks_override=32, swap_space=0.01)
    assert llm.llm_engine.hf_config.max_position_embeddings == 384
    assert llm.llm_engine.request_checker.max_seq_len == 384


def test_benchmark_serve_flags_round_trip_json_fields() -> None:
    """The HTTP-overhead benchmark rebuilds EngineArgs as serve flags; a dict field travels as JSON."""
    from pagedllm.benchmarks.http_overhead import engine_cli_flags

    flags = engine_cli_flags(EngineArgs(hf_overrides={"max_position_embeddings": 512}, max_num_seqs=8))
    rebuilt = EngineArgs.from_cli_args(cli.build_parser().parse_args(["serve", *flags]))
    assert json.loads(rebuilt.hf_overrides) == {"max_position_embeddings": 512} and rebuilt.max_num_seqs == 8


# -- HTTP options ------------------------------------------------------------------------------------------------
def test_api_key_guards_routes_under_the_root_path():
    from pagedllm.entrypoints.openai.security import ApiKeyAuth
    from pagedllm.entrypoints.openai.server import HttpOptions

    auth = ApiKeyAuth("k", root_path="/api")
    assert auth.protects("/api/v1/models") and auth.protects("/v1/models") and auth.protects("/api/tokenize")
    assert not auth.protects("/api/health") and not auth.protects("/apiv1/models")
    with pytest.raises(ValueError, match="root_path must start with '/'"):
        HttpOptions(root_path="api/")


def test_root_path_and_docs_in_the_app():
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.limits import RequestLimits
    from pagedllm.entrypoints.openai.server import build_app

    ctx = SimpleNamespace(engine=None, limits=RequestLimits(), served_model_names=["m"], model_path="/m",
                          max_model_len=64, lora_modules={}, model_name="m")
    http = cli_serve.http_options(_parse("serve", "--root-path", "/api/"))  # a trailing slash is dropped
    app = build_app(ctx, metrics=None, api_key="k", dashboard=False, warm_up=False, http=http)
    client = TestClient(app)  # no lifespan: the routes below never reach the engine
    for path in ("/api/v1/models", "/v1/models"):
        assert client.get(path).status_code == 401, path  # the key guards the prefixed path too
        assert client.get(path, headers={"Authorization": "Bearer k"}).json()["data"][0]["id"] == "m"
    assert client.get("/api/docs").status_code == 200 and "/api/openapi.json" in client.get("/api/docs").text
    assert client.get("/api/openapi.json").json()["servers"] == [{"url": "/api"}]

    docs_off = cli_serve.http_options(_parse("serve", "--disable-fastapi-docs"))
    client = TestClient(build_app(ctx, metrics=None, dashboard=False, warm_up=False, http=docs_off))
    assert [client.get(p).status_code for p in ("/docs", "/redoc", "/openapi.json")] == [404, 404, 404]


def test_ssl_flags_reach_uvicorn(tmp_path):
    import ssl

    import uvicorn

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost"], check=True, capture_output=True)
    args = _parse("serve", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--ssl-ca-certs", str(cert),
                  "--ssl-cert-reqs", "1")
    tls = cli_serve.ssl_options(args)
    assert tls == {"ssl_keyfile": str(key), "ssl_certfile": str(cert), "ssl_ca_certs": str(cert), "ssl_cert_reqs": 1}
    config = uvicorn.Config(lambda scope, receive, send: None, **tls)
    config.load()
    assert isinstance(config.ssl, ssl.SSLContext) and config.ssl.verify_mode == ssl.CERT_OPTIONAL

    with pytest.raises(ValueError, match="need --ssl-certfile"):
        cli_serve.ssl_options(_parse("serve", "--ssl-keyfile", str(key)))
    with pytest.raises(ValueError, match="no such file: --ssl-certfile /nope.pem"):
        cli_serve.ssl_options(_parse("serve", "--ssl-certfile", "/nope.pem"))


# -- response shape ----------------------------------------------------------------------------------------------
def _ctx(**kw) -> ServingContext:
    return ServingContext(engine=None, tokenizer=None, served_model_names=["m"], model_path="/m", max_model_len=64,
                          max_n=4, **kw)


def test_usage_details_role_and_forced_usage():
    assert dump(_ctx().usage(10, 3, cached_tokens=8)) == {"prompt_tokens": 10, "completion_tokens": 3,
                                                          "total_tokens": 13}
    detailed = dump(_ctx(enable_prompt_tokens_details=True).usage(10, 3, cached_tokens=8))
    assert detailed["prompt_tokens_details"] == {"cached_tokens": 8} and detailed["total_tokens"] == 13
    assert "prompt_tokens_details" not in dump(UsageInfo(prompt_tokens=1))

    plain, forced = _ctx(), _ctx(enable_force_include_usage=True)
    assert plain.stream_usage(None) == (False, False) and forced.stream_usage(None) == (True, False)
    assert forced.stream_usage(StreamOptions(continuous_usage_stats=True)) == (True, True)
    assert plain.stream_usage(StreamOptions(continuous_usage_stats=True)) == (False, False)
    assert plain.stream_usage(StreamOptions(include_usage=True)) == (True, False)

    bot = _ctx(response_role="bot")
    def request(**body) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate_json(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                                     **body}))

    assert bot.chat_role(request()) == "bot"
    # vLLM's: without the generation prompt, the reply continues the last message, in its role.
    assert bot.chat_role(request(add_generation_prompt=False)) == "user"


class _FakeEngine:
    def __init__(self) -> None:
        self.added: list[str] = []

    async def add_request(self, rid, prompt, params, **kw):
        self.added.append(rid)
        return SimpleNamespace(finished=False)


def test_request_log_lines_truncate_the_prompt(caplog):
    tokenizer = SimpleNamespace(decode=lambda ids: "".join(chr(ord("a") + i % 26) for i in ids))
    ctx = _ctx(request_logger=RequestLogger(max_log_len=4))
    ctx.engine, ctx.tokenizer = _FakeEngine(), tokenizer
    with caplog.at_level(logging.INFO, logger="pagedllm.requests"):
        asyncio.run(ctx.add_all([list(range(10))], "PARAMS", "cmpl-x"))
    [line] = [r.getMessage() for r in caplog.records if r.name == "pagedllm.requests"]
    assert line == "Received request cmpl-x-0: prompt: 'abcd', params: PARAMS, prompt_token_ids: [0, 1, 2, 3], " \
                   "lora_request: None."

    caplog.clear()
    ctx.request_logger = None
    with caplog.at_level(logging.INFO, logger="pagedllm.requests"):
        asyncio.run(ctx.add_all([[1, 2]], "PARAMS", "cmpl-y"))
    assert not [r for r in caplog.records if r.name == "pagedllm.requests"]
    with pytest.raises(ValueError, match="max_log_len must be an int >= 0"):
        RequestLogger(max_log_len=-1)


# -- the periodic stats line -------------------------------------------------------------------------------------
def _stats(prompt=0, generated=0, running=0, waiting=0, free=100, queries=0, hits=0) -> dict:
    return {"prompt_tokens_total": prompt, "generation_tokens_total": generated, "num_running": running,
            "num_waiting": waiting, "kv_blocks_total": 100, "kv_blocks_free": free, "prefix_cache_queries": queries,
            "prefix_cache_hits": hits}


def test_stats_line_reports_the_interval_and_quiets_down_when_idle(caplog):
    clock = [100.0]
    snapshots = iter([_stats(), _stats(prompt=1000, generated=200, running=3, waiting=1, free=75, queries=400,
                                       hits=100),
                      _stats(prompt=1000, generated=200, free=100, queries=400, hits=100),
                      _stats(prompt=1000, generated=200, free=100, queries=400, hits=100)])
    stats = LoggingStatLogger(lambda: next(snapshots), clock=lambda: clock[0])
    lines = []
    with caplog.at_level(logging.DEBUG, logger="pagedllm.stats"):
        for _ in range(3):
            clock[0] += 10.0
            lines.append(stats.log())
    assert lines[0] == ("Engine 000: Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
                        "Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
    assert "Avg prompt throughput: 0.0 tokens/s" in lines[1] and "Prefix cache hit rate: 25.0%" in lines[1]
    # Busy, then the line that shows it stopped, at INFO; idle after that: DEBUG only.
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO, logging.DEBUG]


def test_stats_interval_env(monkeypatch):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "2.5")
    assert stats_interval_s() == 2.5 and cli_serve.stats_log_interval(EngineArgs()) == 2.5
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0")
    with pytest.raises(ValueError, match="VLLM_LOG_STATS_INTERVAL must be a number of seconds > 0"):
        stats_interval_s()


@pytest.mark.parametrize("interval", [0.05, None])
def test_the_app_logs_stats_while_it_runs_unless_disabled(caplog, interval):
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.limits import RequestLimits
    from pagedllm.entrypoints.openai.server import build_app

    async def shutdown():
        return None

    engine = SimpleNamespace(start=lambda: None, shutdown=shutdown, num_in_flight=0,
                             stats=lambda: _stats(prompt=int(time.monotonic() * 100), running=1))
    ctx = SimpleNamespace(engine=engine, limits=RequestLimits(), served_model_names=["m"])
    app = build_app(ctx, metrics=None, dashboard=False, warm_up=False, log_stats_interval_s=interval)
    with caplog.at_level(logging.INFO, logger="pagedllm.stats"), TestClient(app):
        time.sleep(0.4)
    lines = [r.getMessage() for r in caplog.records if r.name == "pagedllm.stats"]
    if interval is None:
        assert lines == []
    else:
        assert len(lines) >= 2 and all("Running: 1 reqs" in line for line in lines)


# -- one real server ---------------------------------------------------------------------------------------------
LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog while the cat watches from the fence."] * 12)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = tmp_path_factory.mktemp("cfg") / "serve.yaml"
    config.write_text("enable-prefix-caching: true\ntrust_remote_code: true\nrevision: main\n"
                      "enable-log-requests: true\nenable-log-outputs: true\nmax-log-len: 12\n")
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--config", str(config), "--no-dashboard",
                        "--enable-prompt-tokens-details", "--root-path", "/api", "--disable-fastapi-docs",
                        "--response-role", "bot", "--enable-force-include-usage"],
                       env={"VLLM_LOG_STATS_INTERVAL": "1"})
    yield srv
    rc = srv.stop(signal.SIGTERM)
    assert rc == 0, srv.logs()[-3000:]


def test_server_with_vllm_flags(server):
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(server.url(path), json={"model": MODEL_NAME, **body}, timeout=120)

    # --root-path: the routes answer under the prefix (a proxy that keeps it) and without it (one that strips it).
    assert httpx.get(server.url("/api/v1/models"), timeout=30).json()["data"][0]["id"] == MODEL_NAME
    assert httpx.get(server.url("/v1/models"), timeout=30).status_code == 200
    # --disable-fastapi-docs
    for path in ("/docs", "/redoc", "/openapi.json", "/api/docs", "/api/openapi.json"):
        assert httpx.get(server.url(path), timeout=30).status_code == 404, path

    # --enable-prompt-tokens-details with --enable-prefix-caching: the repeated prompt's blocks come from the cache.
    body = {"prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0.0}
    first_out = post("/api/v1/completions", {**body, "return_token_ids": True}).json()
    first, first_text = first_out["usage"], first_out["choices"][0]["text"]
    first_ids = ", ".join(str(t) for t in first_out["choices"][0]["token_ids"])
    again = post("/api/v1/completions", body).json()["usage"]
    assert first["prompt_tokens"] == again["prompt_tokens"] > 100
    assert first["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens_details"]["cached_tokens"]
    assert 0 < again["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens"]

    # --enable-force-include-usage: a stream without stream_options still ends with a usage chunk (with details).
    chunks = stream_chunks(server, "/api/v1/completions", body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert all(c["usage"] is None for c in chunks[:-1])  # continuous usage stays off

    # --response-role, non-streamed and streamed; chat usage has the details too.
    messages = [{"role": "user", "content": LONG_PROMPT}]
    chat = post("/api/v1/chat/completions", {"messages": messages, "max_tokens": 3}).json()
    assert chat["choices"][0]["message"]["role"] == "bot"
    chat = post("/api/v1/chat/completions", {"messages": messages, "max_tokens": 3}).json()
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    chunks = stream_chunks(server, "/api/v1/chat/completions", {"messages": messages, "max_tokens": 3})
    assert chunks[0]["choices"][0]["delta"]["role"] == "bot"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3

    # The config file's request log (--max-log-len 12), the engine's note on options without effect, the stats line.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and "Avg prompt throughput" not in server.logs():
        time.sleep(0.5)
    logs = server.logs()
    received = re.findall(r"Received request (\S+): prompt: '(.*?)', params: .*?, prompt_token_ids: \[(.*?)\]", logs)
    long_ones = [(rid, ids) for rid, prompt, ids in received if prompt == LONG_PROMPT[:12]]
    assert len(long_ones) == 3 and all(rid.startswith("cmpl-") and len(ids.split(",")) == 12 for rid, ids in long_ones)
    assert sum(rid.startswith("chatcmpl-") for rid, _, _ in received) == 3
    # --enable-log-outputs: each finished completion, streamed or not, its text and ids cut to --max-log-len.
    generated = re.findall(r"Generated response (\S+): output: '(.*?)', output_token_ids: \[(.*?)\], "
                           r"finish_reason: (\w+)\.", logs)
    by_id = {rid: (text, ids, reason) for rid, text, ids, reason in generated}
    assert [by_id[rid] for rid, _ in long_ones] == [(first_text[:12], first_ids, "length")] * 3  # greedy, one streamed
    assert sum(rid.startswith("chatcmpl-") for rid in by_id) == 3
    notes = [line for line in logs.splitlines() if "vLLM options without effect here" in line]
    assert len(notes) == 1 and "trust_remote_code=True" in notes[0] and "revision='main'" in notes[0]
    rates = [float(x) for x in re.findall(r"Avg prompt throughput: ([\d.]+) tokens/s", logs)]
    assert any(rate > 0 for rate in rates), logs[-2000:]


def test_output_log_names_each_finished_completion_once(caplog):
    """--enable-log-outputs: a completion is logged when it finishes and never again, though later cumulative
    outputs repeat it (n > 1); pooling outputs log nothing."""
    import asyncio

    from pagedllm.entrypoints.openai.request_logger import OutputLoggingStream
    from pagedllm.outputs import CompletionOutput, RequestOutput

    def output(done: tuple[bool, bool]) -> RequestOutput:
        outs = [CompletionOutput(i, f"text{i}", [i, i], None, None, "length" if d else None) for i, d in enumerate(done)]
        return RequestOutput("r", "p", [1], outs, all(done))

    class Stream:
        finished = False

        def __init__(self, items):
            self.items = list(items)

        async def __anext__(self):
            if not self.items:
                raise StopAsyncIteration
            return self.items.pop(0)

    async def drain(stream):
        return [o async for o in stream]

    stream = OutputLoggingStream(Stream([output((False, False)), output((True, False)), output((True, True))]),
                                 "cmpl-1", RequestLogger(log_outputs=True))
    assert stream.finished is False  # the wrapped stream's attributes show through
    with caplog.at_level(logging.INFO, logger="pagedllm.requests"):
        assert len(asyncio.run(drain(stream))) == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "pagedllm.requests"]
    assert lines == ["Generated response cmpl-1[0]: output: 'text0', output_token_ids: [0, 0], finish_reason: length.",
                     "Generated response cmpl-1[1]: output: 'text1', output_token_ids: [1, 1], finish_reason: length."]
