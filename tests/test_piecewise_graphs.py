"""Piecewise CUDA graphs for steps with prefill chunks (worker/piecewise_graph.py), the warm start and
the per-step statistics.

Bucket selection, step kinds and block-table padding are checked everywhere; greedy parity of the
captured paths against eager and the warm start need CUDA and are skipped without it.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from pagedllm.engine.arg_utils import EngineArgs
from tiny_models import save_tiny_llama
from pagedllm.worker.model_input import SequenceChunk
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.worker.piecewise_graph import (WHOLE_GRAPH_MAX_CONTEXT, bucket_for, capture_token_counts,
                                             fits_whole_graph, is_piecewise_graphable, non_owning_view)
from pagedllm.worker.step_stats import StepStats, format_summary, step_kind


def test_token_buckets_are_fine_then_coarse_and_end_at_the_step_limit():
    b = capture_token_counts(2048)
    assert b[:6] == [8, 16, 32, 64, 128, 192] and b[-1] == 2048
    assert 512 in b and 640 in b and 576 not in b  # every 64 up to 512, every 128 after
    assert all(x < y for x, y in zip(b, b[1:]))
    assert all((y - x) / x <= 0.5 for x, y in zip(b[4:], b[5:]))  # at most 50 % padding from 128 tokens
    assert all((y - x) / x <= 0.25 for x, y in zip(b, b[1:]) if x >= 512)
    assert capture_token_counts(100) == [8, 16, 32, 64, 100]
    assert capture_token_counts(5) == [5]
    assert capture_token_counts(16384)[-1] == 8192  # capped by max_capture_tokens
    assert capture_token_counts(16384, 4096)[-3:] == [3584, 3840, 4096]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        capture_token_counts(0)
    assert bucket_for(1, b) == 8 and bucket_for(65, b) == 128 and bucket_for(2048, b) == 2048
    assert bucket_for(2049, b) is None


def test_piecewise_takes_any_step_that_fits_the_largest_bucket():
    dec = [SequenceChunk(i, [7], 20, [3, 4], sample=True) for i in range(3)]
    pre = SequenceChunk(9, list(range(100)), 0, [5] * 7, sample=True)
    assert is_piecewise_graphable(dec + [pre], 103) and not is_piecewise_graphable(dec + [pre], 102)
    assert is_piecewise_graphable([SequenceChunk(0, [1, 2], 0, [1], sample=False, all_logits=True)], 8)
    assert not is_piecewise_graphable([], 8)


def test_step_kinds_and_summary():
    dec = SequenceChunk(0, [7], 20, [3, 4], sample=True)
    pre = SequenceChunk(1, [1, 2, 3], 0, [5], sample=True)
    assert step_kind([dec, dec]) == "decode"
    assert step_kind([dec, pre]) == "mixed"
    assert step_kind([pre]) == "prefill"
    stats = StepStats()
    assert stats.start(torch.device("meta")) is None  # neither CUDA events nor a host clock there
    stats.stop("decode", "eager", 3, None)
    assert stats.summary() == {} and "count" in format_summary({})
    for n in (3, 5):  # on CPU a step is timed by the host clock
        stats.stop("decode", "eager", n, stats.start(torch.device("cpu")))
    row = stats.summary()["decode/eager"]
    assert row["count"] == 2 and row["mean_tokens"] == 4 and row["mean_ms"] >= 0


def test_block_tables_are_padded_to_the_fixed_width_under_graphs():
    """With graphs, every step's table has max_model_len / block_size columns (one kernel variant)."""
    from pagedllm.model.layers.attention import TorchAttentionBackend

    runner = ModelRunner(torch.nn.Identity(), torch.device("cpu"), 16, TorchAttentionBackend())
    chunks = [SequenceChunk(0, [7], 20, [3, 4], sample=True), SequenceChunk(1, [1, 2, 3], 0, [5], sample=True)]
    _, _, meta, _ = runner.prepare_inputs(chunks)
    assert tuple(meta.block_tables.shape) == (2, 2)
    runner.table_width = 8
    ids, pos, meta, logits_idx = runner.prepare_inputs(chunks)
    assert tuple(meta.block_tables.shape) == (2, 8)
    assert meta.block_tables[0].tolist() == [3, 4, 0, 0, 0, 0, 0, 0]
    assert pos.tolist() == [20, 0, 1, 2] and meta.slot_mapping.tolist() == [4 * 16 + 4, 80, 81, 82]
    assert logits_idx.tolist() == [0, 3]


def test_max_capture_tokens_reaches_the_model_config_and_is_checked():
    assert EngineArgs().create_engine_config(2048).model_config.max_capture_tokens == 8192
    assert EngineArgs(max_capture_tokens=0).create_engine_config(2048).model_config.max_capture_tokens == 0
    with pytest.raises(ValueError, match="max_capture_tokens"):
        EngineArgs(max_capture_tokens=-1).create_engine_config(2048)


def test_the_offline_llm_on_a_gpu_gets_the_largest_captured_step_as_its_default_budget():
    def budget(usage_context: str, **kw) -> int:
        return EngineArgs(**kw).create_engine_config(4096, usage_context).scheduler_config.max_num_batched_tokens

    assert budget("llm_class", device="cuda") == 8192  # vLLM's LLM class default (8192 below 70 GB)
    assert budget("engine", device="cuda") == 2048  # the server and the engine: short decode steps
    assert budget("llm_class", device="cpu") == 2048
    assert budget("llm_class", device="cuda", max_num_batched_tokens=1024) == 1024
    assert budget("llm_class", device="cuda", enable_chunked_prefill=False) == 4096


def test_the_offline_llm_on_a_large_gpu_defaults_to_1024_sequences(monkeypatch):
    import pagedllm.engine.arg_utils as arg_utils

    def seqs(usage_context: str, **kw) -> int:
        return EngineArgs(**kw).create_engine_config(4096, usage_context).scheduler_config.max_num_seqs

    assert seqs("llm_class", device="cpu") == 256
    monkeypatch.setattr(arg_utils, "is_large_gpu", lambda: False)  # e.g. an A100 or a 40 GB card
    assert seqs("llm_class", device="cuda") == 256
    monkeypatch.setattr(arg_utils, "is_large_gpu", lambda: True)  # H100 / H200: vLLM's 1024
    assert seqs("llm_class", device="cuda") == 1024
    assert seqs("engine", device="cuda") == 256  # the server keeps short decode steps
    assert seqs("llm_class", device="cuda", max_num_seqs=64) == 64
    assert EngineArgs(device="cuda").create_engine_config(4096, "llm_class").scheduler_config.max_num_batched_tokens == 8192


def _tiny_cuda_llm(model_dir, **kw):
    """The tiny float32 model on CUDA with a 256-token step budget (prompts past it are chunked)."""
    from pagedllm import LLM

    return LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", device="cuda", max_model_len=512,
               block_size=16, num_gpu_blocks_override=512, max_num_seqs=16, max_num_batched_tokens=256, **kw)


def _run(model_dir, prompts, params, before=None, **kw):
    """Greedy outputs on CUDA → (token ids, the model runner, its step summary); `before(runner)` runs between
    start-up and generation."""
    llm = _tiny_cuda_llm(model_dir, **kw)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    if before is not None:
        before(runner)
    stats = runner.enable_step_stats()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs], runner, stats.summary()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_non_owning_view_is_the_same_memory_and_does_not_keep_it(dtype):
    """The piecewise graphs hand attention views of the graph pool's q/k/v: same address, shape, strides
    and dtype as the tensor (a strided split of a qkv buffer here), sees its writes, and frees nothing
    late: the memory is released when the owning tensor goes."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    qkv = torch.randn(64, 3 * 256, device="cuda").to(dtype)
    k = qkv[:, 256:512].view(64, 2, 128)
    view = non_owning_view(k)
    assert (view.data_ptr(), view.shape, view.stride(), view.dtype) == (k.data_ptr(), k.shape, k.stride(), dtype)
    assert torch.equal(view.float(), k.float())
    qkv.fill_(3)
    assert bool((view.float() == 3).all())
    del qkv, k
    assert torch.cuda.memory_allocated() == before


@pytest.mark.cuda
def test_piecewise_mixed_steps_equal_eager_greedy(tmp_path):
    """Ragged prompts (chunked at 256 tokens, so prefill-only, mixed and decode steps all occur) give
    the same greedy tokens through decode + piecewise graphs as eagerly, and the piecewise graphs ran
    for mixed and prefill steps."""
    from pagedllm import SamplingParams

    model_dir = save_tiny_llama(tmp_path)
    rng = random.Random(4)
    prompts = [[rng.randrange(1, 1024) for _ in range(rng.randint(1, 300))] for _ in range(20)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 40), ignore_eos=True) for _ in prompts]
    eager, eager_runner, eager_stats = _run(model_dir, prompts, params, enforce_eager=True)
    assert eager_runner.piecewise_runner is None and all(k.endswith("/eager") for k in eager_stats)
    decode_only, _, dec_stats = _run(model_dir, prompts, params, max_capture_tokens=0)
    assert "mixed/eager" in dec_stats
    assert decode_only == eager
    whole, _, whole_stats = _run(model_dir, prompts, params)
    assert "mixed/whole" in whole_stats and "prefill/whole" in whole_stats and "decode/graph" in whole_stats
    assert not any(k.endswith(("/eager", "/piecewise")) for k in whole_stats)
    assert whole == eager

    def without_whole_graphs(model_runner):
        model_runner.piecewise_runner.whole_graphs.clear()

    graphed, runner, stats = _run(model_dir, prompts, params, before=without_whole_graphs)
    assert runner.piecewise_runner is not None and runner.piecewise_runner.max_tokens == 256
    assert "mixed/piecewise" in stats and "prefill/piecewise" in stats and "decode/graph" in stats
    assert not any(k.endswith(("/eager", "/whole")) for k in stats)
    assert graphed == eager
    pw = runner.piecewise_runner
    assert set(pw.replay_ms) == {b for b in pw.buckets if b >= 128} and all(r >= b for b, r in pw.route.items())

    def route_all_to_the_largest(model_runner):  # as if every bucket had timed slower than the largest
        without_whole_graphs(model_runner)
        model_runner.piecewise_runner.route = {b: 256 for b in model_runner.piecewise_runner.buckets}

    routed, _, routed_stats = _run(model_dir, prompts, params, before=route_all_to_the_largest)
    assert routed == eager and "mixed/piecewise" in routed_stats


def test_fits_whole_graph_bounds_sequences_table_width_and_context():
    def meta(seq_lens: list[int], width: int = 4) -> AttentionMetadata:
        n = len(seq_lens)
        return AttentionMetadata(torch.zeros(n, dtype=torch.int64), torch.zeros((n, width), dtype=torch.int32),
                                 torch.tensor(seq_lens), torch.zeros(n + 1, dtype=torch.int32), seq_lens, [1] * n,
                                 n, max(seq_lens), 1)

    assert fits_whole_graph(meta([5, 9, 300]), True, num_seq_slots=3, table_width=4)
    assert not fits_whole_graph(meta([5, 9, 300]), False, num_seq_slots=3, table_width=4)  # bucket not captured
    assert not fits_whole_graph(meta([5, 9, 300, 2]), True, num_seq_slots=3, table_width=4)  # more sequences
    assert not fits_whole_graph(meta([5, 9], width=5), True, num_seq_slots=3, table_width=4)  # a wider table
    assert fits_whole_graph(meta([5, WHOLE_GRAPH_MAX_CONTEXT]), True, num_seq_slots=3, table_width=4)
    assert not fits_whole_graph(meta([5, WHOLE_GRAPH_MAX_CONTEXT + 1]), True, num_seq_slots=3, table_width=4)


@pytest.mark.cuda
def test_whole_graphs_take_steps_up_to_their_sequence_slots(tmp_path):
    """A step of more sequences than the whole graphs' static slots replays the piecewise graphs; one of at
    most that many, the whole graphs. Both give the eager greedy tokens (12 requests at once, then 3)."""
    from pagedllm import SamplingParams

    model_dir = save_tiny_llama(tmp_path)
    rng = random.Random(6)
    batches = [[[rng.randrange(1, 1024) for _ in range(rng.randint(5, 40))] for _ in range(n)] for n in (12, 3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for label, kw in (("eager", {"enforce_eager": True}), ("graphs", {})):
        llm = _tiny_cuda_llm(model_dir, **kw)
        runner = llm.llm_engine.executor.driver_worker.model_runner
        if runner.piecewise_runner is not None:
            runner.piecewise_runner.whole_graphs.clear()
            runner.piecewise_runner.capture_whole(runner.table_width, max_seqs=4)
        summaries, outs = [], []
        for batch in batches:
            stats = runner.enable_step_stats()
            done = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            outs.append([list(o.outputs[0].token_ids) for o in done])
            summaries.append(stats.summary())
        results[label] = (outs, summaries)
    assert results["graphs"][0] == results["eager"][0]
    many, few = results["graphs"][1]
    assert "prefill/piecewise" in many and not any(k.endswith("/whole") for k in many)
    assert "prefill/whole" in few and not any(k.endswith("/piecewise") for k in few)


@pytest.mark.cuda
def test_single_sequence_steps_replay_whole_graphs_equal_eager(tmp_path):
    """Prompts run one at a time (each step one sequence's chunk; prompts past the 256-token budget take two
    chunks, the second attending to the first's cached KV) replay the whole-step graphs, attention inside,
    and give the eager greedy tokens."""
    from pagedllm import SamplingParams

    model_dir = save_tiny_llama(tmp_path)
    rng = random.Random(9)
    prompts = [[rng.randrange(1, 1024) for _ in range(n)] for n in (2, 7, 64, 65, 200, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    results = {}
    for label, kw in (("eager", {"enforce_eager": True}), ("graphs", {})):
        llm = _tiny_cuda_llm(model_dir, **kw)
        runner = llm.llm_engine.executor.driver_worker.model_runner
        stats = runner.enable_step_stats()
        outs = [list(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids)
                for p in prompts]
        results[label] = (outs, runner, stats.summary())
    assert results["graphs"][0] == results["eager"][0]
    runner, stats = results["graphs"][1], results["graphs"][2]
    assert "prefill/whole" in stats and "prefill/piecewise" not in stats
    assert sorted(runner.piecewise_runner.whole_graphs) == runner.piecewise_runner.buckets  # all <= 2048 tokens


@pytest.mark.cuda
def test_warm_start_first_step_costs_a_steady_step(tmp_path):
    """After LLM() returns, the first mixed step compiles nothing: it takes about what the same step
    takes later (generous 3x bound, plus 5 ms of slack for timer noise)."""
    from pagedllm import LLM, SamplingParams

    model_dir = save_tiny_llama(tmp_path)
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", device="cuda", max_model_len=512,
              block_size=16, num_gpu_blocks_override=512, max_num_seqs=16, max_num_batched_tokens=256,
              async_scheduling=False)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rng = random.Random(1)
    times = []
    for _ in range(4):
        prompts = [[rng.randrange(1, 1024) for _ in range(rng.randint(20, 60))] for _ in range(3)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    assert times[0] <= 3 * min(times[1:]) + 0.005, times


def test_warm_up_steps_leave_greedy_outputs_unchanged(tmp_path):
    """The warm-up steps (run at engine start on CUDA) write KV block 0 before any request owns it:
    requests that later get block 0 produce the same greedy tokens as on a fresh engine."""
    from pagedllm import LLM, SamplingParams

    model_dir = save_tiny_llama(tmp_path)
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 1024) for _ in range(rng.randint(3, 40))]} for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = []
    for warm in (False, True):
        llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", device="cpu", max_model_len=128,
                  block_size=8, num_gpu_blocks_override=64, max_num_seqs=4)
        if warm:
            worker = llm.llm_engine.executor.driver_worker
            assert worker.model_runner.warm_up_steps(worker.cache_engine.gpu_cache)
        outs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]


def test_compilation_config_cudagraph_mode_as_vllm_names_it():
    import argparse
    from types import SimpleNamespace

    from pagedllm.config import CompilationConfig
    from pagedllm.worker.worker import Worker

    def mode(value) -> CompilationConfig:
        return EngineArgs(device="cpu", compilation_config=value).create_engine_config(4096).compilation_config

    default = mode(None)
    assert (default.cudagraph_mode, default.piecewise_graphs, default.whole_step_graphs) == ("FULL", True, True)
    fp = mode('{"cudagraph_mode": "FULL_AND_PIECEWISE"}')
    assert (fp.piecewise_graphs, fp.whole_step_graphs) == (True, False)
    decode_only = mode({"cudagraph_mode": "FULL_DECODE_ONLY"})
    assert (decode_only.piecewise_graphs, decode_only.whole_step_graphs) == (False, False)
    with pytest.raises(ValueError, match="'PIECEWISE'.*is not offered.*FULL_AND_PIECEWISE"):
        mode({"cudagraph_mode": "PIECEWISE"})
    with pytest.raises(ValueError, match="cudagraph_mode must be one of"):
        mode({"cudagraph_mode": "full"})
    with pytest.raises(ValueError, match=r"unknown compilation_config key\(s\) \['level'\]"):
        mode({"level": 3})
    with pytest.raises(ValueError, match="compilation_config is not valid JSON"):
        mode("{cudagraph_mode: NONE}")

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--compilation-config", '{"cudagraph_mode": "NONE"}']))
    none = args.replace(device="cpu").create_engine_config(4096).compilation_config
    assert none.cudagraph_mode == "NONE"
    # NONE captures nothing, as enforce_eager: the worker's switch for CUDA graphs reads it. VLLM_BATCH_INVARIANT=1
    # keeps the graphs (their padding rows change no row's bits: tests/test_batch_invariance.py on CUDA).
    for cfg, invariant, want in ((none, False, False), (default, False, True), (default, True, True),
                                 (none, True, False)):
        stub = SimpleNamespace(device=torch.device("cuda"), config=SimpleNamespace(
            model_config=SimpleNamespace(enforce_eager=False, batch_invariant=invariant), compilation_config=cfg,
            lora_config=None), pp=None)  # (pp: not a pipeline stage, whose steps run eagerly)
        assert Worker.use_cuda_graphs(stub) is want
