"""The engine's start-up heap is frozen out of full garbage collections (engine/gc_heap.py), and freezing it
does not keep a dropped engine alive."""
import gc
import weakref

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine

KW = dict(max_model_len=256, num_gpu_blocks_override=64)


def _tracked(obj) -> bool:
    """Whether a collection would walk `obj` (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


def test_the_engine_is_frozen_and_del_llm_still_frees_it():
    llm = LLM(**KW)
    engine, runner = llm.llm_engine, llm.llm_engine.executor.driver_worker.model_runner
    assert gc.get_freeze_count() > 10_000
    assert not _tracked(engine) and not _tracked(runner)
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    gone = weakref.ref(engine)
    del llm, engine, runner, out
    gc.collect()
    assert gone() is None  # the engine sits in reference cycles: only a collection frees it


def test_a_new_engine_collects_an_earlier_frozen_one_before_it_sizes_its_pool():
    first = LLMEngine(EngineArgs.from_kwargs(**KW))
    gone = weakref.ref(first)
    del first  # no gc.collect(): the frozen cycles stay until the next engine starts
    assert gone() is not None
    second = LLMEngine(EngineArgs.from_kwargs(**KW))
    assert gone() is None
    assert not _tracked(second)
    gc.unfreeze()


def test_generate_makes_young_collections_rarer_and_restores_the_thresholds():
    from pagedllm.engine.gc_heap import STEPPING_GEN0_THRESHOLD

    llm = LLM(**KW)
    before = gc.get_threshold()
    seen = []
    real_step = llm.llm_engine.step

    def step():
        seen.append(gc.get_threshold())
        return real_step()

    llm.llm_engine.step = step
    llm.generate(["Once upon a time"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert seen and all(t == (max(STEPPING_GEN0_THRESHOLD, before[0]), *before[1:]) for t in seen)
    assert gc.get_threshold() == before

    def failing_step():
        raise RuntimeError("step failed")

    llm.llm_engine.step = failing_step
    with pytest.raises(RuntimeError, match="step failed"):
        llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert gc.get_threshold() == before  # restored on the way out of a failure too
