"""vLLM's chat-template flags and local media: --chat-template-content-format (and LLM.chat's
chat_template_content_format), --trust-request-chat-template and --allowed-local-media-path. Unit level (detection,
rendering through the real tokenizer, the media path rule, the app built in-process), LLM.chat on the bundled
model, then one real server process that combines the flags."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from types import SimpleNamespace

import httpx
import pytest

pytest.importorskip("fastapi")

from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.chat_content_format import detect_content_format, resolve_content_format  # noqa: E402
from pagedllm.entrypoints import cli  # noqa: E402
from pagedllm.entrypoints.openai import cli_serve  # noqa: E402
from pagedllm.entrypoints.openai.serving_common import ServingContext  # noqa: E402
from pagedllm.multimodal.media import MediaLimits, load_image_url, local_media_file  # noqa: E402
from pagedllm.tokenizer import render_chat_template  # noqa: E402

# Shows which content format reached it: "str:" for a string content, "list:" then the parts' texts for a list.
PROBE_TEMPLATE = ("{% for m in messages %}{{ m.role }}:{% if m.content is string %}str:{{ m.content }}"
                  "{% else %}list:{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %};{% endfor %}")
# ChatML that reads either format (a list's texts joined with nothing, where "string" joins them with "\n").
EITHER_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
                   "{{ m['content'] }}{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TWO_PARTS = [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]


def _parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


# -- detection ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("template", [
    "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
    # llava-hf's style: a filtered loop over the parts
    "{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}{{ p.text }}"
    "{% endfor %}{% endfor %}",
    # through aliases: the messages sliced in a conditional, the content set to a variable
    "{% set loop_messages = messages[1:] if messages[0].role == 'system' else messages %}"
    "{% for message in loop_messages %}{% set parts = message.content %}{% for p in parts %}{{ p.text }}{% endfor %}"
    "{% endfor %}",
    "{% set first = messages[0] %}{% for p in first['content'] %}{{ p.text }}{% endfor %}",
    PROBE_TEMPLATE,
])
def test_templates_that_loop_over_content_are_openai(template):
    assert detect_content_format(template) == "openai"


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m['content'] | string }}{% endfor %}",
    "{% for m in messages %}{{ m.role + ': ' + m.content }}{% endfor %}",
    # a loop over something else (tools) that reads a 'type' key is no content loop
    "{% for m in messages %}{{ m.content }}{% endfor %}{% for t in tools %}{{ t['type'] }}{% endfor %}",
    # a loop over an unrelated variable's 'content'
    "{% for m in messages %}{{ m.content }}{% endfor %}{% for x in documents[0]['content'] %}{{ x }}{% endfor %}",
    "{% for m in messages %",  # does not parse
    "",
])
def test_templates_that_read_content_as_text_are_string(template):
    assert detect_content_format(template) == "string"


def test_the_bundled_models_template_and_the_cache(tokenizer):
    # SmolLM2's template concatenates message['content'] as a string.
    assert "message['content']" in tokenizer.chat_template
    assert detect_content_format(tokenizer.chat_template) == "string"
    hits = detect_content_format.cache_info().hits
    detect_content_format(tokenizer.chat_template)
    assert detect_content_format.cache_info().hits == hits + 1
    assert resolve_content_format("openai", tokenizer.chat_template) == "openai"
    with pytest.raises(ValueError, match=r"one of \['auto', 'string', 'openai'\], got 'json'"):
        resolve_content_format("json", None)


# -- rendering through the real tokenizer --------------------------------------------------------------------------
def test_rendering_in_each_format(tokenizer):
    def render(messages, fmt, template=PROBE_TEMPLATE):
        return render_chat_template(tokenizer, messages, add_generation_prompt=False, chat_template=template,
                                    content_format=fmt)

    plain = [{"role": "system", "content": "Be brief."}, {"role": "assistant", "content": None,
                                                           "tool_calls": [{"id": "1"}]}]
    assert render(TWO_PARTS, "string") == "user:str:Name a \ncolour.;"  # vLLM joins text parts with "\n"
    assert render(TWO_PARTS, "openai") == "user:list:[Name a ][colour.];"
    assert render(TWO_PARTS, "auto") == render(TWO_PARTS, "openai")  # the probe loops over content
    assert render(plain, "openai") == "system:list:[Be brief.];assistant:list:;"  # a string is one part
    assert render(plain, "string") == "system:str:Be brief.;assistant:str:;"
    # The model's own template reads strings: auto renders as string does.
    own = render_chat_template(tokenizer, TWO_PARTS)
    assert own == render_chat_template(tokenizer, TWO_PARTS, content_format="string")
    assert "<|im_start|>user\nName a \ncolour.<|im_end|>" in own
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        render(TWO_PARTS, "parts")


# -- LLM.chat on the bundled model ---------------------------------------------------------------------------------
def test_llm_chat_content_formats_on_the_bundled_model():
    llm = LLM(num_gpu_blocks_override=64, max_model_len=256)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def chat(fmt, template=EITHER_TEMPLATE, params=greedy):
        out = llm.chat(TWO_PARTS, params, use_tqdm=False, chat_template=template, chat_template_content_format=fmt)[0]
        return out.prompt_token_ids, out.outputs[0].token_ids

    as_string, as_openai = chat("string"), chat("openai")
    assert as_openai == chat("auto")  # the template loops over content
    encode = llm.get_tokenizer().encode
    # "string" joins the parts with "\n" (vLLM's rule); the template joins the openai parts with nothing.
    assert as_string[0] == encode("<|im_start|>user\nName a \ncolour.<|im_end|>\n<|im_start|>assistant\n",
                                  add_special_tokens=False)
    assert as_openai[0] == encode("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n",
                                  add_special_tokens=False)
    assert len(as_string[1]) == len(as_openai[1]) == 8
    # A template that tells the two apart gets different prompts.
    one = SamplingParams(temperature=0.0, max_tokens=1)
    assert chat("string", PROBE_TEMPLATE, one)[0] != chat("openai", PROBE_TEMPLATE, one)[0]
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        llm.chat(TWO_PARTS, greedy, use_tqdm=False, chat_template_content_format="text")


# -- --allowed-local-media-path ------------------------------------------------------------------------------------
@pytest.fixture
def media_dirs(tmp_path):
    from PIL import Image

    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    for path, colour in ((allowed / "sub" / "in.png", "red"), (outside / "out.png", "blue")):
        Image.new("RGB", (6, 4), colour).save(path)
    os.symlink(outside / "out.png", allowed / "escape.png")
    os.symlink(allowed / "sub" / "in.png", allowed / "alias.png")
    return allowed, outside


def test_local_media_path_rule(media_dirs):
    allowed, outside = media_dirs
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    img = load_image_url(f"file://{allowed}/sub/in.png", limits)
    assert img.size == (6, 4) and img.convert("RGB").getpixel((0, 0)) == (255, 0, 0)
    assert load_image_url(f"file://{allowed}/alias.png", limits).size == (6, 4)  # a symlink that stays inside
    assert local_media_file(f"file://localhost{allowed}/sub/../sub/in.png", limits) == allowed / "sub" / "in.png"

    refused = {
        f"file://{outside}/out.png": "not under the allowed local media directory .*--allowed-local-media-path",
        f"file://{allowed}/../outside/out.png": "not under the allowed local media directory",
        f"file://{allowed}/escape.png": "not under the allowed local media directory",
        f"file://{allowed}": "not under",  # the directory itself is no file under it
        f"file://{allowed}/missing.png": "could not be read",
        f"file://{allowed}/sub": "could not be read",
        f"file://other.host{allowed}/sub/in.png": "names no remote host",
    }
    for url, message in refused.items():
        with pytest.raises(ValueError, match=message):
            load_image_url(url, limits)
    with pytest.raises(ValueError, match=r"local files \(file://\) are refused.*--allowed-local-media-path DIR"):
        load_image_url(f"file://{allowed}/sub/in.png")  # no directory allowed: no local file
    with pytest.raises(ValueError, match="scheme 'ftp' is not allowed"):
        load_image_url("ftp://example.com/a.png", limits)


def test_local_media_path_flag_is_checked_at_start_up(media_dirs, tmp_path):
    allowed, _ = media_dirs
    link = tmp_path / "link-to-allowed"
    os.symlink(allowed, link)
    limits = cli_serve.serving_options(_parse("serve", "--allowed-local-media-path", str(link)))["media_limits"]
    assert limits == MediaLimits(allowed_local_media_path=str(allowed.resolve()))
    assert cli_serve.serving_options(_parse("serve"))["media_limits"].allowed_local_media_path is None
    with pytest.raises(ValueError, match="--allowed-local-media-path .*nope: no such directory"):
        cli_serve.serving_options(_parse("serve", "--allowed-local-media-path", str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="in.png: not a directory"):
        cli_serve.serving_options(_parse("serve", "--allowed-local-media-path", str(allowed / "sub" / "in.png")))


# -- the flags in the app, in-process ------------------------------------------------------------------------------
def test_flags_parse_with_vllms_defaults():
    opts = cli_serve.serving_options(_parse("serve"))
    assert opts["chat_template_content_format"] == "auto" and opts["trust_request_chat_template"] is False
    opts = cli_serve.serving_options(_parse("serve", "--chat-template-content-format", "openai",
                                            "--trust-request-chat-template"))
    assert opts["chat_template_content_format"] == "openai" and opts["trust_request_chat_template"] is True
    with pytest.raises(SystemExit):
        _parse("serve", "--chat-template-content-format", "json")
    rb = _parse("run-batch", "-i", "in.jsonl", "-o", "out.jsonl", "--chat-template-content-format", "string")
    assert rb.chat_template_content_format == "string" and rb.trust_request_chat_template is False


def _ctx(tokenizer, **fields) -> ServingContext:
    """A context whose handlers below never reach the engine (they stop at the chat template)."""
    return ServingContext(engine=None, tokenizer=tokenizer, served_model_names=[MODEL_NAME], model_path="/m",
                          max_model_len=256, max_n=4, **fields)


def test_request_chat_template_needs_the_trust_flag(tokenizer):
    from fastapi.testclient import TestClient

    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedllm.entrypoints.openai.server import build_app
    from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from pagedllm.entrypoints.openai.serving_common import OpenAIError

    body = {"model": MODEL_NAME, "messages": TWO_PARTS, "chat_template": PROBE_TEMPLATE}
    client = TestClient(build_app(_ctx(tokenizer), metrics=None, dashboard=False, warm_up=False))
    r = client.post("/tokenize", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    assert client.post("/tokenize", json={**body, "chat_template": None}).status_code == 200
    with pytest.raises(OpenAIError, match="start it with --trust-request-chat-template") as refused:
        text_only = {**body, "messages": [{"role": "user", "content": "Name a colour."}]}
        asyncio.run(OpenAIServingChat(_ctx(tokenizer)).create_chat_completion(ChatCompletionRequest(**text_only)))
    assert (refused.value.status, refused.value.param) == (400, "chat_template")

    trusted = _ctx(tokenizer, trust_request_chat_template=True, chat_template_content_format="string")
    r = TestClient(build_app(trusted, metrics=None, dashboard=False, warm_up=False)).post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    assert tokenizer.decode(r.json()["tokens"]) == "user:str:Name a \ncolour.;"


def test_auto_format_is_logged_for_the_default_template(tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm.serve"):
        cli_serve._log_content_format(SimpleNamespace(chat_template_content_format="auto", tokenizer=tokenizer,
                                                      chat_template=None, engine=None))
        cli_serve._log_content_format(SimpleNamespace(chat_template_content_format="auto", tokenizer=tokenizer,
                                                      chat_template=PROBE_TEMPLATE, engine=None))
        cli_serve._log_content_format(SimpleNamespace(chat_template_content_format="string", tokenizer=tokenizer,
                                                      chat_template=None, engine=None))
    lines = [r.getMessage() for r in caplog.records if "content format" in r.getMessage()]
    assert len(lines) == 2
    assert "auto detected 'string' for the model's chat template" in lines[0]
    assert "auto detected 'openai' for the --chat-template chat template" in lines[1]


# -- one real server ---------------------------------------------------------------------------------------------
def test_server_with_the_flags(tmp_path):
    template = tmp_path / "probe.jinja"
    template.write_text(PROBE_TEMPLATE)
    media = tmp_path / "media"
    media.mkdir()
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--no-dashboard", "--no-warm-up-request", "--chat-template", str(template),
                        "--chat-template-content-format", "openai", "--trust-request-chat-template",
                        "--allowed-local-media-path", str(media)])
    try:
        def post(path: str, body: dict) -> httpx.Response:
            return httpx.post(srv.url(path), json={"model": MODEL_NAME, **body}, timeout=60)

        def rendered(**body) -> str:
            r = post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}], **body})
            assert r.status_code == 200, r.text
            return post("/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]

        assert rendered() == "user:list:[Hi];"  # --chat-template, content as OpenAI parts
        assert rendered(chat_template="{{ messages[0].content[0].text }}!") == "Hi!"  # the request's own, trusted
        r = post("/v1/chat/completions", {"messages": TWO_PARTS, "max_tokens": 3, "temperature": 0.0,
                                          "ignore_eos": True, "return_token_ids": True,
                                          "chat_template": EITHER_TEMPLATE})
        assert r.status_code == 200, r.text + srv.logs()[-4000:]
        prompt = post("/detokenize", {"tokens": r.json()["prompt_token_ids"]}).json()["prompt"]
        assert prompt == "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        rc = srv.stop(signal.SIGTERM)
    assert rc == 0, srv.logs()[-3000:]
