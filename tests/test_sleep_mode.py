"""vLLM's sleep mode (LLM.sleep / wake_up / is_sleeping, POST /sleep, /wake_up, GET /is_sleeping), LLM.collective_rpc
and LLM.get_metrics, on the bundled model (one engine for the module) against transformers' greedy tokens, a
tiny random Llama (tensor parallelism, the flag's error) and a real server process."""
from __future__ import annotations

import gc

import httpx
import psutil
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.metrics_reader import Counter, Gauge, Histogram
from pagedllm.engine.sleep_mode import EngineSleepingError
from pagedllm.executor.rpc import WorkerRPCError

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_gpu_blocks_override=64, max_model_len=512, swap_space=0.01, enable_sleep_mode=True,
               enable_prefix_caching=True)


@pytest.fixture(scope="module")
def reference(hf_model, tokenizer) -> list[list[int]]:
    """transformers' greedy continuation of PROMPTS (the independent reference)."""
    out = []
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        with torch.no_grad():
            gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
        out.append(gen[0, len(ids):].tolist())
    return out


def _greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _check_pool_whole(llm: LLM) -> None:
    bm = llm.llm_engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks  # no KV block leaked


def _rss_mib() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


@pytest.mark.parametrize("level", [1, 2])
def test_greedy_tokens_same_after_wake_up(llm, reference, level):
    """Before sleep, after wake_up at either level: transformers' greedy tokens; the pool is whole; memory came back
    to the OS while asleep (level 1: the KV pool's pages; level 2: the weights too)."""
    assert _greedy(llm) == reference
    _check_pool_whole(llm)
    before = _rss_mib()
    llm.sleep(level=level)
    asleep = _rss_mib()
    assert llm.is_sleeping()
    assert before - asleep > (300 if level == 2 else 1)  # the float32 model is ~1.1 GiB with its packed copies
    llm.wake_up()
    assert not llm.is_sleeping()
    assert _greedy(llm) == reference
    _check_pool_whole(llm)


def test_prefix_cache_reset_by_sleep(llm):
    """vLLM resets the prefix cache when the engine sleeps: a repeated prompt hits before, misses right after."""
    prompt = "A cache keeps what was computed so that it need not be computed again. " * 4
    one = SamplingParams(temperature=0.0, max_tokens=1)

    def hits() -> int:
        before = llm.stats()["prefix_cache_hits"]
        llm.generate(prompt, one, use_tqdm=False)
        return llm.stats()["prefix_cache_hits"] - before

    hits()
    assert hits() > 0
    llm.sleep(level=1)
    llm.wake_up()
    assert hits() == 0
    assert hits() > 0


def test_wake_up_by_tags_in_two_calls(llm, reference):
    """The weights first (then e.g. new weights are loaded), the KV cache second; requests are refused until both
    are back. Level 2 the other way round."""
    llm.sleep(level=1)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()
    with pytest.raises(EngineSleepingError, match="kv_cache"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["weights"])  # already awake: nothing to do
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert _greedy(llm) == reference
    llm.sleep(level=2)
    llm.wake_up(tags=["kv_cache"])
    assert llm.is_sleeping()
    llm.wake_up(tags=["weights"])
    assert not llm.is_sleeping()
    assert _greedy(llm) == reference
    _check_pool_whole(llm)


def test_clear_errors(llm, reference):
    with pytest.raises(ValueError, match="level must be one of"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="mode must be one of"):
        llm.sleep(level=1, mode="keep")
    with pytest.raises(ValueError, match="unknown wake_up tag"):
        llm.wake_up(tags=["activations"])
    assert not llm.is_sleeping()
    llm.sleep(level=1)
    with pytest.raises(EngineSleepingError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.sleep(level=2)  # already asleep: a warning, no change
    assert llm.llm_engine._sleep.level == 1
    llm.wake_up()
    llm.wake_up()  # not asleep: a warning
    assert _greedy(llm) == reference


def test_sleep_with_requests_in_flight(llm, reference):
    """mode="wait" refuses (nothing steps an offline engine while it waits); "abort" (vLLM's default) aborts them and
    frees their blocks."""
    engine = llm.llm_engine
    engine.add_request("in-flight", PROMPTS[0], GREEDY)
    engine.step()
    with pytest.raises(ValueError, match="in flight"):
        llm.sleep(level=1, mode="wait")
    assert engine.has_unfinished_requests() and not llm.is_sleeping()
    llm.sleep(level=1)
    assert not engine.has_unfinished_requests()
    _check_pool_whole(llm)
    llm.wake_up()
    assert _greedy(llm) == reference


def test_sleep_needs_the_flag(tmp_path):
    from tiny_models import save_tiny_llama

    tiny = LLM(model=save_tiny_llama(tmp_path), skip_tokenizer_init=True, num_gpu_blocks_override=8, max_model_len=64)
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        tiny.sleep()
    assert not tiny.is_sleeping()


def test_collective_rpc(llm):
    worker = llm.llm_engine.executor.driver_worker
    assert llm.collective_rpc("cache_block_size_bytes") == [worker.cache_block_size_bytes()]
    assert llm.collective_rpc(lambda w, a, b=0: (w.device.type, a + b), args=(1,), kwargs={"b": 2}) == [("cpu", 3)]
    with pytest.raises(ValueError, match="no method 'no_such_method'"):
        llm.collective_rpc("no_such_method")
    with pytest.raises(ValueError, match="no method '_drop_graphs'"):
        llm.collective_rpc("_drop_graphs")


def test_get_metrics_counts_a_generate(llm):
    def by_name():
        return {m.name: m for m in llm.get_metrics()}

    before = by_name()
    assert isinstance(before["vllm:prompt_tokens"], Counter)
    assert isinstance(before["vllm:num_requests_running"], Gauge)
    assert isinstance(before["vllm:e2e_request_latency_seconds"], Histogram)
    assert before["vllm:prompt_tokens"].labels == {"model_name": "SmolLM2-135M-Instruct"}
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    after = by_name()
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    assert after["vllm:prompt_tokens"].value - before["vllm:prompt_tokens"].value == prompt_tokens
    assert after["vllm:generation_tokens"].value - before["vllm:generation_tokens"].value == 2 * GREEDY.max_tokens
    e2e, e2e0 = after["vllm:e2e_request_latency_seconds"], before["vllm:e2e_request_latency_seconds"]
    assert e2e.count - e2e0.count == 2 and e2e.buckets["+Inf"] == e2e.count and e2e.sum > e2e0.sum
    assert after["vllm:request_generation_tokens"].count - before["vllm:request_generation_tokens"].count == 2
    assert after["pagedllm:engine_steps"].value > before["pagedllm:engine_steps"].value
    # The same families, names and types as the server's /metrics renders.
    text = llm._metrics.render().decode()
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE") and not line.split()[2].endswith("_created"):  # (the text format's timestamps)
            _, _, name, kind = line.split()
            types[name.removesuffix("_total") if kind == "counter" else name] = kind
    assert {m.name: types[m.name] for m in llm.get_metrics()} == {
        n: t for n, t in types.items() if t in ("counter", "gauge", "histogram")}


# -- tensor parallelism: every rank sleeps, wakes and answers collective_rpc --------------------------------------
def test_tensor_parallel_sleep_and_collective_rpc(tmp_path):
    from tiny_models import save_tiny_llama

    kw = dict(model=save_tiny_llama(tmp_path), skip_tokenizer_init=True, num_gpu_blocks_override=16,
              max_model_len=64, enable_sleep_mode=True)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": list(range(40, 60))}]
    single = [list(o.outputs[0].token_ids) for o in LLM(**kw).generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(**kw, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert llm.collective_rpc(lambda w: w.tp.rank) == [0, 1]
    assert llm.collective_rpc("cache_block_size_bytes") == [llm.llm_engine.executor.driver.worker
                                                            .cache_block_size_bytes()] * 2

    def fails_on_rank_1(w):
        if w.tp.rank == 1:
            raise KeyError("boom")
        return w.tp.rank

    with pytest.raises(WorkerRPCError, match="(?s)rank 1.*KeyError: 'boom'"):
        llm.collective_rpc(fails_on_rank_1)
    for level in (1, 2):
        llm.sleep(level=level)
        assert llm.collective_rpc(lambda w: (w.sleep_level, sorted(w.asleep))) == [(level, ["kv_cache", "weights"])] * 2
        llm.wake_up(tags=["weights"])
        llm.wake_up(tags=["kv_cache"])
        assert llm.collective_rpc(lambda w: w.sleep_level) == [0, 0]
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == single


# -- the server's routes ----------------------------------------------------------------------------------------
def test_sleep_routes_only_in_dev_mode():
    """vLLM registers /sleep, /wake_up and /is_sleeping only with VLLM_SERVER_DEV_MODE=1 (build_app's dev_mode)."""
    from pagedllm.engine.metrics import EngineMetrics
    from pagedllm.entrypoints.openai.server import build_app
    from pagedllm.entrypoints.openai.serving_common import ServingContext

    ctx = ServingContext(engine=None, tokenizer=None, served_model_names=["m"], model_path="m", max_model_len=8,
                         max_n=1)
    routes = {dev: {r.path for r in build_app(ctx, EngineMetrics("m"), dev_mode=dev, dashboard=False,
                                              warm_up=False).routes} for dev in (False, True)}
    sleep_routes = {"/sleep", "/wake_up", "/is_sleeping"}
    assert sleep_routes <= routes[True] and not sleep_routes & routes[False]


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("fastapi")
    import signal

    from conftest_server import SMALL_SERVER_ARGS, RemoteServer

    srv = RemoteServer([*SMALL_SERVER_ARGS, "--enable-sleep-mode"], env={"VLLM_SERVER_DEV_MODE": "1"})
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


def test_server_sleep_wake_up(server):
    from conftest_server import MODEL_NAME

    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}

    def complete() -> httpx.Response:
        return httpx.post(server.url("/v1/completions"), json=body, timeout=60)

    def sleeping() -> bool:
        r = httpx.get(server.url("/is_sleeping"), timeout=30)
        assert r.status_code == 200
        return r.json()["is_sleeping"]

    first = complete().json()["choices"][0]["text"]
    assert sleeping() is False
    r = httpx.post(server.url("/sleep"), params={"level": 3}, timeout=30)
    assert r.status_code == 400 and "level must be one of" in r.json()["error"]["message"]
    assert httpx.post(server.url("/sleep"), params={"level": 1}, timeout=60).status_code == 200
    assert sleeping() is True
    r = complete()
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_sleeping"
    assert httpx.post(server.url("/wake_up"), params={"tags": "weights"}, timeout=60).status_code == 200
    assert sleeping() is True
    assert complete().status_code == 503
    assert httpx.post(server.url("/wake_up"), params={"tags": "bogus"}, timeout=60).status_code == 400
    assert httpx.post(server.url("/wake_up"), params={"tags": "kv_cache"}, timeout=60).status_code == 200
    assert sleeping() is False
    assert complete().json()["choices"][0]["text"] == first
    assert httpx.post(server.url("/sleep"), params={"level": 2}, timeout=60).status_code == 200
    assert httpx.post(server.url("/wake_up"), timeout=120).status_code == 200
    assert complete().json()["choices"][0]["text"] == first
    m = server.wait_idle()
    assert m["pagedllm:kv_blocks_free"] == m["pagedllm:kv_blocks_total"]


def test_server_sleep_aborts_requests_in_flight(server):
    """mode=abort (vLLM's default): a stream in flight ends with a 503 error event; the pool is whole after."""
    from conftest_server import MODEL_NAME

    body = {"model": MODEL_NAME, "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    assert httpx.post(server.url("/sleep"), params={"level": 1}, timeout=60).status_code == 200
    assert any("engine_sleeping" in e for e in events), events[-3:]
    assert httpx.post(server.url("/wake_up"), timeout=60).status_code == 200
    m = server.wait_idle()
    assert m["pagedllm:kv_blocks_free"] == m["pagedllm:kv_blocks_total"]


# -- CUDA (run by hand on a GPU: pytest -m cuda tests/test_sleep_mode.py) -----------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("level", [1, 2])
def test_cuda_sleep_frees_device_memory_and_recaptures_graphs(level):
    """On a GPU: the weights go to pinned host memory (level 1) or away (level 2) and the KV pool is freed, so
    allocated device memory drops by nearly all of it; after wake_up the CUDA graphs are captured again over the new
    addresses and greedy tokens are unchanged (graph replays included)."""
    llm = LLM(num_gpu_blocks_override=512, max_model_len=1024, enable_sleep_mode=True, gpu_memory_utilization=0.3)
    worker = llm.llm_engine.executor.driver_worker
    ref = _greedy(llm)
    dev = worker.device
    used = torch.cuda.memory_allocated(dev)
    kv_bytes = 2 * sum(k.numel() * k.element_size() for k, _ in worker.cache_engine.slot_gpu_cache)
    llm.sleep(level=level)
    freed = used - torch.cuda.memory_allocated(dev)
    assert freed >= 0.9 * (worker.model_memory_bytes + kv_bytes), (freed, worker.model_memory_bytes, kv_bytes)
    llm.wake_up()
    runner = worker.model_runner
    assert runner.graph_runner is not None and runner.graph_runner.kv_caches is worker.cache_engine.gpu_cache
    assert _greedy(llm) == ref
    _check_pool_whole(llm)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
