"""AsyncLLMEngine in-process on the real model: concurrent streams, abort, and step faults."""
from __future__ import annotations

import asyncio

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError


@pytest.fixture(scope="module")
def engine_args():
    return EngineArgs(num_gpu_blocks_override=64, max_model_len=512, swap_space=0.05)


@pytest.fixture(scope="module")
def core_engine(engine_args):
    from pagedllm.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(engine_args)


def _run(core, coro_fn):
    async def main():
        engine = AsyncLLMEngine(core)
        engine.start()
        try:
            return await coro_fn(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_concurrent_streams_match_sync_engine(core_engine):
    prompts = ["The capital of France is", "1, 2, 3,", "Hello, my name is"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def body(engine):
        async def one(i, p):
            outs = [o async for o in engine.generate(p, params, f"r{i}")]
            return outs

        return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])

    results = _run(core_engine, body)
    for outs in results:
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
        assert [len(o.outputs[0].token_ids) for o in outs] == sorted(len(o.outputs[0].token_ids) for o in outs)
        assert len(outs) >= 8  # one output per generated token at least (streamed, not batched at the end)
    # The same greedy text as the synchronous engine.
    for i, p in enumerate(prompts):
        core_engine.add_request(f"sync{i}", p, params)
    finals = {}
    while core_engine.has_unfinished_requests():
        for o in core_engine.step():
            if o.finished:
                finals[o.request_id] = o.outputs[0].text
    assert [finals[f"sync{i}"] for i in range(3)] == [r[-1].outputs[0].text for r in results]


def test_delta_streams_join_into_the_cumulative_output(core_engine):
    """A RequestOutputKind.DELTA request through the async front: each output holds only the new tokens and text;
    a slow reader with coalescing gets the steps it missed merged into one delta. Joined, they equal the
    cumulative output of the same greedy request."""
    from pagedllm.sampling_params import RequestOutputKind

    prompt = "The capital of France is"
    delta = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    cumulative = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def body(engine):
        fast = [o async for o in engine.generate(prompt, delta, "fast")]
        slow = []
        async for o in await engine.add_request("slow", prompt, delta, coalesce=True):
            slow.append(o)
            await asyncio.sleep(0.05)  # several steps go by: their cumulative outputs coalesce
        full = [o async for o in engine.generate(prompt, cumulative, "full")][-1]
        return fast, slow, full

    fast, slow, full = _run(core_engine, body)
    assert delta.output_kind is RequestOutputKind.DELTA  # the caller's params are left as they were
    want = full.outputs[0]
    for outs in (fast, slow):
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        assert sum((o.outputs[0].token_ids for o in outs), []) == want.token_ids
        assert "".join(o.outputs[0].text for o in outs) == want.text
    assert len(fast) == 12 and all(len(o.outputs[0].token_ids) == 1 for o in fast)
    assert len(slow) < 12 and max(len(o.outputs[0].token_ids) for o in slow) > 1


def test_abort_frees_blocks_and_bad_request_raises(core_engine):
    async def body(engine):
        with pytest.raises(ValueError, match="prompt"):
            await engine.add_request("bad", [], SamplingParams())
        gen = engine.generate("Tell me a story", SamplingParams(max_tokens=400, ignore_eos=True), "long")
        first = await gen.__anext__()
        assert not first.finished
        busy = engine.stats()
        for _ in range(50):  # snapshots come at most every stats_interval_s while busy: read on until one shows it
            if busy["kv_blocks_free"] < busy["kv_blocks_total"]:
                break
            assert not (await gen.__anext__()).finished
            busy = engine.stats()
        await gen.aclose()  # leaving the stream aborts the request
        for _ in range(100):
            await asyncio.sleep(0.02)
            s = engine.stats()
            if s["num_running"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]:
                return busy, s
        return busy, engine.stats()

    busy, idle = _run(core_engine, body)
    assert busy["kv_blocks_free"] < busy["kv_blocks_total"]
    assert idle["num_running"] == 0 and idle["num_waiting"] == 0
    assert idle["kv_blocks_free"] == idle["kv_blocks_total"]
    assert idle["generation_tokens_total"] - busy["generation_tokens_total"] < 100


def test_shutdown_ends_an_open_stream_with_an_error_and_frees_its_blocks(core_engine):
    """A request still running at shutdown is told so (EngineDeadError: a server turns it into an error event,
    never a bare [DONE]), and the engine it ran on is left with no request and every block free."""
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def main():
        engine = AsyncLLMEngine(core_engine)
        engine.start()
        stream = await engine.add_request("cut", "Tell me a story", params)
        assert not (await stream.__anext__()).finished
        await engine.shutdown()
        seen = []
        with pytest.raises(EngineDeadError, match="shut down"):
            async for out in stream:
                seen.append(out)
        assert not any(o.finished for o in seen)

    asyncio.run(main())
    assert not core_engine.has_unfinished_requests()
    stats = core_engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_step_fault_fails_requests_and_engine_recovers(core_engine, monkeypatch):
    real = core_engine.executor.execute_model
    calls = {"n": 0}

    def flaky(req):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected model failure")
        return real(req)

    monkeypatch.setattr(core_engine.executor, "execute_model", flaky)

    async def body(engine):
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

        async def consume(rid):
            return [o async for o in engine.generate("Once upon a time", params, rid)]

        results = await asyncio.wait_for(asyncio.gather(consume("a"), consume("b"), return_exceptions=True), 60)
        healthy_after_fault = engine.is_healthy
        again = await asyncio.wait_for(consume("c"), 60)
        return results, healthy_after_fault, again, engine.stats()

    results, healthy, again, stats = _run(core_engine, body)
    assert all(isinstance(r, EngineStepError) and "injected model failure" in str(r) for r in results)
    assert healthy  # the pool was sound after aborting, so the engine keeps serving
    assert again[-1].finished and len(again[-1].outputs[0].token_ids) == 20
    assert stats["num_step_faults"] == 1
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_idle_engine_releases_freed_memory_once(core_engine, monkeypatch):
    """After work, once idle for `idle_release_s`, the executor is asked once to return freed host memory."""
    calls = []
    real = core_engine.executor.release_free_memory
    monkeypatch.setattr(core_engine.executor, "release_free_memory", lambda: calls.append(1) or real())
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def body(engine):
        engine.idle_release_s = 0.2
        await asyncio.sleep(0.6)
        assert calls == []  # never before any work
        outs = [o async for o in engine.generate("Hello", params, "idle0")]
        assert outs[-1].finished
        await asyncio.sleep(0.8)
        assert calls == [1]  # once per idle period, not every timeout
        outs = [o async for o in engine.generate("Hello", params, "idle1")]
        await asyncio.sleep(0.8)
        assert calls == [1, 1]

    _run(core_engine, body)
