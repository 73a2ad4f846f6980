"""Asynchronous scheduling: step t+1 is scheduled and launched before step t's tokens reach the host.

On CPU nothing overlaps (torch runs synchronously), but every code path of the pipeline runs: pending
tokens, inputs taken from the previous step's sampled ids on the device, stops discovered one step
late, forks / beams / penalties falling back to synchronous steps. Its outputs must equal the
synchronous engine's on the bundled model, token for token.
"""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams


def _run(llm: LLM, prompts, params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _same(a, b, logprob_tol: float = 1e-3) -> None:
    for ra, rb in zip(a, b, strict=True):
        assert len(ra.outputs) == len(rb.outputs)
        for ca, cb in zip(ra.outputs, rb.outputs):
            assert ca.token_ids == cb.token_ids, ra.request_id
            assert ca.text == cb.text
            assert ca.finish_reason == cb.finish_reason and ca.stop_reason == cb.stop_reason
            assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=logprob_tol)
            if ca.logprobs is not None:
                for da, db in zip(ca.logprobs, cb.logprobs, strict=True):
                    assert list(da) == list(db)
        if ra.prompt_logprobs is not None:
            assert [d and list(d) for d in ra.prompt_logprobs] == [d and list(d) for d in rb.prompt_logprobs]


@pytest.fixture(scope="module")
def pair():
    kw = dict(num_gpu_blocks_override=256, max_model_len=1024)
    return LLM(async_scheduling=False, **kw), LLM(async_scheduling=True, **kw)


def test_async_equals_sync_over_every_sampling_feature(pair, parity_prompts):
    sync, asy = pair
    assert asy.llm_engine.async_scheduling and not sync.llm_engine.async_scheduling
    prompts = parity_prompts[:12]
    params = [
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[" the", "\n"]),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20),
        SamplingParams(temperature=0.9, n=2, seed=3, max_tokens=12),  # forks at prompt end
        SamplingParams(temperature=0.0, max_tokens=16, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=10, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=16, presence_penalty=0.5, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=20),
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[13, 11]),
        SamplingParams(temperature=0.7, top_k=20, seed=11, max_tokens=18),
        SamplingParams(temperature=0.0, max_tokens=64),  # may end at EOS
    ]
    _same(_run(sync, prompts, params), _run(asy, prompts, params))
    for llm in pair:
        st = llm.stats()
        assert st["kv_blocks_free"] == st["kv_blocks_total"]


def test_async_equals_sync_under_preemption_and_chunked_prefill(parity_prompts):
    prompts = parity_prompts[10:14]  # 15 to 153 tokens
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for mode in ("swap", "recompute"):
        kw = dict(num_gpu_blocks_override=14, max_model_len=1024, max_num_batched_tokens=48,
                  preemption_mode=mode, max_num_seqs=4)
        outs, stats = [], []
        for flag in (False, True):
            llm = LLM(async_scheduling=flag, **kw)
            outs.append(_run(llm, prompts, params))
            stats.append(llm.stats())
        _same(*outs)
        for st in stats:
            assert st["num_preemptions"] > 0
            assert st["kv_blocks_free"] == st["kv_blocks_total"]
            assert st["num_cpu_blocks_free"] == st["num_cpu_blocks_total"]


def test_async_with_prefix_caching_hashes_real_tokens(parity_prompts):
    """Blocks filled by a token that was still on the device when they were scheduled must be
    cached under the real token, so a later prompt repeating the whole output hits them."""
    prefix = parity_prompts[14][:64]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs, hits = [], []
    for flag in (False, True):
        llm = LLM(num_gpu_blocks_override=128, max_model_len=1024, enable_prefix_caching=True, async_scheduling=flag)
        first = _run(llm, [prefix], params)[0]
        # Prompt = prefix + the generated tokens: its blocks include ones filled during decoding.
        again = _run(llm, [prefix + list(first.outputs[0].token_ids)], SamplingParams(temperature=0.0, max_tokens=8))
        outs.append([first, *again])
        hits.append(again[0].num_cached_tokens)
    _same(outs[0], outs[1])
    assert hits[0] == hits[1] >= 96  # 64 prompt + ≥ 32 generated tokens came from the cache


def test_steps_are_pipelined_and_abort_leaks_nothing(pair, parity_prompts):
    _, asy = pair
    engine = asy.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(parity_prompts[1:5]):
        engine.add_request(f"a{i}", {"prompt_token_ids": p}, params)
    assert engine.step() == []  # the prompts ran; their first tokens are still "on the device"
    inflight = engine._inflight
    assert inflight is not None and len(inflight.owners) == 4
    assert all(item.seq.num_pending_tokens == 1 and not item.seq.output_token_ids for item in inflight.owners)
    outs = engine.step()  # launches the first decode, then returns the first tokens
    assert sorted(o.request_id for o in outs) == ["a0", "a1", "a2", "a3"]
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
    engine.step()
    engine.abort_request("a1")
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
    assert sorted(finals) == ["a0", "a2", "a3"]
    assert all(len(o.outputs[0].token_ids) == 30 for o in finals.values())
    st = asy.stats()
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and engine._inflight is None


def test_async_scheduling_refuses_tensor_parallelism():
    with pytest.raises(ValueError, match="async_scheduling needs the single-process executor"):
        LLM(async_scheduling=True, tensor_parallel_size=2, num_gpu_blocks_override=16)


def test_async_scheduling_is_off_by_default_on_cpu():
    llm = LLM(num_gpu_blocks_override=16, max_model_len=256, device="cpu")
    assert llm.llm_engine.async_scheduling is False


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_group_finished_by_its_in_flight_token_after_preemption_leaves_the_queues(mode):
    """b is preempted while its only token is still on the device; that token finishes it. It used to stay in
    the waiting queue, finished, in front of every later request: the engine never ran out of work (a 1 000-
    request GPU run hung at 56 %)."""
    llm = LLM(async_scheduling=True, num_gpu_blocks_override=4, max_model_len=16, block_size=4, preemption_mode=mode)
    eng = llm.llm_engine
    params = {"a": SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
              "b": SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)}
    eng.add_request("a", {"prompt_token_ids": list(range(100, 108))}, params["a"])
    eng.add_request("b", {"prompt_token_ids": list(range(200, 208))}, params["b"])
    finished = {}
    for _ in range(50):
        finished.update((o.request_id, o) for o in eng.step() if o.finished)
        if not eng.has_unfinished_requests():
            break
    st = llm.stats()
    assert not eng.has_unfinished_requests(), [(g.request_id, g.is_finished()) for g in eng.scheduler.waiting]
    assert st["num_preemptions"] >= 1
    assert sorted(finished) == ["a", "b"]
    assert [len(finished[r].outputs[0].token_ids) for r in "ab"] == [4, 1]
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and st["num_cpu_blocks_free"] == st["num_cpu_blocks_total"]
