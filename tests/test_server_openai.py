"""The OpenAI-compatible server driven by the official `openai` client (real subprocess, real model)."""
from __future__ import annotations

import json
import re
import signal

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SMALL_SERVER_ARGS)
    yield srv
    rc = srv.stop(signal.SIGTERM)
    assert rc == 0, srv.logs()[-3000:]
    logs = srv.logs()
    assert "KV pool 256 blocks x 16 tokens = 4096 tokens" in logs
    assert f"on http://127.0.0.1:{srv.port}" in logs and re.search(r"dtype torch\.(float32|bfloat16)", logs)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    """The offline LLM's greedy completions of PROMPTS, and its prompt log-probs of PROMPTS[0] (k 2): the server
    must produce the same."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(num_gpu_blocks_override=64, max_model_len=1024, swap_space=0.05)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    plp = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    return [o.outputs[0] for o in outs], plp


@pytest.fixture(scope="module")
def llm_greedy(offline):
    return offline[0]


def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.get(server.url("/version")).json()["version"]


def test_greedy_completion_equals_llm_generate(client, llm_greedy):
    for prompt, expected in zip(PROMPTS, llm_greedy):
        resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0.0,
                                         extra_body={"ignore_eos": True})
        assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
        choice = resp.choices[0]
        assert choice.text == expected.text
        assert choice.finish_reason == "length"
        assert resp.usage.completion_tokens == len(expected.token_ids) == 24
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + 24


def test_batch_prompts_and_token_prompts(client, llm_greedy):
    tok = httpx.post(client.base_url.join("/tokenize").__str__(), json={"prompt": PROMPTS[0]}).json()
    resp = client.completions.create(model=MODEL_NAME, prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=24,
                                     temperature=0.0, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [e.text for e in llm_greedy]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=tok["tokens"], max_tokens=24, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == llm_greedy[0].text
    assert by_ids.usage.prompt_tokens == tok["count"]


def test_completion_stream_matches_non_stream(client, llm_greedy):
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0.0,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == llm_greedy[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert sum(1 for c in chunks if c.choices) > 3  # really streamed, not one blob


def test_chat_and_chat_stream(client):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    assert full.usage.completion_tokens <= 16
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_raw_sse_ends_with_done(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.url("/v1/chat/completions"), json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert payloads[0]["choices"][0]["delta"]["role"] == "assistant"
    assert payloads[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_n_greater_than_one(client):
    resp = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, n=3,
                                     temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage.completion_tokens == 24
    assert len({c.text for c in resp.choices}) > 1  # independent samples
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Name a color"}],
                                          n=2, max_tokens=6, temperature=1.0, seed=3, stream=True)
    seen: dict[int, str] = {}
    finished = set()
    for c in chat:
        for ch in c.choices:
            seen[ch.index] = seen.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finished.add(ch.index)
    assert set(seen) == {0, 1} and finished == {0, 1}


def test_seed_reproducibility(client):
    kw = dict(model=MODEL_NAME, prompt="My favourite animal is", max_tokens=12, temperature=1.0, top_p=0.95)
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    c = client.completions.create(seed=99, **kw).choices[0].text
    assert a == b
    assert a != c


def test_logit_bias_and_allowed_token_ids(server, client):
    """OpenAI's logit_bias (completions and chat) and vLLM's allowed_token_ids (extra body) through the official
    client."""
    ids = httpx.post(server.url("/tokenize"), json={"prompt": " banana yes no"}, timeout=30).json()["tokens"]
    banana, yes, no = ids[0], ids[-2], ids[-1]
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                     logit_bias={str(banana): 100}, extra_body={"ignore_eos": True})
    assert resp.choices[0].text == " banana" * 3
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Say anything."}],
                                          max_tokens=5, temperature=1.0, seed=7,
                                          extra_body={"allowed_token_ids": [yes, no], "ignore_eos": True})
    assert chat.choices[0].message.content.replace(" yes", "").replace(" no", "") == ""


def test_bad_words(client):
    kw = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    word = plain.split()[0]
    banned = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "bad_words": [word]}})
    assert word not in banned.choices[0].text.split() and banned.choices[0].text != plain


def test_truncate_prompt_tokens(server, client):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are what runs, are counted, and are echoed."""
    prompt = "Once upon a time, in a land far away,"
    ids = httpx.post(server.url("/tokenize"), json={"prompt": prompt}, timeout=30).json()["tokens"]
    last3 = httpx.post(server.url("/detokenize"), json={"tokens": ids[-3:]}, timeout=30).json()["prompt"]
    cut = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": 3})
    assert cut.usage.prompt_tokens == 3 < len(ids)
    assert cut.choices[0].text.startswith(last3) and not cut.choices[0].text.startswith(prompt)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi there"}],
                                          max_tokens=2, extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


def test_logprobs_completion_and_chat(client):
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0.0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(tlp, abs=1e-4)  # greedy: the chosen token is the best
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_stop_strings_and_echo(client, llm_greedy):
    full = llm_greedy[0].text
    stop = full.strip().split()[1] if len(full.split()) > 1 else full.strip()[:2]
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.text
    assert full.startswith(choice.text)
    echo = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith(PROMPTS[0])
    assert full.startswith(echo.choices[0].text[len(PROMPTS[0]):])


def test_prompt_logprobs_in_vllm_shape(server, client, offline):
    """vLLM's `prompt_logprobs` on both endpoints: per prompt position after the first, the prompt token and the k
    most likely tokens, keyed by token id, each with its log-prob, rank and text; the same figures as offline."""
    plp = offline[1]
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 2})
    got = resp.choices[0].model_extra["prompt_logprobs"]
    assert len(got) == resp.usage.prompt_tokens == len(plp.prompt_token_ids) and got[0] is None
    for pos, (tid, want, entry) in enumerate(zip(plp.prompt_token_ids, plp.prompt_logprobs, got)):
        if pos == 0:
            continue
        assert set(entry) == {str(t) for t in want}
        assert entry[str(tid)]["rank"] == want[tid].rank >= 1
        assert entry[str(tid)]["decoded_token"] == _token_text(client, tid) == want[tid].decoded_token
        by_logprob = sorted(entry.values(), key=lambda e: -e["logprob"])
        assert [e["rank"] for e in by_logprob][:2] == [1, 2]  # the top 2, whether or not the prompt token is one
        for t, e in entry.items():
            assert e["logprob"] == pytest.approx(want[int(t)].logprob, abs=1e-4)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0})
    chat_plp = chat.model_extra["prompt_logprobs"]
    assert len(chat_plp) == chat.usage.prompt_tokens and chat_plp[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in chat_plp[1:])
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert plain.choices[0].model_extra.get("prompt_logprobs") is None
    for body, needle in (({"prompt_logprobs": 2, "stream": True}, "not available when stream is true"),
                         ({"prompt_logprobs": -1}, "prompt_logprobs must be in [0, 20], got -1"),
                         ({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20], got 21")):
        for path, extra in (("/v1/completions", {"prompt": "Hi"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            r = httpx.post(server.url(path), json={"max_tokens": 2, **extra, **body}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
            assert needle in r.json()["error"]["message"]


def _token_text(client, token_id):
    return httpx.post(client.base_url.join("/detokenize").__str__(), json={"tokens": [token_id]}).json()["prompt"]


def test_echo_scores_the_prompt_streamed_or_not(server, client):
    """echo with logprobs carries the prompt's tokens and log-probs first, streamed or not; max_tokens 0 with echo
    returns the prompt alone (OpenAI's and vLLM's way to score a text), without echo it is a 400."""
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=3, temperature=0, echo=True,
                                      logprobs=1)
    n_prompt = whole.usage.prompt_tokens
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == n_prompt + 3 and lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=3, temperature=0,
                                            echo=True, logprobs=1, stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(streamed[0].tokens) >= n_prompt  # the prompt's tokens lead the first chunk
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    got = [v for s in streamed for v in s.token_logprobs]
    assert got[0] is None and got[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    for stream in (False, True):
        scored = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=1,
                                           stream=stream)
        if stream:
            parts = [c.choices[0] for c in scored if c.choices]
            text = "".join(p.text for p in parts)
            tokens = [t for p in parts if p.logprobs for t in p.logprobs.tokens]
            finish = parts[-1].finish_reason
        else:
            choice = scored.choices[0]
            text, tokens, finish = choice.text, choice.logprobs.tokens, choice.finish_reason
            assert scored.usage.completion_tokens == 0
            assert choice.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:n_prompt], abs=1e-4)
        assert text == PROMPTS[1] and tokens == lp.tokens[:n_prompt] and finish == "length"
    # A larger prompt_logprobs alongside: the echoed positions still list the token and the top `logprobs` only.
    both = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=3, temperature=0, echo=True,
                                     logprobs=1, extra_body={"prompt_logprobs": 5})
    for got_top, want_top in zip(both.choices[0].logprobs.top_logprobs, lp.top_logprobs):
        assert (got_top is None) == (want_top is None)
        assert got_top is None or (list(got_top) == list(want_top)
                                   and list(got_top.values()) == pytest.approx(list(want_top.values()), abs=1e-4))
    assert len(both.choices[0].model_extra["prompt_logprobs"][1]) >= 5
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_return_token_ids(server, client, llm_greedy):
    """vLLM's `return_token_ids`: the prompt's token ids and each choice's generated ids, whole or streamed (the
    prompt's in a choice's first chunk, then each chunk's new ids); absent without it."""
    tok = httpx.post(server.url("/tokenize"), json={"prompt": PROMPTS[0]}).json()["tokens"]
    args = dict(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = client.completions.create(**args).choices[0].model_extra
    assert choice["prompt_token_ids"] == tok and choice["token_ids"] == list(llm_greedy[0].token_ids)
    parts = [c.choices[0].model_extra for c in client.completions.create(stream=True, **args) if c.choices]
    assert parts[0]["prompt_token_ids"] == tok and all(p["prompt_token_ids"] is None for p in parts[1:])
    assert [t for p in parts for t in p["token_ids"] or []] == list(llm_greedy[0].token_ids)
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert plain.choices[0].model_extra.get("token_ids") is None

    messages = [{"role": "user", "content": "Name a colour."}]
    chat_tok = httpx.post(server.url("/tokenize"), json={"messages": messages}).json()["tokens"]
    chat_args = dict(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                     extra_body={"return_token_ids": True})
    chat = client.chat.completions.create(**chat_args)
    ids = chat.choices[0].model_extra["token_ids"]
    assert chat.model_extra["prompt_token_ids"] == chat_tok and len(ids) == chat.usage.completion_tokens
    assert httpx.post(server.url("/detokenize"), json={"tokens": ids}).json()["prompt"].startswith(
        chat.choices[0].message.content)
    chunks = list(client.chat.completions.create(stream=True, **chat_args))
    assert chunks[0].model_extra["prompt_token_ids"] == chat_tok
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []] == ids


def test_cache_salt_is_accepted_and_checked(server, client, llm_greedy):
    """vLLM's `cache_salt` reaches the engine (tests/test_memory_sharing.py checks its caching): the same greedy
    text; an empty salt is a 400 naming it, on both endpoints."""
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True, "cache_salt": "s3cret-salt"})
    assert resp.choices[0].text == llm_greedy[0].text
    for path, extra in (("/v1/completions", {"prompt": "Hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        r = httpx.post(server.url(path), json={"max_tokens": 2, "cache_salt": "", **extra}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
        assert "cache_salt must be a non-empty string" in r.json()["error"]["message"]


def test_reset_prefix_cache_needs_dev_mode(server):
    # vLLM serves POST /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1 (test_dashboard tests the route).
    assert httpx.post(server.url("/reset_prefix_cache"), timeout=30).status_code == 404


def test_tokenize_detokenize(server):
    tok = httpx.post(server.url("/tokenize"), json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == 1024
    text = httpx.post(server.url("/detokenize"), json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    chat = httpx.post(server.url("/tokenize"), json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 3


def test_metrics_exposes_vllm_and_pagedllm_names(server, client):
    before = server.metrics()
    client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(server.url("/metrics")).text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
                 "vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:time_per_output_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "pagedllm:kv_slot_utilization", "pagedllm:kv_blocks_saved_by_sharing"]:
        assert name in text, name
    m = server.metrics()
    assert m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert m["vllm:e2e_request_latency_seconds_count"] - before["vllm:e2e_request_latency_seconds_count"] == 1
    assert m["vllm:time_to_first_token_seconds_count"] - before["vllm:time_to_first_token_seconds_count"] == 1
    assert m["pagedllm:kv_slot_utilization"] == 1.0  # idle: nothing allocated, nothing wasted
    # vLLM's per-request histograms: one observation each, the phases within the end-to-end latency, the token counts
    n_prompt = len(httpx.post(server.url("/tokenize"), json={"prompt": "Hi"}).json()["tokens"])
    delta = {k: m[k] - before.get(k, 0.0) for k in m}
    phases = ["queue", "prefill", "decode", "inference"]
    for name in [*(f"vllm:request_{p}_time_seconds" for p in phases), "vllm:request_prompt_tokens",
                 "vllm:request_generation_tokens"]:
        assert delta[f"{name}_count"] == 1, name
    e2e = delta["vllm:e2e_request_latency_seconds_sum"]
    assert all(0 <= delta[f"vllm:request_{p}_time_seconds_sum"] <= e2e + 1e-6 for p in phases)
    assert delta["vllm:request_inference_time_seconds_sum"] == pytest.approx(
        delta["vllm:request_prefill_time_seconds_sum"] + delta["vllm:request_decode_time_seconds_sum"], abs=1e-6)
    assert delta["vllm:request_prompt_tokens_sum"] == n_prompt and delta["vllm:request_generation_tokens_sum"] == 5


def test_embeddings_on_a_generating_model_say_how_to_get_them(server):
    """/v1/embeddings needs an embedding model (--runner pooling): a 400 that says so, as with vLLM."""
    r = httpx.post(server.url("/v1/embeddings"), json={"model": MODEL_NAME, "input": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text
    assert "--runner pooling" in r.json()["error"]["message"]
