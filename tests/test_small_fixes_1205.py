"""Small fixes, each with the test that failed before it:

- `pagedllm bench cpu-decode-step` on dense (HF safetensors) checkpoints and the Gemma family: it ran GGUF linears
  only, and its "every kernel skipped" figure still ran Gemma's GeGLU and Gemma 3's / Qwen3's q/k norms;
- the server's start-up warm-up request stays out of the request log (--enable-log-requests) and out of /metrics;
- /v1/responses reports cached prompt tokens whatever --enable-prompt-tokens-details says, as vLLM does (a pin: this
  was already so);
- GGUF files whose value head size differs from the key head size are refused, naming both.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import re
import signal
from pathlib import Path

import httpx
import pytest
import torch
from test_models_hf import ENGINE_KW, FAMILIES as LLAMA_FAMILIES, random_checkpoints
from test_models_hf_gemma import FAMILIES as GEMMA_FAMILIES

from pagedllm import LLM
from pagedllm.benchmarks import cpu_decode_step
from pagedllm.kernels import cpu_kernels

KERNELS = cpu_kernels.load_cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="no C compiler: no direct forward to time")
pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = {"llama": LLAMA_FAMILIES["llama"], "gemma3": GEMMA_FAMILIES["gemma3"]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """name → a directory holding transformers' tiny random model of that family (written once per module)."""
    return random_checkpoints(tmp_path_factory, FAMILIES)


# -- 1. bench cpu-decode-step on dense checkpoints and Gemma ---------------------------------------------------------

@needs_kernels
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_decode_step_benchmark_runs_a_dense_checkpoint(name: str, checkpoint, tmp_path: Path) -> None:
    """The benchmark's entry point on a safetensors directory without a tokenizer: both paths timed, the same
    greedy tokens, the dense linears and the LM head timed, the forward taken apart."""
    parser = argparse.ArgumentParser()
    cpu_decode_step.add_args(parser)
    out = tmp_path / "step.json"
    args = parser.parse_args(["--model", str(checkpoint(name)), "--num-prompts", "1", "--output-len", "4",
                              "--output-json", str(out)])
    assert cpu_decode_step.run(args) == 0
    res = json.loads(out.read_text())
    assert res["identical_tokens"] is True
    for path in ("direct", "module"):
        assert res[path]["decode_steps"] == 3  # 4 tokens: one from the prefill, three decode steps
        assert res[path]["ms_per_step"]["forward"] > 0
    kernels = res["kernels_ms"]
    layers = FAMILIES[name].kwargs["num_hidden_layers"]
    assert set(kernels) == {f"{4 * layers} layer linears (dense)", "lm_head linear (dense)",
                            "direct forward, 1 token", "  linears skipped", "  and attention skipped",
                            "  every kernel skipped (Python)"}
    assert all(v > 0 for v in kernels.values())


def _c_functions(fwd) -> dict[str, object]:
    """The direct forward's C entry points (ctypes function pointers), by attribute."""
    return {n: f for n, f in vars(fwd).items() if isinstance(f, ctypes._CFuncPtr)}


@needs_kernels
def test_every_kernel_skipped_runs_no_kernel_on_gemma3(checkpoint, monkeypatch) -> None:
    """Each phase of the forward's breakdown runs the kernels it names and no others: once linears, attention and
    the rest are skipped, not one C kernel nor a dense GEMM runs (Gemma 3 calls GeGLU and the per-head q/k norms)."""
    llm = LLM(model=str(checkpoint("gemma3")), num_gpu_blocks_override=64, block_size=4, max_num_seqs=1,
              **ENGINE_KW)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    fwd = runner.direct_forward
    assert fwd is not None and fwd.gemm_method == "dense" and fwd.activation == "gelu_tanh"
    c_functions = _c_functions(fwd)
    # Every C entry point of the direct forward is one the benchmark knows how to skip.
    assert "_gelu_tanh" in c_functions and set(c_functions) <= {*cpu_decode_step._OTHER_KERNELS, "_attention"}
    hits: set[str] = set()
    for name, f in c_functions.items():
        monkeypatch.setattr(fwd, name, lambda *a, _n=name, _f=f: (hits.add(_n), _f(*a))[1])
    for cls in {type(lin.dense) for layer in fwd.layers for lin in layer.linears}:
        monkeypatch.setattr(cls, "forward", lambda self, x, _f=cls.forward: (hits.add("dense linear"), _f(self, x))[1])
    seen: dict[int, set[str]] = {}

    def once(fn, n: int = 30, reps: int = 5) -> float:  # one call per phase, recording what it ran
        hits.clear()
        fn()
        seen[len(seen)] = set(hits)
        return 1.0

    monkeypatch.setattr(cpu_decode_step, "_best_ms", once)
    times = cpu_decode_step._forward_without_kernels(llm, fwd, context=12)
    assert list(times) == ["direct forward, 1 token", "  linears skipped", "  and attention skipped",
                           "  every kernel skipped (Python)"]
    used = {"_rms", "_heads_norm", "_rope", "_cache", "_attention", "_gelu_tanh", "dense linear"}
    assert seen == {0: used, 1: used - {"dense linear"}, 2: used - {"dense linear", "_attention"}, 3: set()}


# -- 4 and 3. one real server: the warm-up out of the request log and /metrics; /v1/responses' cached tokens ---------

LONG_PROMPT = " ".join(["A lighthouse keeper counts the ships that pass the rocks at night."] * 10)


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("fastapi")
    from conftest_server import SMALL_SERVER_ARGS, RemoteServer

    srv = RemoteServer([*SMALL_SERVER_ARGS, "--enable-log-requests", "--enable-prefix-caching", "--no-dashboard"])
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


def _received(logs: str) -> list[tuple[str, str]]:
    """(request id, prompt) of each request-log line."""
    return re.findall(r"Received request (\S+): prompt: '(.*?)', params:", logs)


def test_warm_up_request_is_not_logged_or_counted(server) -> None:
    from conftest_server import MODEL_NAME, stream_chunks

    from pagedllm.entrypoints.openai.warm_up import WARM_UP_PROMPT

    logs = server.logs()
    assert "warm-up request through the serving path" in logs  # it ran
    assert _received(logs) == []
    m = server.metrics()
    assert m.get("vllm:request_success_total", 0.0) == 0.0  # labelled by reason: absent before a first one
    for name in ("vllm:e2e_request_latency_seconds_count", "vllm:time_to_first_token_seconds_count",
                 "vllm:request_prompt_tokens_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "pagedllm:engine_steps_total"):
        assert m[name] == 0.0, name

    body = {"model": MODEL_NAME, "prompt": "Three facts about owls:", "max_tokens": 3, "ignore_eos": True}
    assert httpx.post(server.url("/v1/completions"), json=body, timeout=120).status_code == 200
    chunks = stream_chunks(server, "/v1/completions", {"prompt": "Two facts about bats:", "max_tokens": 4,
                                                       "ignore_eos": True})
    assert chunks
    m = server.wait_idle()
    assert _received(server.logs()) and [p for _, p in _received(server.logs())] == \
        ["Three facts about owls:", "Two facts about bats:"]
    assert WARM_UP_PROMPT not in [p for _, p in _received(server.logs())]
    assert m["vllm:request_success_total"] == 2.0
    assert m["vllm:e2e_request_latency_seconds_count"] == 2.0
    assert m["vllm:generation_tokens_total"] == 7.0  # 3 + 4: the warm-up's 2 are not there


def test_responses_report_cached_tokens_without_the_details_flag(server) -> None:
    """vLLM's serving_responses always fills input_tokens_details.cached_tokens (the Responses schema requires it);
    --enable-prompt-tokens-details, off here, only adds prompt_tokens_details to chat and completions usage."""
    from conftest_server import MODEL_NAME

    def post(path: str, body: dict) -> dict:
        r = httpx.post(server.url(path), json={"model": MODEL_NAME, "temperature": 0.0, **body}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    first = post("/v1/responses", {"input": LONG_PROMPT, "max_output_tokens": 2})
    again = post("/v1/responses", {"input": LONG_PROMPT, "max_output_tokens": 2})
    assert first["input_tokens"] == again["input_tokens"] > 100
    assert first["input_tokens_details"]["cached_tokens"] < again["input_tokens_details"]["cached_tokens"]
    assert 0 < again["input_tokens_details"]["cached_tokens"] < again["input_tokens"]
    chat = post("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 2})
    assert chat["prompt_tokens"] == again["input_tokens"] and "prompt_tokens_details" not in chat


# -- 5. GGUF value_length != key_length ------------------------------------------------------------------------------

@pytest.mark.parametrize("key_length,value_length", [(16, 32), (None, 8)])
def test_gguf_with_value_length_unlike_key_length_is_refused(key_length, value_length, tmp_path: Path,
                                                             monkeypatch) -> None:
    gguf_writing = pytest.importorskip("gguf_writing")
    import transformers

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      head_dim=key_length or 16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()

    def metadata(w) -> None:
        gguf_writing.add_shape_metadata(w, config, head_dim=False)
        if key_length is not None:
            w.add_key_length(key_length)
        w.add_value_length(value_length)

    path = gguf_writing.write_gguf(model, "llama", tmp_path / "kv.gguf", metadata)
    keys = f"llama.attention.key_length = {key_length}" if key_length else "embedding_length / head_count = 16"
    with pytest.raises(ValueError, match=rf"{re.escape(keys)}.*llama\.attention\.value_length = {value_length}"):
        LLM(model=str(path), **{**gguf_writing.ENGINE_KW, "num_gpu_blocks_override": 8})
