"""Memory sharing on the real model: parallel sampling, mixed batches, prefix caching, swap/recompute."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

BLOCK = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SYSTEM = (
    "You are a careful assistant. Answer every question in one short sentence, "
    "use plain words, and never invent facts you are not sure about.\n"
)
QUESTIONS = ["Q: What is the capital of Italy?\nA:", "Q: How many legs does a spider have?\nA:",
             "Q: What color is grass?\nA:", "Q: Who wrote Hamlet?\nA:",
             "Q: What is frozen water called?\nA:", "Q: What do bees make?\nA:"]


def _make(**kw) -> LLM:
    return LLM(block_size=BLOCK, max_model_len=512, **kw)


@pytest.fixture(scope="module")
def llm():
    # 40 blocks × 8 = 320 token slots; 40 CPU swap blocks (~0.37 MB each).
    return _make(num_gpu_blocks_override=40, swap_space=0.014)


@pytest.fixture(scope="module")
def llm_pc():
    # Prefix caching on; a 2-block swap pool, too small to hold any beam group.
    return _make(num_gpu_blocks_override=40, swap_space=0.0008, enable_prefix_caching=True)


def _assert_all_free(llm: LLM) -> None:
    eng = llm.llm_engine
    bm = eng.scheduler.block_manager
    bm.check_invariants()
    assert not eng.has_unfinished_requests()
    assert bm.get_num_free_gpu_blocks() == bm.num_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_cpu_blocks
    assert all(c == 0 for c in bm.gpu_pool.ref_counts) and all(c == 0 for c in bm.cpu_pool.ref_counts)


@pytest.fixture(autouse=True)
def _all_blocks_free(request):
    yield
    for name in ("llm", "llm_pc"):
        if name in request.fixturenames:
            _assert_all_free(request.getfixturevalue(name))


@pytest.fixture
def mode(llm):
    """Set llm's preemption mode for one test, restore it after."""
    cc = llm.llm_engine.config.cache_config
    old = cc.preemption_mode
    yield lambda m: setattr(cc, "preemption_mode", m)
    cc.preemption_mode = old


def _ids(llm, texts):
    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": tok.encode(t)} for t in texts]


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _one_by_one(llm, prompts, params):
    return [_tokens(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]


def _delta(before, after, key):
    return after[key] - before[key]


# -- parallel sampling ----------------------------------------------------------------------
def test_seeded_parallel_sampling_is_reproducible_and_diverse(llm):
    p = _ids(llm, ["Write a short poem about the sea:"])[0]
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10)
    a = _tokens(llm.generate([p], params, use_tqdm=False))[0]
    # Same request again, now batched with unrelated work: identical samples.
    other = _ids(llm, ["The quick brown fox"])[0]
    b = _tokens(llm.generate([other, p], [GREEDY, params], use_tqdm=False))[1]
    assert a == b
    assert len(a) == 3 and len({tuple(x) for x in a}) == 3  # the n samples differ
    c = _tokens(llm.generate([p], SamplingParams(n=3, temperature=1.0, seed=8, max_tokens=10), use_tqdm=False))[0]
    assert c != a


def test_best_of_returns_top_n_by_cumulative_logprob_and_shares_prompt(llm):
    p = _ids(llm, [SYSTEM + QUESTIONS[0]])[0]
    n_prompt = len(p["prompt_token_ids"])
    eng = llm.llm_engine
    eng.add_request("bo", p, SamplingParams(n=2, best_of=4, temperature=0.8, seed=3, max_tokens=8))
    eng.step()
    s = llm.stats()
    full_blocks = n_prompt // BLOCK
    # 4 sequences forked from one prefill share every prompt block (no KV bytes copied).
    assert s["kv_blocks_shared"] == -(-n_prompt // BLOCK)
    assert s["kv_blocks_saved_by_sharing"] == 3 * -(-n_prompt // BLOCK)
    eng.step()
    s2 = llm.stats()
    if n_prompt % BLOCK:  # the partly filled last block is copied on write by 3 of the 4 children
        assert _delta(s, s2, "num_cow_copies") == 3
        assert s2["kv_blocks_shared"] == full_blocks
    group = eng.scheduler.running[0]
    every = sorted(x.cumulative_logprob for x in group.seqs)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            final = out if out.finished else final
    every = sorted((x.cumulative_logprob for x in group.seqs), reverse=True)
    assert len(every) == 4 and len(final.outputs) == 2
    assert [c.cumulative_logprob for c in final.outputs] == every[:2]


def test_mixed_decoding_methods_in_one_batch(llm):
    prompts = _ids(llm, ["The capital of France is", "Once upon a time", "def add(a, b):"])
    params = [
        GREEDY,
        SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=10),
        SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0.0, max_tokens=8),
    ]
    alone = [_tokens(llm.generate([p], q, use_tqdm=False))[0] for p, q in zip(prompts, params)]
    together = _tokens(llm.generate(prompts, params, use_tqdm=False))
    assert together == alone
    assert [len(x) for x in together] == [1, 2, 2]


# -- prefix caching -------------------------------------------------------------------------
def test_greedy_same_with_and_without_prefix_caching_and_shared_prefix(llm, llm_pc):
    prompts = _ids(llm, [SYSTEM + q for q in QUESTIONS[:4]])
    n_sys_blocks = len(llm.get_tokenizer().encode(SYSTEM)) // BLOCK
    reference = _one_by_one(llm, prompts, GREEDY)  # no caching, one at a time
    assert llm_pc.reset_prefix_cache()
    before = llm_pc.stats()
    first = llm_pc.generate(prompts[:1], GREEDY, use_tqdm=False)
    assert first[0].num_cached_tokens == 0  # nothing cached yet
    rest = llm_pc.generate(prompts[1:], GREEDY, use_tqdm=False)
    # The shared system prompt hits the cache after its first use.
    for out in rest:
        assert out.num_cached_tokens >= n_sys_blocks * BLOCK
    assert _tokens(first + rest) == reference
    after = llm_pc.stats()
    assert _delta(before, after, "prefix_cache_hits") == sum(o.num_cached_tokens for o in rest)
    assert _delta(before, after, "prefix_cache_queries") == sum(len(p["prompt_token_ids"]) for p in prompts)
    # Identical prompt again: everything but the last token's block comes from the cache.
    again = llm_pc.generate(prompts[:1], GREEDY, use_tqdm=False)
    n = len(prompts[0]["prompt_token_ids"])
    assert again[0].num_cached_tokens == (n - 1) // BLOCK * BLOCK
    assert _tokens(again) == reference[:1]


def test_reset_prefix_cache_as_vllm_names_it(llm_pc):
    """LLM.reset_prefix_cache(): a prompt cached before the reset is computed again after it, with the same tokens;
    refused (False, nothing dropped) while a request holds blocks; reset_running_requests=True is a clear error."""
    prompts = _ids(llm_pc, [SYSTEM + QUESTIONS[5]])
    n = len(prompts[0]["prompt_token_ids"])
    first = llm_pc.generate(prompts, GREEDY, use_tqdm=False)
    assert llm_pc.generate(prompts, GREEDY, use_tqdm=False)[0].num_cached_tokens == (n - 1) // BLOCK * BLOCK
    eng = llm_pc.llm_engine
    eng.add_request("held", prompts[0], GREEDY)
    eng.step()
    assert not llm_pc.reset_prefix_cache()
    with pytest.raises(ValueError, match=r"reset_running_requests=True\) is not supported"):
        llm_pc.reset_prefix_cache(reset_running_requests=True)
    while eng.has_unfinished_requests():
        eng.step()
    assert llm_pc.generate(prompts, GREEDY, use_tqdm=False)[0].num_cached_tokens > 0  # nothing was dropped
    assert llm_pc.reset_prefix_cache()
    after = llm_pc.generate(prompts, GREEDY, use_tqdm=False)
    assert after[0].num_cached_tokens == 0
    assert _tokens(after) == _tokens(first)


def test_prompt_logprobs_compute_the_whole_prompt_under_prefix_caching(llm_pc):
    """A cached block has no logits, so a request for prompt log-probs reads nothing from the prefix cache (as
    vLLM): every position after the first has its log-probs, the same as with the prompt uncached; the blocks it
    computes are still cached for the requests after it."""
    prompts = _ids(llm_pc, [SYSTEM + QUESTIONS[3]])
    n = len(prompts[0]["prompt_token_ids"])
    with_plp = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2)
    assert llm_pc.reset_prefix_cache()
    before = llm_pc.stats()
    cold = llm_pc.generate(prompts, with_plp, use_tqdm=False)[0]
    warm = llm_pc.generate(prompts, with_plp, use_tqdm=False)[0]
    assert cold.num_cached_tokens == warm.num_cached_tokens == 0
    assert _delta(before, llm_pc.stats(), "prefix_cache_queries") == 0  # no lookup was made
    for out in (cold, warm):
        assert out.prompt_logprobs[0] is None
        assert all(d is not None and len(d) >= 2 for d in out.prompt_logprobs[1:])
    assert [list(d) for d in warm.prompt_logprobs[1:]] == [list(d) for d in cold.prompt_logprobs[1:]]
    for a, b in zip(cold.prompt_logprobs[1:], warm.prompt_logprobs[1:]):
        assert [e.logprob for e in b.values()] == pytest.approx([e.logprob for e in a.values()], abs=1e-4)
        assert [e.rank for e in b.values()] == [e.rank for e in a.values()]
    plain = llm_pc.generate(prompts, GREEDY, use_tqdm=False)[0]
    assert plain.num_cached_tokens == (n - 1) // BLOCK * BLOCK


def test_cache_salt_keeps_prefix_caches_apart(llm_pc):
    """vLLM's `cache_salt` in a prompt dict: the same prompt is found in the cache only under the same salt; the
    outputs do not change; an empty salt is a clear error."""
    ids = _ids(llm_pc, [SYSTEM + QUESTIONS[2]])[0]
    n = len(ids["prompt_token_ids"])
    assert llm_pc.reset_prefix_cache()
    ref = llm_pc.generate([ids], GREEDY, use_tqdm=False)[0]
    runs = {}
    for name, salt in (("a", "secret-a"), ("a again", "secret-a"), ("b", "secret-b"), ("none", None)):
        prompt = dict(ids) if salt is None else {**ids, "cache_salt": salt}
        runs[name] = llm_pc.generate([prompt], GREEDY, use_tqdm=False)[0]
    full = (n - 1) // BLOCK * BLOCK
    assert {k: o.num_cached_tokens for k, o in runs.items()} == {"a": 0, "a again": full, "b": 0, "none": full}
    assert all(o.outputs[0].token_ids == ref.outputs[0].token_ids for o in runs.values())
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm_pc.generate([{**ids, "cache_salt": ""}], GREEDY, use_tqdm=False)


def test_shared_prefix_blocks_are_never_written(llm_pc):
    """Parallel samples on top of a cached prefix: CoW protects the cached blocks' contents."""
    prompts = _ids(llm_pc, [SYSTEM + QUESTIONS[4]])
    ref = _tokens(llm_pc.generate(prompts, GREEDY, use_tqdm=False))
    llm_pc.generate(prompts, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=10), use_tqdm=False)
    assert _tokens(llm_pc.generate(prompts, GREEDY, use_tqdm=False)) == ref


# -- preemption -----------------------------------------------------------------------------
def _crowd(llm):
    # 6 prompts × ~45 tokens + 12 generated each overflow 320 slots when run together.
    return _ids(llm, [SYSTEM + q for q in QUESTIONS])


@pytest.mark.slow
@pytest.mark.parametrize("preemption", ["swap", "recompute"])
def test_greedy_same_when_preempted(llm, mode, preemption):
    prompts = _crowd(llm)
    reference = _one_by_one(llm, prompts, GREEDY)
    mode(preemption)
    before = llm.stats()
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    after = llm.stats()
    assert got == reference
    if preemption == "swap":
        assert _delta(before, after, "num_swap_preemptions") > 0
        assert _delta(before, after, "num_swap_outs") == _delta(before, after, "num_swap_ins") > 0
        assert _delta(before, after, "num_swapped_out_blocks") > 0
        assert _delta(before, after, "num_recompute_preemptions") == 0
    else:
        assert _delta(before, after, "num_recompute_preemptions") > 0
        assert _delta(before, after, "num_swap_preemptions") == 0


@pytest.mark.slow
def test_auto_swaps_multi_sequence_groups(llm, mode):
    """Under "auto", beam groups are swapped (not recomputed) and give the same beams."""
    prompts = _crowd(llm)
    beam = SamplingParams(use_beam_search=True, best_of=2, n=2, temperature=0.0, max_tokens=10)
    reference = _one_by_one(llm, prompts, beam)
    mode("auto")
    before = llm.stats()
    got = _tokens(llm.generate(prompts, beam, use_tqdm=False))
    after = llm.stats()
    assert got == reference
    assert _delta(before, after, "num_swap_preemptions") > 0
    assert _delta(before, after, "num_recompute_preemptions") == 0


@pytest.mark.slow
def test_swap_space_exhausted_falls_back_to_recompute(llm_pc):
    """A 2-block swap pool cannot hold a beam group: it is recomputed instead, same beams."""
    prompts = _ids(llm_pc, [q * 4 for q in QUESTIONS])  # distinct prompts: no prefix-cache sharing
    beam = SamplingParams(use_beam_search=True, best_of=2, n=2, temperature=0.0, max_tokens=10)
    reference = _one_by_one(llm_pc, prompts, beam)
    before = llm_pc.stats()
    got = _tokens(llm_pc.generate(prompts, beam, use_tqdm=False))
    after = llm_pc.stats()
    assert got == reference
    assert _delta(before, after, "num_recompute_preemptions") > 0
    assert _delta(before, after, "num_swap_preemptions") == 0
    assert after["num_cpu_blocks_free"] == after["num_cpu_blocks_total"] == 2


# -- stats ----------------------------------------------------------------------------------
def test_sharing_stats_match_block_tables(llm):
    """kv_blocks_shared / kv_blocks_saved_by_sharing recomputed from the tables at every step."""
    eng = llm.llm_engine
    prompts = _ids(llm, ["The capital of France is", "Once upon a time"])
    eng.add_request("s1", prompts[0], SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=10))
    eng.add_request("s2", prompts[1], SamplingParams(use_beam_search=True, best_of=2, temperature=0.0, max_tokens=10))
    seen_shared = 0
    while eng.has_unfinished_requests():
        eng.step()
        bm = eng.scheduler.block_manager
        refs: dict[int, int] = {}
        for table in bm.block_tables.values():
            for b in table:
                refs[b] = refs.get(b, 0) + 1
        s = llm.stats()
        assert s["kv_blocks_shared"] == sum(1 for c in refs.values() if c > 1)
        assert s["kv_blocks_saved_by_sharing"] == sum(c - 1 for c in refs.values())
        assert s["kv_blocks_free"] == bm.num_gpu_blocks - len(refs)
        seen_shared = max(seen_shared, s["kv_blocks_saved_by_sharing"])
    assert seen_shared > 0
