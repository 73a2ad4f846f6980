"""The hybrid KV cache (core/kv_cache_groups.py): a model mixing full-attention and sliding-window layers (Gemma 2/3)
keeps a block table per group of layers over one shared pool; the sliding groups free their blocks behind the
window, so the same memory holds more tokens, and the tokens are transformers' greedy tokens all the same."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from hypothesis import given, settings, strategies as st
from test_models_hf import hf_greedy_reference
from tiny_models import greedy_token_ids

from pagedllm import LLM, SamplingParams
from pagedllm.core.block_manager import NULL_BLOCK, BlockManager, cdiv, leading_null_blocks
from pagedllm.core.kv_accounting import kv_memory_breakdown
from pagedllm.core.kv_cache_groups import blocks_for_sequence, plan_kv_cache_groups
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.engine.arg_utils import CUDA_HYBRID_KV_CACHE_ENV
from pagedllm.engine.request_checker import RequestChecker
from pagedllm.executor.step_codec import decode_request, encode_request
from pagedllm.worker.model_input import ExecuteModelRequest, SequenceChunk, fill_block_table_row

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# -- grouping --------------------------------------------------------------------------------------------------
def test_gemma3_1b_layers_form_one_full_and_six_sliding_groups_of_four() -> None:
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]  # Gemma 3: every 6th layer global
    layout = plan_kv_cache_groups(windows)
    assert layout.num_slots == 4 and layout.is_hybrid
    assert layout.group_windows == (None,) + (512,) * 6
    assert layout.groups[0].layer_indices == (5, 11, 17, 23)
    assert [len(g.layer_indices) for g in layout.groups[1:]] == [4, 4, 4, 4, 4, 2]
    placement = layout.layer_placement(26)
    assert sorted(p for p in placement) == sorted(set(placement))  # every (group, slot) once
    assert {w for i, w in enumerate(windows) if placement[i][0] == 0} == {None}


def test_alternating_layers_form_two_groups_and_uniform_models_one() -> None:
    layout = plan_kv_cache_groups([4096, None] * 13)  # Gemma 2
    assert layout.group_windows == (None, 4096) and layout.num_slots == 13
    assert plan_kv_cache_groups([None] * 5).group_windows == (None,)
    assert plan_kv_cache_groups([None] * 5).num_slots == 5
    assert plan_kv_cache_groups([8] * 3).group_windows == (8,)  # Mistral: one group, blocks freed behind it
    off = plan_kv_cache_groups([4096, None] * 13, enable_hybrid=False)
    assert off.group_windows == (None,) and off.num_slots == 26
    with pytest.raises(ValueError, match="at least one"):
        plan_kv_cache_groups([])


# -- the block manager -----------------------------------------------------------------------------------------
def _grow(bm: BlockManager, seq: Sequence, n: int) -> list[tuple[int, int]]:
    copies = bm.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    return copies


def test_sliding_groups_free_behind_the_window_while_the_full_group_keeps_everything() -> None:
    bs, window = 4, 8
    bm = BlockManager(block_size=bs, num_gpu_blocks=64, group_windows=(None, window, window))
    seq = Sequence(0, list(range(5)))
    _grow(bm, seq, 5)
    for step in range(60):
        seq.append_token(step, 0.0)
        need = bm.num_blocks_to_grow(seq, 1)
        free = bm.get_num_free_gpu_blocks()
        _grow(bm, seq, 1)
        assert bm.get_num_free_gpu_blocks() == free - need  # the scheduler's estimate is exact, frees counted
        full, *sliding = bm.get_block_tables(seq)
        assert len(full) == cdiv(seq.num_computed_tokens, bs) and NULL_BLOCK not in full
        for table in sliding:
            assert len(table) == len(full)  # positions keep their index in every group
            assert len([b for b in table if b != NULL_BLOCK]) <= cdiv(window, bs) + 1
        bm.check_invariants()
    held = 64 - bm.get_num_free_gpu_blocks()
    assert held <= cdiv(65, bs) + 2 * (cdiv(window, bs) + 1)  # vs 3 * 17 with one table for every group
    bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 64
    bm.check_invariants()


def test_fork_copy_on_write_swap_and_free_cover_every_group() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=40, num_cpu_blocks=40, group_windows=(None, 6))
    parent = Sequence(0, list(range(18)))
    group = SequenceGroup("r", [parent], None, 0.0)
    _grow(bm, parent, 18)
    child = Sequence(1, list(range(18)))
    child.num_computed_tokens = 18
    group.seqs.append(child)
    bm.fork(parent, child)
    bm.check_invariants()
    for seq in (parent, child):
        seq.append_token(7, 0.0)
    copies = _grow(bm, parent, 1)  # block 4 (positions 16-19) is shared in both groups: copied in both
    assert len(copies) == 2
    _grow(bm, child, 1)
    bm.check_invariants()
    mapping = bm.swap_out(group)
    assert bm.get_num_free_gpu_blocks() == 40 and len(mapping) == len({d for _, d in mapping})
    assert all(t.get(parent.seq_id) for t in bm.cpu_tables)
    bm.check_invariants()
    bm.swap_in(group)
    assert all(len(t[s.seq_id]) == 5 for t in bm.tables for s in (parent, child))
    bm.check_invariants()
    for seq in (parent, child):
        bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 40 and bm.get_num_free_cpu_blocks() == 40
    bm.truncate(parent, 0)  # nothing left: a no-op
    bm.check_invariants()


def test_prefix_hit_needs_only_the_window_of_a_sliding_group() -> None:
    """A sliding group's blocks behind the window were freed (and may be evicted): a later request with the same
    prefix hits as far as the full group holds blocks and the sliding groups hold the window before that point."""
    bs, window = 4, 6
    bm = BlockManager(block_size=bs, num_gpu_blocks=40, enable_caching=True, group_windows=(None, window))
    first = Sequence(0, list(range(30)))
    for n in (16, 14):
        _grow(bm, first, n)
        bm.cache_computed_blocks(first)
    full, sliding = bm.get_block_tables(first)
    assert leading_null_blocks(sliding) > 0 and leading_null_blocks(full) == 0
    bm.free(first)
    # Evict the cached copies of the sliding group's first blocks: take every other free block first.
    grabbed = []
    while bm.gpu_pool._free_uncached:
        grabbed.append(bm.gpu_pool.allocate())
    evicted_early = [bm.gpu_pool.allocate() for _ in range(2)]  # LRU: the first freed cached blocks
    again = Sequence(1, list(range(30)) + [99])
    hit = bm.allocate_cached_prefix(again)
    assert hit % bs == 0 and hit >= 20  # the first blocks of the sliding group are gone, the window is not
    full, sliding = bm.get_block_tables(again)
    assert len(full) == len(sliding) == hit // bs
    assert leading_null_blocks(sliding) == max(0, hit - window + 1) // bs
    assert bm.num_cached_prefix_blocks(again) == hit // bs
    for block in grabbed + evicted_early:
        bm.gpu_pool.decref(block)
    bm.check_invariants()
    bm.free(again)
    bm.check_invariants()


@settings(max_examples=40, deadline=None)
@given(window=st.integers(1, 13), bs=st.sampled_from([1, 2, 4, 8]),
       chunks=st.lists(st.integers(1, 9), min_size=1, max_size=12))
def test_every_position_a_query_can_see_stays_held_in_every_group(window: int, bs: int, chunks: list[int]) -> None:
    bm = BlockManager(block_size=bs, num_gpu_blocks=400, group_windows=(None, window, 2 * window))
    seq = Sequence(0, list(range(sum(chunks))))
    for n in chunks:
        _grow(bm, seq, n)
        first_query = seq.num_computed_tokens - n
        for table, w in zip(bm.get_block_tables(seq), (None, window, 2 * window)):
            lo = 0 if w is None else max(0, first_query - w + 1)
            assert all(table[p // bs] != NULL_BLOCK for p in range(lo, seq.num_computed_tokens))
        bm.check_invariants()


@settings(max_examples=40, deadline=None)
@given(window=st.integers(1, 20), bs=st.sampled_from([1, 2, 4, 8]), step=st.integers(1, 9),
       length=st.integers(1, 80))
def test_blocks_for_sequence_bounds_what_a_sequence_holds(window: int, bs: int, step: int, length: int) -> None:
    """The bound the request checker and the GPU profile use: never below what the block manager holds, reached."""
    bm = BlockManager(block_size=bs, num_gpu_blocks=1000, group_windows=(None, window))
    seq = Sequence(0, list(range(length)))
    most = 0
    while seq.num_computed_tokens < length:
        _grow(bm, seq, min(step, length - seq.num_computed_tokens))
        most = max(most, 1000 - bm.get_num_free_gpu_blocks())
    assert most <= blocks_for_sequence((None, window), length, bs, step)


def test_request_checker_counts_every_groups_blocks() -> None:
    common = dict(vocab_size=10, max_model_len=1000, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    # One full group: the pool's tokens. Full + a window of 8: the full group's blocks plus ~(8 + 16) / 4 + 2.
    assert RequestChecker(num_gpu_blocks=100, **common).max_seq_len == 400
    hybrid = RequestChecker(num_gpu_blocks=100, group_windows=(None, 8), **common)
    assert hybrid.max_seq_len == 4 * (100 - (cdiv(8 + 16 - 1, 4) + 1))
    assert blocks_for_sequence((None, 8), 40, 4, 16) == 10 + 7 and blocks_for_sequence((8,), 4, 4) == 1
    assert RequestChecker(num_gpu_blocks=500, group_windows=(None, 8), **common).max_seq_len == 1000


def test_step_codec_carries_every_groups_tables() -> None:
    chunks = [SequenceChunk(3, [1, 2, 3], 0, [5, 6], sample=True, group_block_tables=[[7, 8], [NULL_BLOCK, 9]]),
              SequenceChunk(4, [4], 9, [1, 2, 3], sample=True, group_block_tables=[[10, 11, 12], [13, 14, 15]])]
    back = decode_request(encode_request(ExecuteModelRequest(chunks, blocks_to_copy=[(1, 2)])))
    assert [c.group_block_tables for c in back.chunks] == [c.group_block_tables for c in chunks]
    assert [c.block_table for c in back.chunks] == [[5, 6], [1, 2, 3]] and back.blocks_to_copy == [(1, 2)]
    plain = decode_request(encode_request(ExecuteModelRequest([SequenceChunk(1, [1], 0, [2], sample=True)])))
    assert plain.chunks[0].group_block_tables is None
    bad = [SequenceChunk(3, [1], 0, [5, 6], sample=True, group_block_tables=[[7]])]
    with pytest.raises(ValueError, match="each KV cache group"):
        encode_request(ExecuteModelRequest(bad))


def test_memory_breakdown_counts_every_groups_blocks() -> None:
    bm = BlockManager(block_size=4, num_gpu_blocks=30, group_windows=(None, 4))
    seq = Sequence(0, list(range(20)))
    group = SequenceGroup("r", [seq], None, 0.0)
    _grow(bm, seq, 16)
    _grow(bm, seq, 4)
    out = kv_memory_breakdown(bm, [group], max_model_len=64)
    held = 30 - bm.get_num_free_gpu_blocks()
    assert out.token_states + out.reservation + out.internal_fragmentation == held * 4


def test_dashboard_snapshot_shows_every_groups_blocks() -> None:
    from types import SimpleNamespace

    from pagedllm.core.kv_snapshot import build_kv_snapshot, capture_kv_state

    bm = BlockManager(block_size=4, num_gpu_blocks=30, group_windows=(None, 4))
    seq = Sequence(0, list(range(22)))
    group = SequenceGroup("r", [seq], None, 0.0)
    _grow(bm, seq, 16)
    _grow(bm, seq, 6)
    scheduler = SimpleNamespace(block_manager=bm, running=[group], waiting=[], swapped=[])
    snap = build_kv_snapshot(capture_kv_state(scheduler))
    held = {b for t in bm.get_block_tables(seq) for b in t if b != NULL_BLOCK}
    assert {int(b) for b in snap["gpu"]["owners"]} == held
    # 22 tokens: the full group's 6 blocks hold 22; the sliding group's live blocks (positions 12..23) hold 10.
    assert snap["counts"]["kv_slots_filled"] == 22 + 10


# -- end to end against transformers ---------------------------------------------------------------------------
VOCAB = 300
WINDOW = 8
PROMPT_LENS = (21, 9, 30, 14)
MAX_TOKENS = 40
ENGINE_KW = dict(skip_tokenizer_init=True, dtype="float32", device="cpu", swap_space=0.05, block_size=4,
                 max_model_len=128, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A tiny random Gemma 3 with Gemma-3-1B's layout in miniature: one global layer among five local ones."""
    types = ["sliding_attention"] * 5 + ["full_attention"]
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=WINDOW, layer_types=types,
        query_pre_attn_scalar=16, attn_implementation="eager", initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("gemma3_hybrid")
    model.save_pretrained(path, safe_serialization=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    model.generation_config.eos_token_id = None  # ignore_eos on the engine's side: never stop early here either
    return path, prompts, hf_greedy_reference(model, prompts, MAX_TOKENS)[0]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return greedy_token_ids(llm, prompts, MAX_TOKENS)


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_hybrid_engine_matches_transformers_in_a_pool_too_small_for_one_table(kernels: str, gemma3,
                                                                              monkeypatch) -> None:
    """1 full + 5 sliding layers: six groups of one layer, one pool tensor. Every sequence reaches 49-70 tokens: 13-18
    blocks in the full group and about 4 in each sliding one, so 60 blocks make the sequences preempt each other."""
    monkeypatch.setenv("PAGEDLLM_CPU_KERNELS", kernels)
    path, prompts, reference = gemma3
    llm = LLM(model=str(path), num_gpu_blocks_override=60, **ENGINE_KW)
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.group_windows == (None,) + (WINDOW,) * 5
    worker = llm.llm_engine.executor.driver_worker
    assert worker.cache_engine.num_slots == 1 and len(worker.cache_engine.gpu_cache) == 6
    assert _greedy(llm, prompts) == reference
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 60
    assert stats["num_preemptions"] > 0  # the pool is small: sequences were preempted and recomputed
    bm.check_invariants()


@pytest.mark.parametrize("pool,swap", [(60, True), (400, False)])
def test_hybrid_with_swap_and_prefix_caching_matches_transformers(pool: int, swap: bool, gemma3) -> None:
    path, prompts, reference = gemma3
    llm = LLM(model=str(path), num_gpu_blocks_override=pool, preemption_mode="swap" if swap else "recompute",
              enable_prefix_caching=True, **ENGINE_KW)
    assert _greedy(llm, prompts) == reference
    assert _greedy(llm, prompts[:2]) == reference[:2]  # again: found in the cache unless the small pool evicted them
    stats = llm.stats()
    if swap:
        assert stats["num_swap_preemptions"] > 0 and stats["num_swap_ins"] > 0
    else:  # every full block before each prompt's last token, in all six groups
        assert stats["prefix_cache_hits"] == sum((n - 1) // 4 * 4 for n in PROMPT_LENS[:2])
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    llm.llm_engine.scheduler.block_manager.check_invariants()


def test_same_memory_holds_more_tokens_than_one_table(gemma3) -> None:
    """At the same KV bytes, the hybrid pool fits sequences whose one-table layout would not: the one-table engine
    preempts, the hybrid one does not, and both give transformers' tokens."""
    path, prompts, reference = gemma3
    nbytes = 2 * 6 * 4 * 2 * 16 * 4 * 45  # 45 blocks of 6 layers, float32: the sequences need 58 such
    runs = {}
    for hybrid in (True, False):
        llm = LLM(model=str(path), kv_cache_memory_bytes=nbytes, disable_hybrid_kv_cache_manager=not hybrid,
                  **ENGINE_KW)
        assert _greedy(llm, prompts) == reference
        runs[hybrid] = llm.stats()
    assert runs[True]["kv_blocks_total"] == 6 * runs[False]["kv_blocks_total"]  # a block holds 1 layer, not 6
    assert runs[False]["num_preemptions"] > 0 and runs[True]["num_preemptions"] == 0


def test_tensor_parallel_ranks_follow_the_groups(gemma3) -> None:
    path, prompts, reference = gemma3
    llm = LLM(model=str(path), num_gpu_blocks_override=120, tensor_parallel_size=2, distributed_executor_backend="mp",
              **ENGINE_KW)
    assert _greedy(llm, prompts[:2]) == reference[:2]


def test_disable_sliding_window_keeps_one_group(gemma3) -> None:
    path, _, _ = gemma3
    kw = {**ENGINE_KW, "max_model_len": WINDOW}  # capped at the window, where full attention is the same
    llm = LLM(model=str(path), num_gpu_blocks_override=64, disable_sliding_window=True, **kw)
    assert llm.llm_engine.scheduler.block_manager.group_windows == (None,)
    assert llm.llm_engine.executor.driver_worker.cache_engine.num_slots == 6


def test_parallel_sampling_and_beam_search_give_what_one_table_gives(gemma3) -> None:
    """n > 1 forks every group's table and copies shared blocks on write in each group; beam search forks and frees
    beams: the same outputs as with one table (the attention reads the same K/V, from other blocks)."""
    from pagedllm.sampling_params import BeamSearchParams

    path, prompts, _ = gemma3
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
    beams = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    results = {}
    for hybrid in (True, False):
        llm = LLM(model=str(path), num_gpu_blocks_override=400 if hybrid else 120,
                  disable_hybrid_kv_cache_manager=not hybrid, enable_prefix_caching=True, **ENGINE_KW)
        sampled = llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)
        searched = llm.beam_search([{"prompt_token_ids": p} for p in prompts[2:]], beams)
        results[hybrid] = ([[list(c.token_ids) for c in o.outputs] for o in sampled],
                           [[list(b.tokens) for b in o.sequences] for o in searched])
        stats = llm.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        llm.llm_engine.scheduler.block_manager.check_invariants()
    assert results[True] == results[False]
    assert len({tuple(t) for t in results[True][0][0]}) > 1  # the samples differ: the forks really diverged


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("eager", [True, False])
def test_cuda_hybrid_matches_transformers(eager: bool, gemma3, monkeypatch) -> None:
    """On CUDA: the Triton kernels read each group's tables, eagerly and from the graphs' static buffers (decode
    graphs, piecewise graphs' attention between pieces, whole-step graphs), in a pool small enough to preempt.
    (Passed on an H100 and an H200; the layout is on by default on CUDA, CUDA_HYBRID_KV_CACHE_ENV=0 turns it off.)"""
    monkeypatch.delenv(CUDA_HYBRID_KV_CACHE_ENV, raising=False)
    path, prompts, reference = gemma3
    llm = LLM(model=str(path), num_gpu_blocks_override=60, enforce_eager=eager, **{**ENGINE_KW, "device": "cuda"})
    assert llm.llm_engine.scheduler.block_manager.num_groups == 6
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert (runner.graph_runner is None) == eager
    stats = runner.enable_step_stats()
    assert _greedy(llm, prompts) == reference
    paths = {path for _, path, *_ in stats.records}
    if eager:
        assert paths == {"eager"}
    else:  # decode steps replay the decode graphs; prompt steps the piecewise or whole-step ones
        assert "graph" in paths and paths & {"piecewise", "whole"}
    assert llm.stats()["num_preemptions"] > 0
    llm.llm_engine.scheduler.block_manager.check_invariants()


def test_cuda_uses_the_hybrid_layout_unless_opted_out(gemma3, monkeypatch) -> None:
    """A CUDA engine builds the hybrid layout by default and one table with the opt-out set to "0" (the flag is read
    where the config is made: any machine can check it)."""
    from pagedllm.engine.arg_utils import EngineArgs

    monkeypatch.delenv(CUDA_HYBRID_KV_CACHE_ENV, raising=False)
    path, _, _ = gemma3
    kw = {k: v for k, v in ENGINE_KW.items() if k not in ("dtype", "swap_space")}
    args = EngineArgs(model=str(path), **{**kw, "device": "cuda"})
    assert not args.create_engine_config(128, hf_config=None).cache_config.disable_hybrid_kv_cache_manager
    monkeypatch.setenv(CUDA_HYBRID_KV_CACHE_ENV, "0")
    assert args.create_engine_config(128, hf_config=None).cache_config.disable_hybrid_kv_cache_manager
    monkeypatch.setenv(CUDA_HYBRID_KV_CACHE_ENV, "1")
    assert not args.create_engine_config(128, hf_config=None).cache_config.disable_hybrid_kv_cache_manager


def test_hybrid_benchmark_alternates_the_layouts_and_gets_the_same_tokens(gemma3, tmp_path, monkeypatch,
                                                                           capsys) -> None:
    """benchmarks/hybrid_kv_cache.py on the tiny Gemma 3: each layout runs `--rounds` engines (hybrid first, then one
    table first), the two layouts' greedy tokens agree, and each layout's steps are listed against its wall time."""
    import runpy
    import sys

    path, _, _ = gemma3
    out = tmp_path / "hybrid.json"
    bench = Path(__file__).resolve().parent.parent / "benchmarks" / "hybrid_kv_cache.py"
    monkeypatch.setattr(sys, "argv", [str(bench), "--model", str(path), "--num-prompts", "3", "--input-len", "20",
                                      "--output-len", "12", "--block-size", "4", "--kv-cache-memory-bytes", "300000",
                                      "--dtype", "float32", "--device", "cpu", "--rounds", "2",
                                      "--output-json", str(out)])
    runpy.run_path(str(bench), run_name="__main__")
    text = capsys.readouterr().out
    assert "identical greedy outputs 3/3" in text
    assert "hybrid: steps" in text and "one table: steps" in text and "decode/" in text
    result = json.loads(out.read_text())
    assert {k: len(v) for k, v in result["elapsed_s_per_engine"].items()} == {"hybrid": 2, "one table": 2}
    hybrid, one = result["runs"]
    assert hybrid["groups"] > 1 and one["groups"] == 1
    assert hybrid["steps_total_s"] <= hybrid["elapsed_s"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.lists(st.integers(0, 10_000), max_size=40)), min_size=1, max_size=8),
       st.integers(-5, 5))
def test_a_row_filled_from_its_live_tail_is_the_whole_table_with_freed_entries_as_zero(rows, stale: int) -> None:
    """fill_block_table_row converts only the entries after a sliding group's freed ones and writes those as block
    0; the result is the whole table copied with its freed entries set to 0, also over a reused buffer."""
    width = 80
    expected = np.zeros((len(rows), width), dtype=np.int64)
    got = np.full((len(rows), width), stale, dtype=np.int32)  # a CUDA graph's staging rows hold the last step's ids
    for i, (freed, live) in enumerate(rows):
        table = [NULL_BLOCK] * freed + live
        expected[i, : len(table)] = table
        fill_block_table_row(got[i], table)
        got[i, len(table):] = 0  # past the table the callers read nothing
    expected[expected == NULL_BLOCK] = 0
    assert (got == expected).all()
