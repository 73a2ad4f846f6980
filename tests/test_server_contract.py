"""The exact request contract (issue #17's table): every row is a 400/413 with OpenAI's error body
naming the field, decided before the engine; limits are configurable; the API key guards every
route that serves or reveals the model."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import httpx
import pytest

pytest.importorskip("fastapi")

from conftest_server import SMALL_SERVER_ARGS, RemoteServer  # noqa: E402
from reliability import error_body_problem  # noqa: E402

KEY = "contract-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Hi"}]
LIMIT_ARGS = ["--max-prompts-per-request", "8", "--max-total-prompt-tokens", "1000", "--max-n", "4",
              "--max-request-body-bytes", "65536", "--max-num-seqs", "16"]


@pytest.fixture(scope="module")
def server():
    # 48 blocks x 16 tokens: a request that can never fit the pool is easy to build.
    args = [a if a != "256" else "48" for a in SMALL_SERVER_ARGS]
    srv = RemoteServer([*args, "--api-key", KEY, "--protect-metrics", *LIMIT_ARGS])
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


def _post(server, path, body, headers=AUTH):
    if isinstance(body, bytes):
        return httpx.post(server.url(path), content=body, headers={**headers, "content-type": "application/json"},
                          timeout=60)
    return httpx.post(server.url(path), json=body, headers=headers, timeout=60)


def cmpl(**kw):
    return ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, **kw})


def chat(**kw):
    return ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, **kw})


# (id, (path, body), status, param, substring of the message (lower case))
TABLE = [
    ("lone-surrogate", ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}'), 400, "prompt", "surrogate"),
    ("lone-surrogate-chat", ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udc00"}]}'),
     400, "messages.0.content", "surrogate"),
    ("lone-surrogate-stop", ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"]}'), 400, "stop", "surrogate"),
    ("mixed-prompt-list", cmpl(prompt=[[1, 2], "x"]), 400, "prompt", "mixes"),
    ("mixed-prompt-flat", cmpl(prompt=[1, "x"]), 400, "prompt", "mixes"),
    ("logit-bias-not-id", cmpl(logit_bias={"x": 1}), 400, "logit_bias", "token ids"),
    ("logit-bias-out-of-vocab", cmpl(logit_bias={"999999999": 5}), 400, "logit_bias", "token ids must be in"),
    ("logit-bias-list", cmpl(logit_bias=[1]), 400, "logit_bias", "valid dictionary"),
    ("logit-bias-value-range", cmpl(logit_bias={"5": 500}), 400, "logit_bias", "[-100, 100]"),
    ("allowed-token-ids-empty", cmpl(allowed_token_ids=[]), 400, "allowed_token_ids", "at least one token id"),
    ("allowed-token-ids-out-of-vocab", chat(allowed_token_ids=[5, 999999999]), 400, "allowed_token_ids",
     "token ids must be in"),
    ("allowed-token-ids-negative", cmpl(allowed_token_ids=[-1]), 400, "allowed_token_ids", "token ids must be in"),
    ("logit-bias-with-beam-search", cmpl(logit_bias={"5": 5}, use_beam_search=True, n=2), 400, "logit_bias",
     "not supported with beam search"),
    ("truncate-below-minus-one", cmpl(truncate_prompt_tokens=-2), 400, "truncate_prompt_tokens", "-1"),
    ("truncate-never-fits", chat(truncate_prompt_tokens=100000), 400, "truncate_prompt_tokens",
     "exceeds the longest prompt"),
    ("chat-role-wizard", chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages.0.role", "'user'"),
    ("chat-user-no-content", chat(messages=[{"role": "user"}]), 400, "messages.0", "needs `content`"),
    ("chat-message-unknown-field", chat(messages=[{"role": "user", "content": "x", "mood": 1}]), 400,
     "messages.0.mood", "unrecognized"),
    ("stream-yes", cmpl(stream="yes"), 400, "stream", "valid boolean"),
    ("n-string", cmpl(n="2"), 400, "n", "valid integer"),
    ("include-usage-string", cmpl(stream=True, stream_options={"include_usage": "y"}), 400,
     "stream_options.include_usage", "valid boolean"),
    ("max-tokens-float", cmpl(max_tokens=2.0), 400, "max_tokens", "valid integer"),
    ("temperature-bool", cmpl(temperature=True), 400, "temperature", "valid number"),
    ("nan", ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}'), 400, "temperature", "finite"),
    ("response-format-type", chat(response_format={"type": "xml"}), 400, "response_format.type", "'json_schema'"),
    ("tools-on-completions", cmpl(tools=[]), 400, "tools", "available on /v1/chat/completions"),
    ("unknown-field", cmpl(temprature=0.5), 400, "temprature", "unrecognized request argument"),
    ("seed-out-of-range", cmpl(seed=2**70), 400, "seed", "less than or equal"),
    ("too-many-prompts", cmpl(prompt=["a"] * 9), 413, "prompt", "at most 8"),
    ("too-many-prompt-tokens", cmpl(prompt=[[17] * 400] * 3), 413, "prompt", "more than 1000 tokens"),
    ("n-above-max", cmpl(n=5, temperature=1.0), 400, "n", "at most 4"),
    ("best-of-above-max", cmpl(n=1, best_of=5, temperature=1.0), 400, "best_of", "at most 4"),
    ("never-fits-pool", cmpl(n=4, temperature=1.0, max_tokens=700), 400, "max_tokens", "could never finish"),
    ("never-fits-pool-chat", chat(n=4, temperature=1.0, max_tokens=None), 400, "max_tokens", "could never finish"),
    ("body-too-large", ("/v1/completions", b'{"prompt": "' + b"a" * 70000 + b'"}'), 413, None, "larger than 65536"),
]


@pytest.mark.parametrize("case", TABLE, ids=[c[0] for c in TABLE])
def test_contract_row(server, case):
    _, (path, body), status, param, text = case
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    assert error_body_problem(r.status_code, r.content) is None, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert text.lower() in err["message"].lower(), err


def test_completions_default_max_tokens_is_16_and_ints_are_floats(server):
    r = _post(server, "/v1/completions", {"prompt": "Hello", "ignore_eos": True, "temperature": 1, "top_p": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16
    # Explicit null: up to the context limit, as vLLM (bounded here by the 768-token pool).
    r = _post(server, "/v1/completions", {"prompt": [17] * 760, "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text


def test_chunked_body_above_limit_is_413(server):
    def chunks():
        for _ in range(20):
            yield b"x" * 8192

    r = httpx.post(server.url("/v1/completions"), content=chunks(),
                   headers={**AUTH, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and error_body_problem(413, r.content) is None, r.text


@pytest.mark.parametrize("path,method", [("/v1/models", "GET"), ("/v1/completions", "POST"),
                                         ("/v1/chat/completions", "POST"), ("/tokenize", "POST"),
                                         ("/detokenize", "POST"), ("/metrics", "GET"), ("/v1/responses", "POST"),
                                         ("/invocations", "POST"), ("/v1/embeddings", "POST"), ("/pooling", "POST"),
                                         ("/classify", "POST"), ("/score", "POST"), ("/rerank", "POST"),
                                         ("/v2/rerank", "POST")])
def test_api_key_guards_model_routes(server, path, method):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.request(method, server.url(path), json={}, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.request(method, server.url(path), json={"prompt": "hi", "messages": CHAT, "tokens": [1],
                                                       "max_tokens": 1},
                         headers=AUTH, timeout=60).status_code in (200, 400)


def test_open_routes_stay_open(server):
    assert httpx.get(server.url("/health")).status_code == 200
    assert httpx.get(server.url("/version")).status_code == 200
    assert httpx.get(server.url("/metrics"), headers=AUTH).status_code == 200
    assert httpx.get(server.url("/ping")).status_code == httpx.post(server.url("/ping")).status_code == 200


def test_api_key_auth_unit():
    from pagedllm.entrypoints.openai.security import ApiKeyAuth

    auth = ApiKeyAuth("k3y")
    assert auth.authorized(b"Bearer k3y")
    assert not auth.authorized(b"Bearer k3") and not auth.authorized(None) and not auth.authorized(b"k3y")
    assert auth.protects("/v1/models") and auth.protects("/tokenize") and not auth.protects("/health")
    assert not auth.protects("/v1x") and not auth.protects("/health") and not auth.protects("/metrics")
    assert ApiKeyAuth("k3y", protect_metrics=True).protects("/metrics")


def test_protect_metrics_needs_api_key():
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--protect-metrics"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--protect-metrics needs --api-key" in (out.stdout + out.stderr)


_UNGUARDED = textwrap.dedent(
    """
    import sys
    from pagedllm import LLM, SamplingParams
    # No `if __name__ == "__main__":` guard, as a new user writes it.
    llm = LLM(sys.argv[1], tensor_parallel_size=int(sys.argv[2]), skip_tokenizer_init=True,
              num_gpu_blocks_override=8, swap_space=0.002)
    out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    print("TOKENS", [list(o.outputs[0].token_ids) for o in out], flush=True)
    """
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=255, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      initializer_range=0.5, bos_token_id=0, eos_token_id=254)
    path = tmp_path_factory.mktemp("tiny_unguarded")
    LlamaForCausalLM(cfg).save_pretrained(str(path), safe_serialization=True)
    return str(path)


@pytest.mark.slow
def test_tensor_parallel_in_an_unguarded_script_works(tiny_dir, tmp_path):
    """A TP script without a __main__ guard: workers are forked (no re-import) and the tokens equal tp=1's."""
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED)
    outs = {}
    for tp in (1, 2):
        p = subprocess.run([sys.executable, str(script), tiny_dir, str(tp)], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "bootstrapping phase" not in p.stderr
        outs[tp] = [ln for ln in p.stdout.splitlines() if ln.startswith("TOKENS")]
    assert outs[1] and outs[1] == outs[2]


def test_start_method_detects_the_guard(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(
        """
        from pagedllm.executor.start_method import started_from_unguarded_main
        def f():
            return started_from_unguarded_main()
        print("TOP", f())
        if __name__ == "__main__":
            print("GUARDED", f())
        """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120).stdout
    assert "TOP True" in out and "GUARDED False" in out
