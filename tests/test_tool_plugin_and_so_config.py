"""vLLM's `--tool-parser-plugin`, `--exclude-tools-when-tool-choice-none` and `--structured-outputs-config`: a plugin
file's parser parsing whole and streamed outputs, the start-up checks, the rendered prompt with and without tools,
JSON without whitespace and closed objects on the bundled model, the config's errors; then one real server."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import httpx
import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
pytest.importorskip("fastapi")

from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer  # noqa: E402

from pagedllm import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedllm.config import StructuredOutputsConfig  # noqa: E402
from pagedllm.engine.arg_utils import EngineArgs  # noqa: E402
from pagedllm.entrypoints import cli  # noqa: E402
from pagedllm.entrypoints.openai.cli_serve import tool_options  # noqa: E402
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest  # noqa: E402
from pagedllm.entrypoints.openai.serving_chat import render_messages  # noqa: E402
from pagedllm.entrypoints.openai.serving_common import ServingContext  # noqa: E402
from pagedllm.entrypoints.openai.serving_tools import ChatTools  # noqa: E402
from pagedllm.entrypoints.openai.tool_parsers import (  # noqa: E402
    TOOL_PARSERS,
    ToolParser,
    ToolParserManager,
    tool_parser_classes,
    tool_parser_registry,
)

SO = StructuredOutputsParams

# The parser of the README's example: lines "CALL name {json arguments}".
PLUGIN = textwrap.dedent('''
    import json
    from pagedllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
    from pagedllm.entrypoints.openai.tool_parsers.base import ExtractedToolCalls, ParsedToolCall, content_end_before

    @ToolParserManager.register_module(["call_line", "call_line_v2"])
    class CallLineParser(ToolParser):
        def extract(self, text):
            head, sep, rest = text.partition("CALL ")
            if not sep:
                return ExtractedToolCalls(content=text, tool_calls=[])
            try:
                calls = [ParsedToolCall(name, json.dumps(json.loads(args)))
                         for name, _, args in (line.partition(" ") for line in rest.split("CALL "))]
            except ValueError:
                return ExtractedToolCalls(content=text, tool_calls=[])
            return ExtractedToolCalls(content=head.strip() or None, tool_calls=calls)

        def safe_content_end(self, text):
            return content_end_before(text, "CALL ")

    class Unregistered(CallLineParser):  # inherits the parser, not its names
        pass
''')
OUTPUT = 'Let me look.\nCALL get_weather {"city": "Paris", "unit": "C"}\nCALL get_time {"tz": "CET"}'
CALLS = [("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {"tz": "CET"})]


def _tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "Weather in Paris?"}],
                                 tools=[_tool("get_weather"), _tool("get_time")], **kw)


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.fixture()
def plugin(tmp_path) -> str:
    return _write(tmp_path, "my_parsers.py", PLUGIN)


# -- --tool-parser-plugin ------------------------------------------------------------------------------------------
def test_plugin_parser_turns_output_into_tool_calls(plugin):
    parsers = tool_parser_registry(plugin)
    assert set(TOOL_PARSERS) < set(parsers) and {"call_line", "call_line_v2"} <= set(parsers)
    cls = parsers["call_line"]
    assert parsers["call_line_v2"] is cls and issubclass(cls, ToolParser) and cls.tool_parser_names == (
        "call_line", "call_line_v2")
    assert "Unregistered" not in {c.__name__ for c in parsers.values()}
    # Marking mutates nothing global: the built-in table is as it was, and a second load is a module of its own.
    assert "call_line" not in TOOL_PARSERS and tool_parser_registry(plugin)["call_line"] is not cls

    message, finish = ChatTools(_request(), "call_line", parsers).message(OUTPUT, "stop")
    assert message.content == "Let me look." and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == CALLS
    # Not this format: plain content.
    message, finish = ChatTools(_request(), "call_line", parsers).message("CALL me maybe", "stop")
    assert message.content == "CALL me maybe" and not message.tool_calls and finish == "stop"
    # Without --tool-call-parser the plugin's format is detected too (after the built-in ones).
    assert tool_parser_classes(None, parsers)[-1] is cls


def test_plugin_parser_streams(plugin):
    tools = ChatTools(_request(stream=True), "call_line", tool_parser_registry(plugin))
    deltas = []
    for end in range(1, len(OUTPUT) + 1, 3):  # the text as it grows, a few characters a step
        deltas += tools.deltas(0, OUTPUT[:end], finished=False)
    deltas += tools.deltas(0, OUTPUT, finished=True)
    content = "".join(d.content or "" for d in deltas)
    assert content.strip() == "Let me look." and "CALL" not in content  # the call's start was held back
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"name": None, "arguments": ""})
            call["name"] = tc.function.name or call["name"]
            call["arguments"] += tc.function.arguments or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == CALLS
    assert tools.stream_finish_reason(0, "stop") == "tool_calls"


def _serve_args(*argv: str):
    return cli.build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("text, expected", [
    (None, "no such file"),
    ("raise RuntimeError('boom at import')\n", "importing .* failed: RuntimeError: boom at import"),
    ("import json\n", "registers no tool parser; decorate a ToolParser subclass"),
    (PLUGIN.replace('["call_line", "call_line_v2"]', '["hermes"]'), r"\['hermes'\] are built-in parsers"),
    ("from pagedllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager\n"
     "@ToolParserManager.register_module('half')\nclass Half(ToolParser):\n    def extract(self, text): ...\n",
     "Half .* does not define safe_content_end"),
    ("from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager\n"
     "@ToolParserManager.register_module('x')\nclass NotAParser: ...\n",
     "importing .* failed: TypeError: register_module: .* is not a ToolParser subclass"),
])
def test_plugin_start_up_errors(tmp_path, text, expected):
    path = str(tmp_path / "missing.py") if text is None else _write(tmp_path, "bad.py", text)
    with pytest.raises(ValueError, match=f"--tool-parser-plugin.*{expected}"):
        tool_options(_serve_args("--tool-parser-plugin", path))


def test_tool_call_parser_names_are_checked_after_the_plugin_loads(plugin):
    opts = tool_options(_serve_args("--tool-parser-plugin", plugin, "--tool-call-parser", "call_line_v2"))
    assert opts["tool_call_parser"] == "call_line_v2" and "call_line" in opts["tool_parsers"]
    assert not opts["exclude_tools_when_tool_choice_none"]
    with pytest.raises(ValueError, match="--tool-call-parser: unknown tool call parser 'call_lines'; known: "
                                         ".*call_line, call_line_v2.*hermes"):
        tool_options(_serve_args("--tool-parser-plugin", plugin, "--tool-call-parser", "call_lines"))
    with pytest.raises(ValueError, match="unknown tool call parser 'call_line'"):  # no plugin, no such name
        tool_options(_serve_args("--tool-call-parser", "call_line"))
    with pytest.raises(TypeError, match="not a ToolParser subclass"):
        ToolParserManager.register_module("x")(dict)


# -- --exclude-tools-when-tool-choice-none ---------------------------------------------------------------------------
TOOLS_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}; {% endif %}"
                  "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")


def test_exclude_tools_flag_changes_the_prompt_only_for_tool_choice_none(tokenizer):
    def prompt(exclude: bool, **kw) -> str:
        ctx = ServingContext(engine=None, tokenizer=tokenizer, served_model_names=[MODEL_NAME], model_path="",
                             max_model_len=1024, max_n=1, chat_template=TOOLS_TEMPLATE,
                             exclude_tools_when_tool_choice_none=exclude)
        req = _request(**kw)
        return tokenizer.decode(render_messages(ctx, req, ctx.chat_tools(req).template_tools()))

    with_tools = "TOOLS: get_weather get_time; user: Weather in Paris?\nassistant:"
    assert prompt(False, tool_choice="none") == with_tools  # today's behaviour, vLLM's default
    assert prompt(True, tool_choice="none") == "user: Weather in Paris?\nassistant:"
    for choice in ("auto", "required", None, {"type": "function", "function": {"name": "get_time"}}):
        assert prompt(True, tool_choice=choice) == with_tools, choice
    assert _serve_args("--exclude-tools-when-tool-choice-none").exclude_tools_when_tool_choice_none


# -- --structured-outputs-config -----------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
    "required": ["name", "age", "tags"]}


@pytest.fixture(scope="module")
def llm():
    return LLM(num_gpu_blocks_override=64, max_model_len=256, max_num_seqs=8,
               structured_outputs_config={"disable_any_whitespace": True, "disable_additional_properties": True})


def test_disable_any_whitespace_gives_json_without_whitespace(llm):
    engine = llm.llm_engine
    assert engine.config.structured_outputs_config == StructuredOutputsConfig(
        backend="auto", disable_any_whitespace=True, disable_additional_properties=True)
    # Even a request that allows whitespace (compact=False) gets none: the engine's option wins.
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=SO(json=SCHEMA))]
    params += [SamplingParams(temperature=1.0, seed=seed, max_tokens=60,
                              structured_outputs=SO(json=SCHEMA, disable_any_whitespace=seed % 2 == 0))
               for seed in range(5)]
    params.append(SamplingParams(temperature=1.0, seed=9, max_tokens=40, structured_outputs=SO(json_object=True)))
    outs = llm.generate(["Describe a person as JSON:"] * len(params), params, use_tqdm=False)
    for out, p in zip(outs, params):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        value = json.loads(c.text)
        # The output is exactly the compact serialization: no whitespace between any two tokens.
        assert c.text == json.dumps(value, separators=(",", ":"), ensure_ascii=False), c.text
        if p.structured_outputs.json is not None:
            jsonschema.validate(value, {**SCHEMA, "additionalProperties": False})
    # The cache key carries the engine's options: (kind, spec, compact, no whitespace, close objects).
    key = engine.structured_output.cache_key(SO(json=SCHEMA, disable_any_whitespace=False))
    assert key == ("json", json.dumps(SCHEMA), True, True, True)
    assert engine.structured_output.cache_key(SO(regex="a+"))[2:] == (True, False, False)


def _accepts(backend, compiled, tokenizer, text: str) -> bool:
    matcher = backend.new_matcher(compiled)
    return all(backend.accept(matcher, t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_disable_additional_properties_refuses_an_extra_key(llm, tokenizer):
    from pagedllm.structured_output.backends import GuidanceBackend

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    mgr = llm.llm_engine.structured_output  # xgrammar, the engine's options
    compiled = mgr.request(SO(json=schema)).result(timeout=60)
    assert _accepts(mgr.backend, compiled, tokenizer, '{"a":1}')
    assert not _accepts(mgr.backend, compiled, tokenizer, '{"a":1,"b":2}')
    assert not _accepts(mgr.backend, compiled, tokenizer, '{"a": 1}')  # no whitespace either
    # llguidance: objects listing properties were closed already; the option closes patternProperties ones too.
    guidance = GuidanceBackend(tokenizer, 49152, (tokenizer.eos_token_id,), num_threads=1)
    pattern = json.dumps({"type": "object", "patternProperties": {"^x": {"type": "integer"}}})
    closed = guidance.compile(guidance.build("json", pattern, True, True, True))
    opened = guidance.compile(guidance.build("json", pattern, True, True, False))
    assert _accepts(guidance, closed, tokenizer, '{"xa":1}') and _accepts(guidance, opened, tokenizer, '{"xa":1}')
    assert not _accepts(guidance, closed, tokenizer, '{"xa":1,"b":2}')
    assert _accepts(guidance, opened, tokenizer, '{"xa":1,"b":2}')
    plain = guidance.compile(guidance.build("json", json.dumps(schema), True, True, False))
    assert not _accepts(guidance, plain, tokenizer, '{"a":1,"b":2}')


@pytest.mark.parametrize("kwargs, expected", [
    ({"structured_outputs_config": {"backend": "guidance", "bogus": 1}},
     r"unknown structured_outputs_config key\(s\) \['bogus'\]; allowed: \['backend', 'disable_additional_properties', "
     r"'disable_any_whitespace', 'disable_fallback', 'reasoning_parser'\]"),
    ({"structured_outputs_config": "{not json"}, "structured_outputs_config is not valid JSON"),
    ({"structured_outputs_config": '["backend"]'}, "structured_outputs_config must be a JSON object"),
    ({"structured_outputs_config": {"backend": "outlines"}},
     r"structured_outputs_config.backend must be one of \['auto', 'xgrammar', 'guidance'\], got 'outlines'"),
    ({"structured_outputs_config": {"disable_any_whitespace": "yes"}},
     "structured_outputs_config.disable_any_whitespace must be true or false, got 'yes'"),
    ({"structured_outputs_config": {"reasoning_parser": "nope"}},
     "structured_outputs_config.reasoning_parser: reasoning parser 'nope' is not known; known: deepseek_r1"),
    ({"structured_outputs_backend": "guidance", "structured_outputs_config": {"backend": "xgrammar"}},
     "structured_outputs_backend='guidance' and structured_outputs_config.backend='xgrammar' disagree"),
    ({"reasoning_parser": "qwen3", "structured_outputs_config": {"reasoning_parser": "deepseek_r1"}},
     "reasoning_parser='qwen3' and structured_outputs_config.reasoning_parser='deepseek_r1' disagree"),
])
def test_structured_outputs_config_errors(kwargs, expected):
    with pytest.raises(ValueError, match=expected):
        EngineArgs(**kwargs).structured_outputs_settings()


def test_structured_outputs_config_merges_its_shorthands():
    args = EngineArgs.from_cli_args(_serve_args(
        "--structured-outputs-config", '{"backend": "guidance", "disable_fallback": true, "reasoning_parser": ""}',
        "--reasoning-parser", "qwen3"))
    assert args.structured_outputs_settings() == StructuredOutputsConfig(
        backend="guidance", disable_fallback=True, reasoning_parser="qwen3")
    same = EngineArgs(structured_outputs_backend="guidance", structured_outputs_config={"backend": "guidance"})
    assert same.structured_outputs_settings().backend == "guidance"
    assert EngineArgs(structured_outputs_backend="guidance").structured_outputs_settings().backend == "guidance"
    assert EngineArgs().structured_outputs_settings() == StructuredOutputsConfig()


def test_serve_refuses_a_bad_structured_outputs_config(capsys):
    assert cli.main(["serve", "--structured-outputs-config", '{"disable_any_whitespace": true, "typo": 1}']) == 2
    err = capsys.readouterr().err
    assert "unknown structured_outputs_config key(s) ['typo']; allowed:" in err and "disable_fallback" in err


# -- one real server -----------------------------------------------------------------------------------------------
def test_bad_plugin_path_stops_serve_with_the_message(tmp_path):
    missing = str(tmp_path / "nope.py")
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *SMALL_SERVER_ARGS,
                           "--tool-parser-plugin", missing], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert f"--tool-parser-plugin: no such file: '{missing}'" in proc.stderr, proc.stderr[-2000:]


def test_server_with_a_tool_parser_plugin(plugin):
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--no-dashboard", "--no-warm-up-request", "--tool-parser-plugin", plugin,
                        "--tool-call-parser", "call_line", "--exclude-tools-when-tool-choice-none",
                        "--chat-template", TOOLS_TEMPLATE,
                        "--structured-outputs-config", '{"disable_any_whitespace": true}'])
    try:
        assert "tool parser plugin" in srv.logs() and "call_line, call_line_v2" in srv.logs()
        assert [m["id"] for m in httpx.get(srv.url("/v1/models"), timeout=30).json()["data"]] == [MODEL_NAME]

        def chat(**kw) -> dict:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                    "tools": [_tool("get_weather")], "temperature": 0, **kw}
            r = httpx.post(srv.url("/v1/chat/completions"), json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        # "required": the arguments are generated under the function's schema (compact: the config's option).
        out = chat(tool_choice="required", max_tokens=60)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        call = choice["message"]["tool_calls"][0]["function"]
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), _tool("get_weather")["function"]["parameters"])
        # "auto" runs the plugin's parser (this model writes no CALL line: plain content).
        auto = chat(tool_choice="auto", max_tokens=8)
        assert auto["choices"][0]["message"]["content"] and not auto["choices"][0]["message"].get("tool_calls")
        # --exclude-tools-when-tool-choice-none: the prompt of a "none" request has no tools in it.
        none = chat(tool_choice="none", max_tokens=1)
        assert none["usage"]["prompt_tokens"] < auto["usage"]["prompt_tokens"]
    finally:
        assert srv.stop(signal.SIGTERM) == 0, srv.tail()
