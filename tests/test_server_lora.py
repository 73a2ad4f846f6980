"""`pagedllm serve --enable-lora --lora-modules NAME=PATH`: a request whose model is NAME runs with that PEFT adapter
(vLLM's names), beside requests to the base model; checked against peft's merged model on the same weights."""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")
pytest.importorskip("fastapi")

from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer  # noqa: E402
from test_lora import ALL, greedy_reference, make_adapter  # noqa: E402

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, hf_model):
    path = tmp_path_factory.mktemp("smol_lora")
    return path, make_adapter(hf_model, path, 11, ALL, rank=4)


@pytest.fixture(scope="module")
def server(adapter):
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--enable-lora", "--lora-modules", f"smol-lora={adapter[0]}"],
                       env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


def test_models_list_the_adapter(client, adapter):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL_NAME, "smol-lora"}
    assert cards["smol-lora"].model_extra["parent"] == MODEL_NAME
    assert cards["smol-lora"].model_extra["root"] == str(adapter[0])


def test_adapter_and_base_requests_match_their_references(client, adapter, tokenizer, hf_model):
    ids = tokenizer.encode(PROMPT)
    args = dict(prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    with_lora = client.completions.create(model="smol-lora", **args).choices[0].model_extra["token_ids"]
    base = client.completions.create(model=MODEL_NAME, **args).choices[0].model_extra["token_ids"]
    assert with_lora == greedy_reference(adapter[1], ids)
    assert base == greedy_reference(hf_model, ids)
    assert with_lora != base
    chat = client.chat.completions.create(model="smol-lora", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "smol-lora" and chat.usage.completion_tokens >= 1


def test_unknown_model_lists_the_adapters(server):
    r = httpx.post(server.url("/v1/completions"), json={"model": "other", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "smol-lora" in err["message"]


def test_bad_lora_modules_stop_the_server_at_start(tmp_path: Path):
    for extra, message in ((["--enable-lora", "--lora-modules", f"x={tmp_path}"], "no PEFT adapter"),
                           (["--lora-modules", f"x={tmp_path}"], "--lora-modules needs --enable-lora"),
                           (["--enable-lora", "--lora-modules", "x"], "entries are name=path")):
        cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", *extra]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        assert out.returncode != 0 and message in (out.stdout + out.stderr), (extra, out.stderr[-2000:])


def test_adapter_rows_stay_exact_beside_base_rows(client, adapter, tokenizer, hf_model):
    """Concurrent requests to the adapter and to the base model share steps; each keeps its own tokens."""
    import concurrent.futures

    prompts = ["Name a river:", "def add(a, b):", "Once upon a time", PROMPT]
    args = dict(max_tokens=10, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})

    def run(i: int):
        model = "smol-lora" if i % 2 else MODEL_NAME
        choice = client.completions.create(model=model, prompt=prompts[i // 2], **args).choices[0]
        return model, prompts[i // 2], choice.model_extra["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    for model, prompt, tokens in results:
        ref_model = adapter[1] if model == "smol-lora" else hf_model
        assert tokens == greedy_reference(ref_model, tokenizer.encode(prompt), n=10), (model, prompt)


def test_adapters_load_and_unload_at_runtime(server, client, tokenizer, hf_model, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    merged = make_adapter(hf_model, tmp_path, 12, ["q_proj", "v_proj"], rank=4)
    post = lambda path, body: httpx.post(server.url(path), json=body, timeout=60)  # noqa: E731
    r = post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(tmp_path)})
    assert r.status_code == 200 and "added successfully" in r.text, r.text
    assert post("/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(tmp_path)}).status_code == 400
    bad = post("/v1/load_lora_adapter", {"lora_name": "nope", "lora_path": str(tmp_path / "missing")})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert "late" in {m.id for m in client.models.list().data}
    args = dict(prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    tokens = client.completions.create(model="late", **args).choices[0].model_extra["token_ids"]
    assert tokens == greedy_reference(merged, tokenizer.encode(PROMPT), n=8)
    r = post("/v1/unload_lora_adapter", {"lora_name": "late"})
    assert r.status_code == 200 and "removed successfully" in r.text, r.text
    assert "late" not in {m.id for m in client.models.list().data}
    gone = httpx.post(server.url("/v1/completions"), json={"model": "late", "prompt": "hi", "max_tokens": 1})
    assert gone.json()["error"]["code"] == "model_not_found"
    assert post("/v1/unload_lora_adapter", {"lora_name": "late"}).status_code == 404
