"""The Orca baselines and request-level batching on the real bundled model: same kernels, same model
code, same outputs; only memory management differs (paper §6.1)."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.baselines import ContiguousBlockManager
from pagedllm.core.scheduler import Scheduler

PROMPTS = [
    "Once upon a time",
    "Hello",
    "def fibonacci(n):\n    ",
    "The history of computing is a story of abstractions built on top of one another. Early machines were",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # Built through the engine arguments of a baseline; tests switch the KV manager with `_use`.
    return LLM(num_gpu_blocks_override=64, block_size=8, max_model_len=128, max_num_seqs=8,
               kv_cache_manager="orca-pow2", batching="request")


def _use(llm: LLM, manager: str, batching: str = "iteration") -> None:
    """A fresh scheduler (and KV manager) over the same model, executor and KV pool."""
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests()
    cc, sc = eng.config.cache_config, eng.config.scheduler_config
    cc.kv_cache_manager, sc.batching = manager, batching
    eng.scheduler = Scheduler(sc, cc)
    eng.output_processor.scheduler = eng.scheduler


@pytest.fixture(autouse=True)
def _no_leaks(llm):
    yield
    s = llm.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] == 64, "KV blocks leaked"
    llm.llm_engine.scheduler.block_manager.check_invariants()


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_engine_args_select_the_baseline(llm):
    eng = llm.llm_engine
    assert isinstance(eng.scheduler.block_manager, ContiguousBlockManager)
    assert eng.scheduler.block_manager.policy == "orca-pow2" and eng.config.scheduler_config.batching == "request"


def test_greedy_outputs_identical_under_every_manager_and_batching_mode(llm):
    _use(llm, "paged", "iteration")
    ref = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert all(len(o[0]) == 10 for o in ref)
    for manager, batching in [("orca-oracle", "iteration"), ("orca-pow2", "iteration"), ("orca-max", "iteration"),
                              ("paged", "request"), ("orca-max", "request")]:
        _use(llm, manager, batching)
        got = _tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        assert got == ref, f"{manager} + {batching} changed the outputs"


def test_parallel_sampling_and_beam_search_identical_under_orca(llm):
    sampled = SamplingParams(temperature=1.0, top_p=0.9, n=2, max_tokens=6, seed=7, ignore_eos=True)
    beam = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0.0, max_tokens=5)
    prompts = PROMPTS[:2]
    _use(llm, "paged")
    ref = (_tokens(llm.generate(prompts, sampled, use_tqdm=False)), _tokens(llm.generate(prompts, beam, use_tqdm=False)))
    for manager in ("orca-oracle",):
        _use(llm, manager)
        got = (_tokens(llm.generate(prompts, sampled, use_tqdm=False)),
               _tokens(llm.generate(prompts, beam, use_tqdm=False)))
        assert got == ref, manager
        assert llm.llm_engine.scheduler.block_manager.num_fork_block_copies > 0  # forks copy KV, no sharing


def test_kv_breakdown_on_a_real_run(llm):
    """Fig. 2 mid-run: parts sum to the pool; Orca-Max keeps a smaller share on token states than paged."""
    share = {}
    for manager in ("paged", "orca-max"):
        _use(llm, manager)
        eng = llm.llm_engine
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"{manager}-{i}", p, GREEDY)
        fracs = []
        for _ in range(4):
            eng.step()
            b = eng.kv_memory_breakdown()
            parts = (b.token_states, b.reservation, b.internal_fragmentation, b.external_fragmentation, b.free)
            assert min(parts) >= 0 and sum(parts) == b.total == 64 * 8
            used = b.total - b.free
            fracs.append(b.token_states / used if used else 1.0)
        s = llm.stats()
        assert sum(s[k] for k in s if k.startswith("kv_frac_")) == pytest.approx(1.0)
        while eng.has_unfinished_requests():
            eng.step()
        share[manager] = sum(fracs) / len(fracs)
    # Paged holds at most one partly filled block per sequence; Orca-Max a 128-token region each.
    assert share["paged"] > 4 * share["orca-max"], share


def test_what_a_contiguous_manager_cannot_do_is_a_clear_error(llm):
    _use(llm, "orca-oracle")
    # 5 sequences of 8 + 100 tokens: five 16-block regions, the 64-block pool holds four.
    with pytest.raises(ValueError, match="kv_cache_manager='orca-oracle'.*5 sequences.*holds 4"):
        llm.generate("Hello there my", SamplingParams(n=5, temperature=1.0, max_tokens=100, seed=1), use_tqdm=False)
    assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # the engine still serves
    with pytest.raises(ValueError, match="enable_prefix_caching needs kv_cache_manager='paged'"):
        LLM(kv_cache_manager="orca-max", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="preemption_mode='swap' needs kv_cache_manager='paged'"):
        LLM(kv_cache_manager="orca-oracle", preemption_mode="swap")
    with pytest.raises(ValueError, match="orca-oracle"):
        LLM(kv_cache_manager="orca")
    with pytest.raises(ValueError, match="max_model_len=128"):
        LLM(kv_cache_manager="orca-max", num_gpu_blocks_override=8, block_size=8, max_model_len=128)
