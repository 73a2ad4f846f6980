"""Tensor parallelism on CPU (gloo): mp and Ray executors against the single-process engine.

Real processes, real collectives, real checkpoints: the bundled SmolLM2 (9 heads / 3 KV heads,
split 6+3 query heads at tp=2) and a tiny random-weight Llama whose single KV head is replicated on
both ranks at tp=2. Failure tests kill or stop a real worker process.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from process_utils import child_pids, pid_running, wait_gone
from tiny_models import PARALLEL_KW, PARALLEL_PROMPTS, output_tokens, parallel_params, save_peaked_tiny_llama

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import shard_attention_heads
from pagedllm.executor.distributed_base import TensorParallelWorkerError
from pagedllm.executor.step_codec import decode_request, encode_request
from pagedllm.worker.model_input import ExecuteModelRequest, SequenceChunk

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
TINY_PROMPTS = PARALLEL_PROMPTS
TINY_KW = PARALLEL_KW
FAILURE_BOUND_S = 60.0  # liveness bound for the failure tests (the failures themselves take seconds)
_tiny_params = parallel_params
_tokens = output_tokens


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A 2-layer Llama with 4 query heads and ONE KV head (replicated at tp=2), vocab 255 (uneven split)."""
    return save_peaked_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), 2, 1, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **TINY_KW)
    out = _tokens(llm.generate(TINY_PROMPTS, _tiny_params(), use_tqdm=False))
    stats = llm.stats()
    return out, stats


# -- the wire format --------------------------------------------------------------------------
def test_step_codec_round_trip():
    rng = np.random.default_rng(0)
    chunks = [
        SequenceChunk(int(rng.integers(0, 1000)), rng.integers(0, 50000, n).tolist(), int(s),
                      rng.integers(0, 500, b).tolist(), sample=bool(k % 2), all_logits=k == 3,
                      table_version=None if k == 2 else k * 7)  # the worker's persistent rows read it
        for k, (n, s, b) in enumerate([(1, 40, 3), (1, 7, 1), (30, 0, 2), (5, 16, 2), (0, 0, 0)])
    ]
    req = ExecuteModelRequest(chunks, [(1, 2), (3, 4)], [(5, 6)], [(7, 8), (9, 10), (11, 12)])
    buf = encode_request(req)
    assert buf.dtype == np.uint8 and buf[0] == 0  # int32 payload: 4 bytes per value
    assert decode_request(buf) == req
    assert decode_request(encode_request(ExecuteModelRequest())) == ExecuteModelRequest()
    big = ExecuteModelRequest([SequenceChunk(2**40, [1], 3, [2**33], True)])
    assert encode_request(big)[0] == 1 and decode_request(encode_request(big)) == big
    with pytest.raises(ValueError, match="dtype code"):
        decode_request(np.array([7, 0, 0, 0, 0], dtype=np.uint8))


# -- equality with tp=1 -------------------------------------------------------------------------
def test_tiny_model_kv_replication_tp2_matches_tp1(tiny_llama_dir, tiny_reference):
    ref, ref_stats = tiny_reference
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="mp", **TINY_KW)
    executor = llm.llm_engine.executor
    try:
        model = executor.driver.worker.model
        qkv = model.model.layers[0].self_attn.qkv_proj
        # 2 of 4 query heads + the one replicated KV head (k and v) on this rank.
        assert tuple(qkv.weight_shape()) == ((2 + 1 + 1) * 16, 64)
        assert executor.driver.worker.cache_engine.gpu_cache[0][0].shape[2] == 1
        assert tuple(model.lm_head.weight_shape()) == (128, 64)  # ceil(255 / 2) vocab rows
        out = _tokens(llm.generate(TINY_PROMPTS, _tiny_params(), use_tqdm=False))
        stats = llm.stats()
        executor.check_health()
    finally:
        executor.shutdown()
    assert out == ref
    # The broadcast carried swap and copy-on-write lists, not only tokens.
    assert stats["num_swap_outs"] > 0 and stats["num_cow_copies"] > 0
    assert (stats["num_swap_outs"], stats["num_cow_copies"]) == (ref_stats["num_swap_outs"], ref_stats["num_cow_copies"])
    assert wait_gone(executor.worker_pids) == []


def test_bundled_model_tp2_matches_tp1():
    """SmolLM2-135M has 9 heads and 3 KV heads: at tp=2 rank 0 owns 2 KV heads (6 query heads), rank 1 one."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]
    kw = dict(num_gpu_blocks_override=48, swap_space=0.01, max_model_len=256)
    ref = LLM(**kw)
    expected = _tokens(ref.generate(prompts, GREEDY, use_tqdm=False))
    del ref
    llm = LLM(tensor_parallel_size=2, **kw)  # backend defaults to mp
    try:
        qkv = llm.llm_engine.executor.driver.worker.model.model.layers[0].self_attn.qkv_proj
        assert tuple(qkv.weight_shape()) == ((6 + 2 + 2) * 64, 576)
        got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    finally:
        llm.llm_engine.executor.shutdown()
    assert got == expected


@pytest.mark.parametrize("heads,kv_heads,tp", [(9, 3, 2), (9, 3, 3), (4, 1, 2), (8, 2, 4), (32, 8, 3), (16, 4, 8)])
def test_head_shards_cover_every_head_with_its_kv_head(heads, kv_heads, tp):
    shards = [shard_attention_heads(heads, kv_heads, tp, r) for r in range(tp)]
    q_heads = [h for s in shards for h in range(s.q_start, s.q_start + s.num_q_heads)]
    assert q_heads == list(range(heads))  # each query head on exactly one rank, in order
    group = heads // kv_heads
    for s in shards:
        needed = {h // group for h in range(s.q_start, s.q_start + s.num_q_heads)}
        assert needed == set(range(s.kv_start, s.kv_start + s.num_kv_heads))
    assert max(s.num_kv_heads for s in shards) - min(s.num_kv_heads for s in shards) <= 1


def test_indivisible_heads_fail_before_any_process_starts():
    with pytest.raises(ValueError, match="tensor_parallel_size \\(4\\) exceeds num_key_value_heads \\(3\\)"):
        LLM(tensor_parallel_size=4, num_gpu_blocks_override=8, swap_space=0.01, max_model_len=64)
    with pytest.raises(ValueError, match="'uni' runs one process"):
        LLM(tensor_parallel_size=3, distributed_executor_backend="uni", num_gpu_blocks_override=8, swap_space=0.01)


def test_ray_executor_matches_tp1_and_fails_on_actor_death(tiny_llama_dir, tiny_reference, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ADDRESS", "local")  # a private local cluster, never someone else's
    ref, _ = tiny_reference
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, distributed_executor_backend="ray", **TINY_KW)
    executor = llm.llm_engine.executor
    try:
        out = _tokens(llm.generate(TINY_PROMPTS, _tiny_params(), use_tqdm=False))
        executor.check_health()
        assert out == ref
        _start_requests(llm)
        ray.kill(executor._workers[0])
        t0 = time.monotonic()
        with pytest.raises(TensorParallelWorkerError, match="ray executor .*worker rank 1"):
            while llm.llm_engine.has_unfinished_requests():
                llm.llm_engine.step()
        assert time.monotonic() - t0 < FAILURE_BOUND_S
    finally:
        executor.shutdown()
    assert not ray.is_initialized()  # the executor started the local cluster, so it stopped it


# -- failures -----------------------------------------------------------------------------------
def _start_requests(llm: LLM, n_steps: int = 2) -> None:
    engine = llm.llm_engine
    for i, p in enumerate(TINY_PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    for _ in range(n_steps):
        engine.step()


def test_killed_worker_fails_requests_and_leaves_no_orphans(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **TINY_KW)
    engine, executor = llm.llm_engine, llm.llm_engine.executor
    pids = list(executor.worker_pids)
    try:
        _start_requests(llm)
        os.kill(pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelWorkerError, match="worker rank 1 .*killed by SIGKILL"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - t0 < FAILURE_BOUND_S
        with pytest.raises(TensorParallelWorkerError, match="cannot continue"):
            executor.check_health()
        # The offline API fails its batch with the same error and leaves nothing pending.
        engine.abort_request([f"r{i}" for i in range(len(TINY_PROMPTS))])
        with pytest.raises(TensorParallelWorkerError):
            llm.generate(TINY_PROMPTS[:2], GREEDY, use_tqdm=False)
        assert not engine.has_unfinished_requests()
    finally:
        executor.shutdown()
    assert wait_gone(pids) == []


def test_hung_worker_times_out(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_DIST_TIMEOUT_S", "3")
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **TINY_KW)
    engine, executor = llm.llm_engine, llm.llm_engine.executor
    pids = list(executor.worker_pids)
    try:
        _start_requests(llm)
        os.kill(pids[0], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelWorkerError, match="a model step failed"):
            engine.step()
        assert time.monotonic() - t0 < FAILURE_BOUND_S
    finally:
        executor.shutdown()  # SIGKILL reaches a stopped process
        for pid in pids:
            if pid_running(pid):
                os.kill(pid, signal.SIGCONT)
    assert wait_gone(pids) == []


def test_health_check_notices_a_hung_idle_worker(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_DIST_TIMEOUT_S", "2")
    llm = LLM(tiny_llama_dir, tensor_parallel_size=2, **TINY_KW)
    executor = llm.llm_engine.executor
    pids = list(executor.worker_pids)
    try:
        executor.check_health()  # all answer
        os.kill(pids[0], signal.SIGSTOP)
        with pytest.raises(TensorParallelWorkerError, match="health check"):
            executor.check_health()
    finally:
        executor.shutdown()
        for pid in pids:
            if pid_running(pid):
                os.kill(pid, signal.SIGCONT)
    assert wait_gone(pids) == []


_ORPHAN_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pagedllm import LLM
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], tensor_parallel_size=2, skip_tokenizer_init=True,
                  num_gpu_blocks_override=8, swap_space=0.002)
        llm.generate([[1, 2, 3]], use_tqdm=False)
        print("PIDS", *llm.llm_engine.executor.worker_pids, flush=True)
        if sys.argv[2] == "hang":
            time.sleep(600)
        # "exit": once the test has seen the worker alive, leave without shutdown(); the executor's
        # finalizer must reap the workers
        sys.stdin.readline()
    """
)


@pytest.mark.parametrize("how", ["exit", "sigkill"])
def test_no_orphans_when_the_engine_process_ends(tiny_llama_dir, tmp_path, how):
    script = tmp_path / "engine.py"
    script.write_text(_ORPHAN_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), tiny_llama_dir, "hang" if how == "sigkill" else "exit"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    pids: list[int] = []
    try:
        for line in proc.stdout:
            if line.startswith("PIDS"):
                pids = [int(x) for x in line.split()[1:]]
                break
        assert len(pids) == 1 and pid_running(pids[0])
        if how == "sigkill":
            proc.kill()  # no finalizer runs: the worker must notice on its own
        else:
            proc.stdin.write("exit\n")
            proc.stdin.flush()
        assert proc.wait(timeout=60) is not None
        assert wait_gone(pids) == []
    finally:
        proc.kill()
        for pid in pids:
            if pid_running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_server_health_goes_unhealthy_when_a_worker_dies():
    """`pagedllm serve --tensor-parallel-size 2`: kill rank 1 and /health turns 503 within the bound."""
    import httpx

    from conftest_server import SMALL_SERVER_ARGS, RemoteServer

    server = RemoteServer([*SMALL_SERVER_ARGS, "--tensor-parallel-size", "2"])
    cores: list[int] = []
    workers: list[int] = []
    try:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4}
        assert httpx.post(server.url("/v1/completions"), json=body, timeout=60).status_code == 200
        # The server's one child is its engine-core process; the rank-1 worker is that process's child.
        cores = child_pids(server.proc.pid)
        assert len(cores) == 1
        workers = child_pids(cores[0])
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        while httpx.get(server.url("/health"), timeout=10).status_code == 200:
            assert time.monotonic() - t0 < FAILURE_BOUND_S, "/health still 200 after the worker died"
            time.sleep(0.5)
        health = httpx.get(server.url("/health"), timeout=10)
        assert health.status_code == 503 and "worker rank 1" in health.text
        failed = httpx.post(server.url("/v1/completions"), json=body, timeout=60)
        assert failed.status_code >= 500 and "error" in failed.json()
    finally:
        server.stop()
    assert wait_gone(cores + workers) == []
