"""Pipeline parallelism on CPU (gloo): real worker processes, each stage holding only its decoder layers, against the
single-process engine on the same checkpoint (greedy and seeded sampling token for token, with chunked prefill, swap
preemption and copy-on-write in the run)."""
from __future__ import annotations

import httpx
import pytest
import torch
from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer
from tiny_models import PARALLEL_KW, PARALLEL_PROMPTS, output_tokens, parallel_params, save_peaked_tiny_llama

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import PP_LAYER_PARTITION_ENV, pipeline_layer_counts
from pagedllm.model.cpu_direct_forward import DIRECT_FORWARD_ENV
from pagedllm.model.pipeline import PPMissingLayer

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = PARALLEL_PROMPTS
TINY_KW = {**PARALLEL_KW, "dtype": "float32"}
_params = parallel_params
_tokens = output_tokens


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    """A 4-layer Llama (4 query heads, 2 KV heads) whose LM head is tied to the embeddings, as the bundled model's."""
    return save_peaked_tiny_llama(tmp_path_factory.mktemp("tiny_llama_pp"), 4, 2, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **TINY_KW)
    return _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False)), llm.stats()


def test_layer_counts_follow_vllms_split():
    """Equal shares; the remainder one each to the stages before the last; VLLM_PP_LAYER_PARTITION outright."""
    assert pipeline_layer_counts(30, 2) == [15, 15]
    assert pipeline_layer_counts(30, 4) == [7, 8, 8, 7]
    assert pipeline_layer_counts(7, 3) == [2, 3, 2]
    assert pipeline_layer_counts(4, 2, "3,1") == [3, 1]
    for bad in ("3,2", "4,0", "2", "a,b"):
        with pytest.raises(ValueError, match=f"{PP_LAYER_PARTITION_ENV}=.*give 2 comma-separated layer counts"):
            pipeline_layer_counts(4, 2, bad)
    with pytest.raises(ValueError, match="exceeds the model's 4 decoder layers"):
        pipeline_layer_counts(4, 5)


@pytest.mark.parametrize("direct_forward", ["1", "0"])
def test_two_stages_match_one_process(tiny_llama_dir, tiny_reference, monkeypatch, direct_forward):
    """Stage 0 (the engine process) holds layers 0-1 and the embeddings; stage 1 layers 2-3, the norm and the tied
    LM head; each stage's KV pool has its own layers only. Swap and copy-on-write lists reach both stages. The
    stages run the CPU direct forward's kernels, or (PAGEDLLM_CPU_DIRECT_FORWARD=0) the module path."""
    monkeypatch.setenv(DIRECT_FORWARD_ENV, direct_forward)
    ref, ref_stats = tiny_reference
    llm = LLM(tiny_llama_dir, pipeline_parallel_size=2, distributed_executor_backend="mp", **TINY_KW)
    executor = llm.llm_engine.executor
    try:
        model = executor.driver.worker.model
        assert [isinstance(layer, PPMissingLayer) for layer in model.model.layers] == [False, False, True, True]
        assert isinstance(model.lm_head, PPMissingLayer) and isinstance(model.model.norm, PPMissingLayer)
        assert len(executor.driver.worker.cache_engine.gpu_cache) == 2
        last = executor.collective_rpc(lambda w: (
            [type(layer).__name__ for layer in w.model.model.layers], type(w.model.lm_head).__name__,
            len(w.cache_engine.gpu_cache)))[1]
        assert last == (["PPMissingLayer", "PPMissingLayer", "LlamaDecoderLayer", "LlamaDecoderLayer"],
                        "ParallelLMHead", 2)
        direct = executor.collective_rpc(lambda w: None if w.model_runner.direct_forward is None
                                         else len(w.model_runner.direct_forward.layers))
        assert direct == ([2, 2] if direct_forward == "1" else [None, None])
        assert llm.llm_engine._pipeline_depth == 2  # a batch in each stage at once
        out = _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False))
        stats = llm.stats()
        executor.check_health()
    finally:
        executor.shutdown()
    assert out == ref
    assert stats["num_swap_outs"] > 0 and stats["num_cow_copies"] > 0
    assert (stats["num_swap_outs"], stats["num_cow_copies"]) == (ref_stats["num_swap_outs"], ref_stats["num_cow_copies"])


def test_tensor_parallel_stages_with_a_set_partition(tiny_llama_dir, tiny_reference, monkeypatch):
    """Two stages of two tensor-parallel ranks each (four processes), layers split 3 + 1 by VLLM_PP_LAYER_PARTITION."""
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "3,1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # four ranks on this machine's cores
    ref, _ = tiny_reference
    llm = LLM(tiny_llama_dir, pipeline_parallel_size=2, tensor_parallel_size=2, distributed_executor_backend="mp",
              **TINY_KW)
    executor = llm.llm_engine.executor
    try:
        stages = executor.collective_rpc(lambda w: (w.pp.rank, w.tp.rank, w.pp.start_layer, w.pp.end_layer,
                                                    len(w.cache_engine.gpu_cache)))
        assert stages == [(0, 0, 0, 3, 3), (0, 1, 0, 3, 3), (1, 0, 3, 4, 1), (1, 1, 3, 4, 1)]
        out = _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False))
    finally:
        executor.shutdown()
    assert out == ref


def test_bundled_model_two_stages_match_one_process():
    """SmolLM2-135M's 30 layers as 15 + 15; the GGUF file's blocks are dequantized at load on both stages, so the
    output is that of quantization='none' in one process."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]
    kw = dict(num_gpu_blocks_override=48, swap_space=0.01, max_model_len=256)
    ref = LLM(quantization="none", **kw)
    expected = _tokens(ref.generate(prompts, GREEDY, use_tqdm=False))
    del ref
    llm = LLM(pipeline_parallel_size=2, **kw)  # backend defaults to mp
    try:
        assert llm.llm_engine.executor.driver.worker.pp.end_layer == 15
        got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    finally:
        llm.llm_engine.executor.shutdown()
    assert got == expected


def test_ray_executor_runs_the_stages(tiny_llama_dir, tiny_reference, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_ADDRESS", "local")  # a private local cluster, never someone else's
    ref, _ = tiny_reference
    llm = LLM(tiny_llama_dir, pipeline_parallel_size=2, distributed_executor_backend="ray", **TINY_KW)
    try:
        assert _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False)) == ref
    finally:
        llm.llm_engine.executor.shutdown()
    assert not ray.is_initialized()


def test_aborts_while_batches_are_in_the_stages_leave_no_block(tiny_llama_dir):
    """Eight requests on a 12-block pool (prefix caching on, swap preemptions): three aborted while batches are in
    flight; the others finish with their one-process tokens, and every device and swap block comes back."""
    prompts = [p + [i] for i, p in enumerate(PROMPTS * 2)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    kw = {**TINY_KW, "enable_prefix_caching": True}
    expected = _tokens(LLM(tiny_llama_dir, **kw).generate(prompts, params, use_tqdm=False))
    llm = LLM(tiny_llama_dir, pipeline_parallel_size=2, distributed_executor_backend="mp", **kw)
    engine = llm.llm_engine
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, params)
        in_flight: list[int] = []  # steps launched and not completed when one's logits are received
        receive = engine.executor.receive_pipeline_logits
        engine.executor.receive_pipeline_logits = lambda: in_flight.append(len(engine._pipeline_steps) + 1) or receive()
        for _ in range(6):
            engine.step()
        assert max(in_flight) == 2  # both stages had a batch
        engine.abort_request(["r1", "r2", "r5"])
        finished: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = list(out.outputs[0].token_ids)
        stats = llm.stats()
    finally:
        engine.executor.shutdown()
    assert sorted(finished) == sorted(f"r{i}" for i in (0, 3, 4, 6, 7))
    assert all(finished[f"r{i}"] == expected[i][0] for i in (0, 3, 4, 6, 7))
    assert stats["num_swap_preemptions"] > 0
    assert (stats["kv_blocks_free"], stats["num_cpu_blocks_free"]) == (12, stats["num_cpu_blocks_total"])


def test_a_killed_stage_fails_the_engine_at_once(tiny_llama_dir):
    """Stage 1's process killed mid-generation: the next step raises TensorParallelWorkerError naming it (rank 0's
    receive sees the connection reset), and no worker process is left."""
    import os
    import signal
    import time

    from process_utils import wait_gone

    from pagedllm.executor.distributed_base import TensorParallelWorkerError

    llm = LLM(tiny_llama_dir, pipeline_parallel_size=2, distributed_executor_backend="mp", **TINY_KW)
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
    engine.step()
    os.kill(engine.executor.worker_pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelWorkerError, match="worker rank 1 .*exited"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - t0 < 60
    engine.executor.shutdown()
    assert wait_gone(engine.executor.worker_pids) == []


def test_what_stages_cannot_run_fails_before_any_process_starts(tiny_llama_dir, tmp_path, monkeypatch):
    kw = dict(num_gpu_blocks_override=8, swap_space=0.01, max_model_len=64)
    with pytest.raises(ValueError, match="exceeds the model's 4 decoder layers"):
        LLM(tiny_llama_dir, pipeline_parallel_size=5, **TINY_KW)
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "2,1")
    with pytest.raises(ValueError, match="summing to the model's 4 layers"):
        LLM(tiny_llama_dir, pipeline_parallel_size=2, **TINY_KW)
    monkeypatch.delenv(PP_LAYER_PARTITION_ENV)
    with pytest.raises(ValueError, match="does not run with speculative decoding"):
        LLM(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **kw)
    with pytest.raises(ValueError, match="'uni' runs one process"):
        LLM(pipeline_parallel_size=2, distributed_executor_backend="uni", **kw)
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=255, n_embd=32, n_layer=2, n_head=2, n_positions=64)).save_pretrained(
        str(tmp_path), safe_serialization=True)
    with pytest.raises(ValueError, match="GPT2LMHeadModel is not a Llama-style decoder"):
        LLM(str(tmp_path), pipeline_parallel_size=2, skip_tokenizer_init=True, **kw)


def test_explicit_gguf_blocks_are_refused_with_the_way_out():
    """quantization='gguf' asks for the file's blocks, which the stages do not run: the error says what to pass."""
    with pytest.raises(ValueError, match="pass quantization='none' to dequantize them"):
        LLM(pipeline_parallel_size=2, quantization="gguf", num_gpu_blocks_override=8, swap_space=0.01,
            max_model_len=64)


def test_server_with_two_stages():
    """`pagedllm serve -pp 2`: the engine-core process drives stage 0 and a worker process stage 1; a greedy
    completion is the one-process engine's (quantization='none': the stages dequantize the GGUF file)."""
    prompt = "The capital of France is"
    expected = LLM(quantization="none", num_gpu_blocks_override=48, swap_space=0.01, max_model_len=256).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    srv = RemoteServer([*SMALL_SERVER_ARGS, "--no-dashboard", "--no-warm-up-request", "-pp", "2"])
    try:
        r = httpx.post(srv.url("/v1/completions"), timeout=120, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        assert httpx.get(srv.url("/health"), timeout=30).status_code == 200
    finally:
        assert srv.stop() == 0


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_stages_on_two_gpus_match_one(tiny_llama_dir):
    """NCCL point to point between the stages; the KV pools sized by each stage's own profiling forward."""
    kw = {**TINY_KW, "device": "cuda"}
    ref = _tokens(LLM(tiny_llama_dir, **kw).generate(PROMPTS, _params(), use_tqdm=False))
    llm = LLM(tiny_llama_dir, pipeline_parallel_size=2, distributed_executor_backend="mp", **kw)
    try:
        assert _tokens(llm.generate(PROMPTS, _params(), use_tqdm=False)) == ref
    finally:
        llm.llm_engine.executor.shutdown()
