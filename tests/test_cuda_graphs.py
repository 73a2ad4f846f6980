"""CUDA graphs for decode steps (worker/cuda_graph.py) and the CUDA cache operations (copy, swap).

The bucket / eligibility logic and the enforce_eager plumbing are checked everywhere; the engine
runs (graphs vs eager, swap preemption, copy-on-write forks) need CUDA and are skipped without it.
"""
from __future__ import annotations

import random
import re

import pytest
import torch

from pagedllm.engine.arg_utils import EngineArgs
from tiny_models import save_tiny_llama
from pagedllm.worker.cuda_graph import capture_batch_sizes, is_graphable, route_to_faster_buckets
from pagedllm.worker.model_input import SequenceChunk, logits_rows, split_into_decode_rows


def test_capture_batch_sizes_are_buckets_up_to_max_num_seqs():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(5) == [1, 2, 4, 5]
    assert capture_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    sizes = capture_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert capture_batch_sizes(30)[-2:] == [24, 30]
    big = capture_batch_sizes(1024)  # the offline default on a large GPU: coarser steps past 256
    assert big[:35] == sizes and big[35:38] == [272, 288, 304] and big[-3:] == [960, 992, 1024]
    assert all(b - a <= max(8, a // 8) for a, b in zip(big, big[1:]))  # padding stays small
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_batch_sizes(0)


def test_batches_route_to_a_clearly_faster_larger_bucket():
    """Replay times as measured on an H100 for Llama-3-8B's decode graphs (ms; BENCHMARKS.md §47.1), plus small
    buckets: a bucket runs as the fastest larger one when that is at least 3 % faster, never below 128 rows."""
    times = {64: 5.0, 96: 9.0, 128: 6.0, 136: 7.0, 144: 6.5, 400: 12.615, 416: 11.519, 432: 10.370, 448: 15.406,
             464: 11.391, 480: 11.183, 496: 11.234}
    route = route_to_faster_buckets(times)
    assert route == {64: 64, 96: 96, 128: 128, 136: 144, 144: 144, 400: 432, 416: 432, 432: 432, 448: 480,
                     464: 464, 480: 480, 496: 496}
    assert route_to_faster_buckets(times, min_bucket=0)[96] == 128  # the floor is what kept 96 in place
    assert route_to_faster_buckets(times, min_gain=0.0)[464] == 480  # 1.8 % faster: below the default gain
    assert route_to_faster_buckets({}) == {}


class _Clock:
    """A stand-in for the device: graphs advance it by their cost (plus an upload cost on their first replay),
    events read it."""

    def __init__(self):
        self.now = 0.0

    def event(self, enable_timing=False):
        clock = self

        class Event:
            def record(self):
                self.t = clock.now

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return other.t - self.t

        return Event()

    def graph(self, ms, upload_ms=100.0):
        clock = self

        class Graph:
            first = True

            def replay(self):
                clock.now += ms + (upload_ms if self.first else 0.0)
                self.first = False

        return Graph()


def test_start_up_timing_routes_both_runners_by_their_replays(monkeypatch, caplog):
    """Both runners' `time_buckets` on stand-in graphs with known costs (as the H100 measured Llama-3-8B's, ms):
    the first replay (the graph's upload) is not counted, buckets under 128 are not timed, the routes follow the
    times, and the start-up log names each routed bucket."""
    import logging

    from pagedllm.worker import cuda_graph, piecewise_graph

    clock = _Clock()
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    costs = {64: 5.0, 128: 6.8, 448: 15.4, 480: 11.0, 512: 11.6}

    dec = object.__new__(cuda_graph.CUDAGraphRunner)
    dec.batch_sizes = sorted(costs)
    dec.graphs = {b: clock.graph(ms) for b, ms in costs.items()}
    dec.replay_ms, dec.route = {}, {b: b for b in dec.batch_sizes}
    dec._reset_padding = lambda: None
    pw = object.__new__(piecewise_graph.PiecewiseGraphRunner)
    pw.buckets = sorted(costs)
    pw.graphs = {b: [clock.graph(ms / 2), clock.graph(ms / 2)] for b, ms in costs.items()}  # two pieces each
    pw.replay_ms, pw.route = {}, {b: b for b in pw.buckets}
    pw.static_out = torch.ones(4)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        dec.time_buckets()
        pw.time_buckets()
    for runner in (dec, pw):
        assert runner.replay_ms == pytest.approx({b: ms for b, ms in costs.items() if b >= 128})
        assert runner.route == {64: 64, 128: 128, 448: 480, 480: 480, 512: 512}
    assert dec.bucket(450) == 480 and dec.bucket(100) == 128 and dec.bucket(1) == 64
    assert not pw.static_out.any()  # the attention output buffer the pieces read is left clean
    logged = [re.sub(r"in [0-9.]+ s", "in T s", r.getMessage()) for r in caplog.records
              if r.getMessage().startswith("Timed")]
    assert logged == ["Timed 4 decode graphs in T s; 1 run as a larger, faster bucket: 448→480 (15.40→11.00 ms)",
                      "Timed 4 piecewise token buckets in T s; 1 run as a larger, faster bucket: "
                      "448→480 (15.40→11.00 ms)"]


def test_graph_buckets_are_routed_only_in_one_process():
    """Tensor-parallel ranks must replay the same bucket (their graphs' all-reduces must match), so no rank
    routes by its own timings."""
    from types import SimpleNamespace

    from pagedllm.config import ParallelConfig
    from pagedllm.worker.worker import Worker

    def worker(tp):
        return SimpleNamespace(config=SimpleNamespace(parallel_config=ParallelConfig(tensor_parallel_size=tp)))

    assert Worker.routes_graph_buckets(worker(1)) is True
    assert Worker.routes_graph_buckets(worker(2)) is False


def test_only_pure_decode_steps_that_fit_are_graphable():
    dec = [SequenceChunk(i, [7], 20, [3, 4], sample=True) for i in range(3)]
    assert is_graphable(dec, max_batch=4, max_blocks=2)
    assert not is_graphable(dec, max_batch=2, max_blocks=2)  # too many sequences
    assert not is_graphable(dec, max_batch=4, max_blocks=1)  # block table longer than captured
    assert not is_graphable([], max_batch=4, max_blocks=2)
    prefill = dec + [SequenceChunk(9, [1, 2, 3], 0, [5], sample=True)]
    assert not is_graphable(prefill, max_batch=8, max_blocks=2)
    assert not is_graphable([SequenceChunk(0, [7], 20, [3, 4], sample=True, all_logits=True)], 4, 2)
    assert not is_graphable([SequenceChunk(0, [7], 20, [3, 4], sample=False)], 4, 2)


def test_verification_steps_split_into_decode_rows():
    """A step of chunks of at most max_query_len tokens becomes one decode row per token (position p + j,
    same block table); the original chunks' logits rows are picked from them."""
    verify = SequenceChunk(0, [7, 8, 9, 10, 11], 20, [3, 4], sample=False, all_logits=True)
    dec = SequenceChunk(1, [7], 20, [3, 4], sample=True)
    piece = SequenceChunk(2, [1, 2, 3], 0, [5], sample=False)
    rows = split_into_decode_rows([verify, dec, piece], max_query_len=5)
    assert [(r.seq_id, r.token_ids, r.start_pos, r.block_table) for r in rows] == [
        (0, [7], 20, [3, 4]), (0, [8], 21, [3, 4]), (0, [9], 22, [3, 4]), (0, [10], 23, [3, 4]), (0, [11], 24, [3, 4]),
        (1, [7], 20, [3, 4]), (2, [1], 0, [5]), (2, [2], 1, [5]), (2, [3], 2, [5])]
    assert is_graphable(rows, max_batch=9, max_blocks=2) and not is_graphable(rows, max_batch=8, max_blocks=2)
    assert split_into_decode_rows([verify, dec], max_query_len=4) is None  # a chunk too long
    assert split_into_decode_rows([dec], max_query_len=0) is None  # not enabled
    # Logits: every row of the verification, the decode's one row, none of the unfinished prompt piece.
    assert logits_rows([verify, dec, piece], [0, 5, 6, 9]) == [0, 1, 2, 3, 4, 5]


def test_enforce_eager_reaches_the_model_config():
    cfg = EngineArgs(enforce_eager=True).create_engine_config(2048)
    assert cfg.model_config.enforce_eager is True
    assert EngineArgs().create_engine_config(2048).model_config.enforce_eager is False


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_warm_up_steps_run_with_any_block_size(tmp_path, block_size):
    """The warm start's prefill/mixed/decode steps (8 tokens) fit blocks of fewer than 8 tokens (they
    raised IndexError on CUDA with block_size 4 before); device-independent, so checked on CPU too."""
    from pagedllm import LLM

    model_dir = save_tiny_llama(tmp_path)
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=64,
              block_size=block_size, num_gpu_blocks_override=64, enforce_eager=True)
    worker = llm.llm_engine.executor.driver_worker
    assert worker.model_runner.warm_up_steps(worker.cache_engine.gpu_cache) == ["steps prefill/mixed/decode"]


def _generate(model_dir, prompts, params, before=None, **kw):
    """Greedy outputs on CUDA → (token ids per request and sample, the model runner); `before(runner)` runs
    between start-up and generation."""
    from pagedllm import LLM

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", device="cuda", max_model_len=256,
              block_size=16, **kw)
    if before is not None:
        before(llm.llm_engine.executor.driver_worker.model_runner)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    return [[list(c.token_ids) for c in o.outputs] for o in outs], runner


@pytest.mark.cuda
def test_graph_decode_equals_eager_with_padded_buckets(tmp_path):
    """13 ragged prompts (buckets 16, then 8/4/2/1 as they finish) give the same greedy tokens with and
    without graphs, and the graphs were actually replayed."""
    from pagedllm import SamplingParams

    model_dir = save_tiny_llama(tmp_path)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 1024) for _ in range(rng.randint(1, 60))] for _ in range(13)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 40), ignore_eos=True) for _ in prompts]
    eager, eager_runner = _generate(model_dir, prompts, params, enforce_eager=True, num_gpu_blocks_override=256)
    assert eager_runner.graph_runner is None
    replays = []
    from pagedllm.worker import cuda_graph

    orig = cuda_graph.CUDAGraphRunner.run
    cuda_graph.CUDAGraphRunner.run = (
        lambda self, chunks, *rest: replays.append(len(chunks)) or orig(self, chunks, *rest))
    try:
        graphed, runner = _generate(model_dir, prompts, params, num_gpu_blocks_override=256, max_num_seqs=16)
    finally:
        cuda_graph.CUDAGraphRunner.run = orig
    assert runner.graph_runner is not None and runner.graph_runner.batch_sizes == [1, 2, 4, 8, 16]
    assert replays and any(n not in (1, 2, 4, 8, 16) for n in replays)  # padded buckets were used
    assert graphed == eager
    assert all(r >= b for b, r in runner.graph_runner.route.items())

    def route_all_to_16(model_runner):  # as if every bucket had timed slower than 16
        model_runner.graph_runner.route = {b: 16 for b in model_runner.graph_runner.batch_sizes}

    routed, runner = _generate(model_dir, prompts, params, before=route_all_to_16, num_gpu_blocks_override=256,
                               max_num_seqs=16)
    assert routed == eager and runner.graph_runner.bucket(1) == 16


@pytest.mark.cuda
def test_swap_preemption_and_cow_forks_on_cuda_match_unconstrained_run(tmp_path):
    """A pool too small for the batch forces swap preemption (side-stream swaps through the pinned pool);
    n=3 seeded sampling forks at a partial block (Triton copy_blocks). Tokens equal a roomy run's."""
    from pagedllm import SamplingParams

    model_dir = save_tiny_llama(tmp_path)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 1024) for _ in range(rng.randint(20, 40))] for _ in range(8)]
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    roomy, _ = _generate(model_dir, prompts, greedy, num_gpu_blocks_override=512)
    tight, _ = _generate(model_dir, prompts, greedy, num_gpu_blocks_override=24, preemption_mode="swap",
                         swap_space=0.05)
    assert tight == roomy
    fork = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    a, _ = _generate(model_dir, [prompts[0][:21]], fork, num_gpu_blocks_override=512, enforce_eager=True)
    b, _ = _generate(model_dir, [prompts[0][:21]], fork, num_gpu_blocks_override=512)
    assert a == b and len(a[0]) == 3


@pytest.mark.cuda
def test_async_scheduling_on_cuda_equals_sync_and_launches_never_wait(tmp_path):
    """Asynchronous scheduling (the CUDA default) with graphs and eager prefill steps: same tokens as the
    synchronous engine for greedy, seeded-random, stop-token and swap-preempted requests, and launching a
    step never synchronises with the device (torch's sync debug mode turns any such wait into an error)."""
    from pagedllm import LLM, SamplingParams

    model_dir = save_tiny_llama(tmp_path)
    rng = random.Random(9)
    prompts = [[rng.randrange(1, 1024) for _ in range(rng.randint(1, 70))] for _ in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 48), ignore_eos=True) for _ in range(6)]
    params += [SamplingParams(temperature=1.0, seed=i, max_tokens=30, ignore_eos=True) for i in range(3)]
    params += [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[rng.randrange(1, 1024) for _ in range(40)])
               for _ in range(3)]
    kw = dict(num_gpu_blocks_override=40, preemption_mode="swap", swap_space=0.05, max_num_seqs=16)
    sync, _ = _generate(model_dir, prompts, params, async_scheduling=False, **kw)
    default, _ = _generate(model_dir, prompts, params, **kw)
    assert default == sync

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", device="cuda", max_model_len=256,
              block_size=16, num_gpu_blocks_override=256)
    engine = llm.llm_engine
    assert engine.async_scheduling
    def checked(launch):
        def run(*args):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return launch(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return run

    engine._launch_forward = checked(engine._launch_forward)  # the model run
    engine._launch_sampling = checked(engine._launch_sampling)  # and the sampling of a step
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = [list(c.token_ids) for c in out.outputs]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref, _ = _generate(model_dir, prompts, greedy, async_scheduling=False, num_gpu_blocks_override=256)
    assert [done[i] for i in range(len(prompts))] == ref


@pytest.mark.cuda
def test_logit_bias_and_allowed_token_ids_on_cuda_equal_eager_sync_and_leave_neighbours_alone(tmp_path):
    """logit_bias (forcing a token, or banning the plain greedy's first token) and allowed_token_ids (greedy and
    seeded sampling) beside plain greedy requests, with decode graphs and asynchronous scheduling: the same tokens
    as the eager synchronous engine, every adjustment obeyed, and the plain requests' tokens those of a batch
    without any adjustment (same batch shape)."""
    from pagedllm import SamplingParams

    model_dir = save_tiny_llama(tmp_path)
    rng = random.Random(13)
    prompts = [[rng.randrange(1, 1024) for _ in range(rng.randint(5, 50))] for _ in range(12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base, _ = _generate(model_dir, prompts, greedy, num_gpu_blocks_override=256, max_num_seqs=16)
    forced, allowed = 77, [5, 9, 200, 311]
    params = []
    for i in range(len(prompts)):
        kind = i % 4
        params.append(greedy if kind == 0 else
                      SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                     logit_bias={base[i][0][0]: -100.0}) if kind == 1 else
                      SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={forced: 100.0})
                      if kind == 2 else
                      SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True, allowed_token_ids=allowed))
    eager_sync, _ = _generate(model_dir, prompts, params, num_gpu_blocks_override=256, max_num_seqs=16,
                              enforce_eager=True, async_scheduling=False)
    default, runner = _generate(model_dir, prompts, params, num_gpu_blocks_override=256, max_num_seqs=16)
    assert runner.graph_runner is not None
    assert default == eager_sync
    for i, out in enumerate(default):
        toks = out[0]
        if i % 4 == 0:
            assert toks == base[i][0]
        elif i % 4 == 1:
            assert toks[0] != base[i][0][0]
        elif i % 4 == 2:
            assert toks == [forced] * 24
        else:
            assert set(toks) <= set(allowed) and len(set(toks)) > 1


@pytest.mark.cuda
def test_verification_steps_replay_decode_graphs_and_equal_eager(tmp_path):
    """Speculative decoding (n-gram, k = 4) on repetitive prompts: verification steps (k+1 query tokens
    per sequence, with plain decodes beside them) replay the decode graphs, one row per query token (buckets
    up to 16 sequences x 5 rows, beyond max_num_seqs); every greedy output equals the eager engine's and the engine's without
    speculation."""
    from pagedllm import SamplingParams

    model_dir = save_tiny_llama(tmp_path)
    rng = random.Random(21)
    prompts = []
    for _ in range(11):
        motif = [rng.randrange(1, 1024) for _ in range(rng.randint(3, 9))]
        prompts.append((motif * 12)[: rng.randint(8, 90)])
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 48), ignore_eos=True) for _ in prompts]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "draft_length_policy": "fixed"}
    kw = dict(num_gpu_blocks_override=256, max_num_seqs=16)
    plain, _ = _generate(model_dir, prompts, params, **kw)
    eager, eager_runner = _generate(model_dir, prompts, params, enforce_eager=True, speculative_config=spec, **kw)
    assert eager_runner.graph_runner is None
    replays = []
    from pagedllm.worker import cuda_graph

    orig = cuda_graph.CUDAGraphRunner.run
    cuda_graph.CUDAGraphRunner.run = (
        lambda self, chunks, *rest: replays.append([c.seq_id for c in chunks]) or orig(self, chunks, *rest))
    try:
        graphed, runner = _generate(model_dir, prompts, params, speculative_config=spec, **kw)
    finally:
        cuda_graph.CUDAGraphRunner.run = orig
    assert runner.verify_query_len == 5 and runner.graph_runner.max_batch == 80
    assert any(len(r) > len(set(r)) for r in replays)  # verification rows: a sequence on several rows
    assert graphed == eager == plain
