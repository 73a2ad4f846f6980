"""vLLM's torch profiler (worker/profiler.py): LLM.start_profile() / stop_profile() and the server's POST /start_profile,
/stop_profile write one gzipped Chrome trace per worker to VLLM_TORCH_PROFILER_DIR; without the variable they are off
(a clear error offline, no routes on the server)."""
from __future__ import annotations

import gzip
import json
import logging
import multiprocessing
from pathlib import Path

import httpx
import pytest

from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer
from pagedllm import LLM, SamplingParams
from pagedllm.worker.profiler import PROFILER_DIR_ENV, ProfilerError, TorchProfilerConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
FAST_SERVER_ARGS = [*SMALL_SERVER_ARGS, "--no-dashboard", "--no-warm-up-request"]


def _traces(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.pt.trace.json.gz"))


def _event_names(trace: Path) -> set[str]:
    with gzip.open(trace, "rt") as f:
        return {e.get("name", "") for e in json.load(f)["traceEvents"]}


def _check_model_trace(trace: Path) -> None:
    """The trace holds torch ops and the model runner's forward (Python stacks are on by default, as in vLLM)."""
    names = _event_names(trace)
    assert any(n.startswith("aten::") for n in names), sorted(names)[:50]
    assert any("model_runner.py" in n and "execute_model" in n for n in names), sorted(names)[:50]


class _LogRecords(logging.Handler):
    """The pagedllm logger's messages, for the scenarios below (caplog lives in the test's process, not theirs)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        logger = logging.getLogger("pagedllm")
        logger.addHandler(self)
        logger.setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.messages)


def _in_fresh_process(scenario, *args) -> None:
    """Run `scenario(*args)` in a new Python process and fail with its output if it fails there.

    torch.profiler's Python tracer (with_stack, vLLM's default) can crash a process whose other threads start or
    end while it records (pytorch/pytorch#64795 and kin); the suite's process holds many threads left by earlier
    tests, and a crash there (CI stop 88: SIGSEGV in the tensor-parallel scenario) would end the whole suite."""
    proc = multiprocessing.get_context("spawn").Process(target=scenario, args=args)
    proc.start()
    proc.join(600)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the scenario did not finish in 600 s")
    assert proc.exitcode == 0, f"the scenario's process ended with exit code {proc.exitcode} (its output is above)"


def _offline_profile_scenario(traces_dir: Path) -> None:
    records = _LogRecords()
    llm = LLM(num_gpu_blocks_override=64, max_model_len=256, swap_space=0.01)
    with pytest.raises(ProfilerError, match=r"not running; call start_profile\(\) first"):
        llm.stop_profile()
    llm.start_profile()
    llm.start_profile()
    assert "already running; ignored" in records.text
    text = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0].outputs[0].text
    llm.stop_profile()
    traces = _traces(traces_dir)
    assert len(traces) == 1, list(traces_dir.iterdir())
    assert str(traces[0]) in records.text and "self_cpu_time_total" in records.text  # where it went; the top ops
    _check_model_trace(traces[0])
    with pytest.raises(ProfilerError, match="not running"):
        llm.stop_profile()
    llm.start_profile()  # profiling does not change the output; a new profile gets a trace of its own
    assert llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0].outputs[0].text == text
    llm.stop_profile()
    assert len(_traces(traces_dir)) == 2


def test_offline_profile_writes_a_trace(tmp_path, monkeypatch):
    """start_profile, generate, stop_profile: one *.pt.trace.json.gz in the directory; a second start is ignored
    (vLLM's behaviour); stop without a running profile is a clear error; a second profile writes a second trace."""
    monkeypatch.setenv(PROFILER_DIR_ENV, str(tmp_path))
    _in_fresh_process(_offline_profile_scenario, tmp_path)


@pytest.mark.cuda
def test_cuda_profile_holds_device_kernels(tmp_path, monkeypatch, caplog):
    """On a GPU the trace also records the device's kernels (CUDA activity), the summary sorts by device time, and
    profiling leaves the greedy output as it was."""
    monkeypatch.setenv(PROFILER_DIR_ENV, str(tmp_path))
    llm = LLM(device="cuda", num_gpu_blocks_override=64, max_model_len=256, swap_space=0.01)
    text = llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0].outputs[0].text
    llm.start_profile()
    assert llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0].outputs[0].text == text
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm.stop_profile()
    traces = _traces(tmp_path)
    assert len(traces) == 1, list(tmp_path.iterdir())
    assert "self_device_time_total" in caplog.text
    with gzip.open(traces[0], "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events), sorted({e.get("cat", "") for e in events})


def test_offline_profiler_off_without_the_variable(tmp_path, monkeypatch):
    from tiny_models import TINY_ENGINE_KW, save_tiny_llama

    monkeypatch.delenv(PROFILER_DIR_ENV, raising=False)
    llm = LLM(model=save_tiny_llama(tmp_path), **{**TINY_ENGINE_KW, "num_gpu_blocks_override": 8}, max_model_len=64)
    for call in (llm.start_profile, llm.stop_profile):
        with pytest.raises(ProfilerError, match=PROFILER_DIR_ENV):
            call()


def _tensor_parallel_scenario(tmp_path: Path) -> None:
    from tiny_models import TINY_ENGINE_KW, save_tiny_llama

    llm = LLM(model=save_tiny_llama(tmp_path / "model"), **{**TINY_ENGINE_KW, "num_gpu_blocks_override": 16},
              max_model_len=64, tensor_parallel_size=2, distributed_executor_backend="mp")
    llm.start_profile()
    llm.generate([{"prompt_token_ids": [5, 17, 300]}], GREEDY, use_tqdm=False)
    llm.stop_profile()
    traces = _traces(tmp_path / "traces")
    assert sorted(t.name.split(".")[0].rsplit("-", 1)[1] for t in traces) == ["rank0", "rank1"], traces
    for trace in traces:
        _check_model_trace(trace)
    assert llm.collective_rpc(lambda w: w._profiler) == [None, None]  # every rank stopped


def test_tensor_parallel_every_rank_writes_a_trace(tmp_path, monkeypatch):
    """With two tensor-parallel worker processes each rank records its own process and writes its own trace."""
    monkeypatch.setenv(PROFILER_DIR_ENV, str(tmp_path / "traces"))
    _in_fresh_process(_tensor_parallel_scenario, tmp_path)


def test_profiler_config():
    """The variables (vLLM's defaults: stacks on, the rest off), and profiler_config's keys over them."""
    env = {PROFILER_DIR_ENV: "/tmp/traces", "VLLM_TORCH_PROFILER_RECORD_SHAPES": "1"}
    assert TorchProfilerConfig.from_env(environ={}) == TorchProfilerConfig()
    assert not TorchProfilerConfig.from_env(environ={}).enabled
    config = TorchProfilerConfig.from_env(environ=env)
    assert (config.torch_profiler_dir, config.record_shapes, config.with_stack, config.with_flops) == \
        ("/tmp/traces", True, True, False)
    config = TorchProfilerConfig.from_env('{"profiler": "torch", "torch_profiler_dir": "/tmp/other", '
                                          '"torch_profiler_with_stack": false}', environ=env)
    assert (config.torch_profiler_dir, config.with_stack, config.record_shapes) == ("/tmp/other", False, True)
    for bad, match in [({"torch_profiler_dirr": "x"}, "unknown key"), ({"profiler": "cuda"}, "not supported"),
                       ({"profiler": "torch"}, "needs torch_profiler_dir"), ("{", "JSON object"),
                       ({"torch_profiler_with_flops": "yes"}, "true or false")]:
        with pytest.raises(ValueError, match=match):
            TorchProfilerConfig.from_env(bad, environ={})


def test_server_profile_routes(tmp_path, monkeypatch):
    """A server process started with the variable: POST /start_profile, one completion, POST /stop_profile → a trace
    in the directory (written by the engine-core process); /stop_profile with none running → 409."""
    monkeypatch.delenv(PROFILER_DIR_ENV, raising=False)
    srv = RemoteServer(FAST_SERVER_ARGS, env={PROFILER_DIR_ENV: str(tmp_path)})
    try:
        assert httpx.post(srv.url("/start_profile"), timeout=60).status_code == 200
        r = httpx.post(srv.url("/v1/completions"), timeout=60,
                       json={"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert httpx.post(srv.url("/stop_profile"), timeout=120).status_code == 200
        traces = _traces(tmp_path)
        assert len(traces) == 1, list(tmp_path.iterdir())
        _check_model_trace(traces[0])
        r = httpx.post(srv.url("/stop_profile"), timeout=60)
        assert r.status_code == 409 and "start_profile" in r.json()["error"]["message"], r.text
    finally:
        srv.stop()


def test_server_without_the_variable_has_no_profile_routes(monkeypatch):
    """As vLLM: without VLLM_TORCH_PROFILER_DIR the app `pagedllm serve` builds has no /start_profile, /stop_profile
    (404); with it they sit behind the API key. (In-process, engine-less: a second server process would double the
    file's time.)"""
    from fastapi.testclient import TestClient

    from pagedllm.engine.metrics import EngineMetrics
    from pagedllm.entrypoints.openai.server import build_app
    from pagedllm.entrypoints.openai.serving_common import ServingContext

    monkeypatch.delenv(PROFILER_DIR_ENV, raising=False)
    ctx = ServingContext(engine=None, tokenizer=None, served_model_names=["m"], model_path="m", max_model_len=8,
                         max_n=1)
    # what run_serve passes
    plain = TestClient(build_app(ctx, EngineMetrics("m"), dashboard=False, warm_up=False,
                                 profiler=TorchProfilerConfig.from_env(None).enabled))
    assert plain.post("/start_profile").status_code == 404 and plain.post("/stop_profile").status_code == 404
    keyed = TestClient(build_app(ctx, EngineMetrics("m"), api_key="k", dashboard=False, warm_up=False, profiler=True))
    assert keyed.post("/start_profile").status_code == 401 and keyed.post("/stop_profile").status_code == 401
