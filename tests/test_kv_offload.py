"""The CPU tier under the prefix cache (vLLM's native KV offloading, `kv_offloading_size`): blocks the device pool
evicts are kept on the CPU and copied back on a prefix hit; the copies run with the step's block moves."""
from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import CacheConfig
from pagedllm.core.block_manager import BlockManager
from pagedllm.core.sequence import Sequence

BS = 4


def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens)


def _run(bm: BlockManager, seq: Sequence) -> int:
    """Admit `seq` (cached prefix first), give it its blocks, compute and cache them all, then free it → tokens the
    prefix cache gave."""
    hit = bm.allocate_cached_prefix(seq)
    seq.num_computed_tokens = hit
    bm.allocate_slots(seq, seq.get_len() - hit)
    seq.num_computed_tokens = seq.get_len()
    bm.cache_computed_blocks(seq)
    bm.free(seq)
    return hit


def test_evicted_blocks_go_to_the_tier_and_come_back():
    bm = BlockManager(block_size=BS, num_gpu_blocks=6, num_cpu_blocks=3, enable_caching=True, watermark=0.0,
                      num_offload_blocks=8)
    a = list(range(100, 117))  # 4 full blocks + 1 token
    assert _run(bm, _seq(0, a)) == 0
    assert bm.take_offload_moves() == ([], [])  # nothing evicted yet
    # another prompt takes 5 blocks: the pool's 2 free ones, then 3 of a's cached blocks, LRU (a frees its tail
    # first, so its last blocks are evicted first and its prefix outlives them)
    b = list(range(500, 517))
    _run(bm, _seq(1, b))
    stores, loads = bm.take_offload_moves()
    assert len(stores) == 3 and not loads
    assert all(cpu >= 3 for _, cpu in stores)  # tier ids come after the 3 swap blocks
    bm.check_invariants()
    # a again: its first block is still on the device, the next three come back from the tier
    seq = _seq(2, a)
    hit = bm.allocate_cached_prefix(seq)
    assert hit == 16
    stores, loads = bm.take_offload_moves()
    assert len(loads) == 3
    stored_cpu = {cpu for _, cpu in bm.offload.pool._hash_to_block.items()}  # (tier-local ids)
    assert {cpu - 3 for cpu, _ in loads} <= stored_cpu
    table = bm.get_block_table(seq)
    assert [gpu for _, gpu in loads] == table[1:4]
    # loading took device blocks: the free one, then two of b's cached ones, evicted and stored in the same moves, so
    # they are copied out before the loads write them (the worker's order: swap-outs, then swap-ins)
    assert len(stores) == 2 and {gpu for gpu, _ in stores} <= {gpu for _, gpu in loads}
    assert bm.offload.stats.num_hit_tokens == 12
    seq.num_computed_tokens = hit
    bm.allocate_slots(seq, 1)
    bm.free(seq)
    bm.check_invariants()


def test_a_block_loading_this_step_is_not_stored_again_and_pinned_sources_survive():
    bm = BlockManager(block_size=BS, num_gpu_blocks=4, num_cpu_blocks=0, enable_caching=True, watermark=0.0,
                      num_offload_blocks=4)
    a, b = list(range(100, 113)), list(range(200, 213))  # 3 full blocks + 1 each
    _run(bm, _seq(0, a))
    _run(bm, _seq(1, b))  # evicts a's 3 cached blocks into the tier
    stores, _ = bm.take_offload_moves()
    assert len(stores) == 3
    seq = _seq(2, a)
    # all three loaded: the first device block is the free one, the others evict b's blocks, of which the tier
    # (3 blocks pinned as the loads' sources, 1 free) keeps one; it does not evict a source to keep another
    assert bm.allocate_cached_prefix(seq) == 12
    stores, loads = bm.take_offload_moves()
    assert len(loads) == 3 and len(stores) == 1
    sources = [cpu for cpu, _ in loads]
    assert not set(sources) & {cpu for _, cpu in stores}  # no store overwrote a pending load's source
    bm.check_invariants()


def test_tier_needs_prefix_caching_and_full_attention():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        BlockManager(block_size=BS, num_gpu_blocks=4, num_offload_blocks=2)
    with pytest.raises(ValueError, match="sliding windows"):
        BlockManager(block_size=BS, num_gpu_blocks=4, enable_caching=True, sliding_window=8, num_offload_blocks=2)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        CacheConfig(kv_offloading_size=1.0)
    with pytest.raises(ValueError, match="supported: native"):
        CacheConfig(kv_offloading_size=1.0, enable_prefix_caching=True, kv_offloading_backend="lmcache")
    with pytest.raises(ValueError, match="needs kv_offloading_size"):
        CacheConfig(kv_offloading_backend="native")
    with pytest.raises(ValueError, match="positive number of GiB"):
        CacheConfig(kv_offloading_size=-1, enable_prefix_caching=True)


# -- the engine ---------------------------------------------------------------------------------
def _prompts() -> list[dict]:
    rng = random.Random(0)
    shared = [rng.randrange(100, 40000) for _ in range(40)]
    docs = [[rng.randrange(100, 40000) for _ in range(150)] for _ in range(6)]
    return [{"prompt_token_ids": d + shared + [i]} for i, d in enumerate(docs)]


def _serve_twice(blocks: int, **kw) -> tuple[list[list[int]], dict]:
    """Each prompt alone, all of them twice: the second round finds the first round's prompts cached, on the device
    (a big pool) or in the tier (a small pool with one)."""
    llm = LLM(max_model_len=512, num_gpu_blocks_override=blocks, enable_prefix_caching=True, dtype="float32",
              **kw)
    sp = SamplingParams(temperature=0, max_tokens=8)
    outs = [list(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids) for _ in range(2) for p in _prompts()]
    bm = llm.llm_engine.scheduler.block_manager
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks
    return outs, llm.llm_engine.stats()


@pytest.fixture(scope="module")
def device_cached():
    return _serve_twice(400, swap_space=0.01)


def test_engine_tier_hits_give_the_device_cache_outputs(device_cached):
    """A 40-block pool holds ~3 of the 6 prompts: without a tier the second round recomputes them; with one it copies
    their blocks back and emits exactly what hits in a pool that kept everything do."""
    want, big = device_cached
    outs, st = _serve_twice(40, swap_space=0.01, kv_offloading_size=0.05)
    assert outs == want
    assert st["kv_offload_stored_blocks"] > 0 and st["kv_offload_loaded_blocks"] > 0
    assert st["prefix_cache_hits"] == big["prefix_cache_hits"]  # every hit the big pool had
    _, plain = _serve_twice(40, swap_space=0.01)
    assert plain["prefix_cache_hits"] < st["prefix_cache_hits"]
    assert "kv_offload_stored_blocks" not in plain
    from pagedllm.engine.metrics import EngineMetrics

    text = EngineMetrics("m", lambda: st).render().decode()
    assert f'pagedllm:kv_offload_loaded_blocks_total{{model_name="m"}} {float(st["kv_offload_loaded_blocks"])}' in text
    assert "pagedllm:kv_offload" not in EngineMetrics("m", lambda: plain).render().decode()


def test_engine_tier_beside_swap_preemption():
    """Swap preemption and the tier share the CPU cache tensor (swap blocks first): concurrent requests in a pool
    too small for them, outputs equal to the same run without the tier."""
    params = SamplingParams(temperature=0, max_tokens=24)

    def run(**kw):
        llm = LLM(max_model_len=512, num_gpu_blocks_override=40, enable_prefix_caching=True, dtype="float32",
                  preemption_mode="swap", swap_space=0.05, **kw)
        outs = []
        for _ in range(2):
            outs += [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), params, use_tqdm=False)]
        st = llm.llm_engine.stats()
        llm.llm_engine.scheduler.block_manager.check_invariants()
        assert st["kv_blocks_free"] == st["kv_blocks_total"]
        return outs, st

    plain, st0 = run()
    tiered, st1 = run(kv_offloading_size=0.05)
    assert st1["num_swap_preemptions"] > 0
    assert tiered == plain
    assert st1["kv_offload_stored_blocks"] > 0
