"""The engine in an engine-core process (`AsyncMPClient`, the server's default) on the real model.

Checked against the in-process engine: the same greedy outputs, token for token, through the delta
codec; aborts free blocks in the other process; a bad request is refused on the caller's side; a dead
engine-core process ends every stream with EngineDeadError instead of hanging; shutdown leaves no process.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import EngineDeadError
from pagedllm.engine.core_client import AsyncMPClient
from pagedllm.engine.output_codec import OutputDecoder, OutputEncoder
from pagedllm.outputs import CompletionOutput, RequestOutput

PROMPTS = ["The capital of France is", "1, 2, 3,", "Hello, my name is", "def fibonacci(n):"]


def _out(rid: str, comps: list[tuple[int, list[int], str]], finished: bool = False, logprobs: bool = False):
    return RequestOutput(rid, None, [1, 2, 3], [
        CompletionOutput(i, text, list(ids), -0.5 * len(ids), [{t: -0.1} for t in ids] if logprobs else None,
                         "length" if finished else None) for i, ids, text in comps], finished,
        metrics={"arrival_time": 1.0, "first_scheduled_time": 1.5, "first_token_time": 2.0})


def test_codec_rebuilds_every_output_and_sends_appends_as_deltas():
    """Random streams of cumulative outputs: appends, rewrites (as beam search does), several completions,
    logprobs, aborts: the decoder returns exactly what the encoder was given, and plain appends go as deltas."""
    rng = random.Random(0)
    enc, dec = OutputEncoder(), OutputDecoder()
    state: dict[str, list[tuple[int, list[int], str]]] = {}
    deltas = total = 0
    for step in range(400):
        outputs = []
        for rid in [f"r{i}" for i in range(6)]:
            if rid not in state:
                if rng.random() < 0.5:
                    state[rid] = [(i, [], "") for i in range(rng.choice([1, 1, 2]))]
                continue
            comps = []
            for i, ids, text in state[rid]:
                if rng.random() < 0.1:  # rewritten, not appended
                    ids, text = [rng.randrange(100) for _ in range(len(ids))], "x" * len(text)
                new = [rng.randrange(100) for _ in range(rng.choice([0, 1, 1, 3]))]
                comps.append((i, ids + new, text + "".join(f"<{t}>" for t in new)))
            state[rid] = comps
            finished = rng.random() < 0.05
            outputs.append(_out(rid, comps, finished, logprobs=rid in ("r1", "r3")))
            if finished:
                del state[rid]
        if step % 37 == 0 and state:  # an abort: both sides forget the request
            rid = sorted(state)[0]
            enc.forget([rid])
            dec.forget([rid])
            del state[rid]
            outputs = [o for o in outputs if o.request_id != rid]
        items = enc.encode(outputs)
        deltas += sum(1 for it in items if it[0] == 1)
        total += len(items)
        assert dec.decode(items) == outputs
    assert deltas > total // 2


@pytest.fixture(scope="module")
def engine_args():
    return EngineArgs(num_gpu_blocks_override=64, max_model_len=512, swap_space=0.05)


def _with_client(engine_args, body):
    async def main():
        client = AsyncMPClient(engine_args, startup_timeout_s=300)
        client.start()
        try:
            return client, await body(client)
        finally:
            await client.shutdown()

    return asyncio.run(main())


def test_mp_client_matches_in_process_engine_and_frees_blocks(engine_args):
    from pagedllm.engine.llm_engine import LLMEngine

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)

    async def body(client):
        with pytest.raises(ValueError, match="prompt"):
            await client.add_request("bad", [], SamplingParams())  # refused here, never sent

        async def one(i, p):
            return [o async for o in client.generate(p, params, f"r{i}")]

        results = await asyncio.gather(*[one(i, p) for i, p in enumerate(PROMPTS)])
        gen = client.generate("Tell me a story", SamplingParams(max_tokens=400, ignore_eos=True), "long")
        await gen.__anext__()
        await gen.aclose()  # leaving the stream aborts the request in the engine-core process
        for _ in range(200):
            await asyncio.sleep(0.02)
            s = client.stats()
            if s["num_running"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"] and s["num_waiting"] == 0:
                break
        return results, client.stats()

    client, (results, idle) = _with_client(engine_args, body)
    assert idle["kv_blocks_free"] == idle["kv_blocks_total"] and idle["num_running"] == 0
    assert not client.proc.is_alive() and client.proc.exitcode == 0
    engine = LLMEngine.from_engine_args(engine_args)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"sync{i}", p, params)
    finals = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
    for i, stream in enumerate(results):
        ref, got = finals[f"sync{i}"].outputs[0], stream[-1].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (ref.token_ids, ref.text, ref.finish_reason)
        assert [sorted(d) for d in got.logprobs] == [sorted(d) for d in ref.logprobs]
        lengths = [len(o.outputs[0].token_ids) for o in stream]
        assert lengths == sorted(lengths) and len(stream) > 2  # streamed step by step, cumulative


def test_mp_client_engine_death_ends_streams_and_reports_unhealthy(engine_args):
    async def body(client):
        gen = client.generate("Once upon a time", SamplingParams(max_tokens=400, ignore_eos=True), "doomed")
        await gen.__anext__()
        os.kill(client.proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine-core process"):
            async for _ in gen:
                pass
        assert not client.is_healthy and "engine-core process" in client.dead_reason
        with pytest.raises(EngineDeadError):
            await client.add_request("after", [1, 2, 3], SamplingParams(max_tokens=2))
        return True

    client, ok = _with_client(engine_args, body)
    assert ok and not client.proc.is_alive()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_engine_core_process_ends_with_the_server(how):
    """`pagedllm serve` (split by default): its engine-core process serves, and is gone once the server is,
    whether the server shut down (SIGTERM) or was killed outright (SIGKILL: no finalizer runs)."""
    import httpx
    from conftest_server import MODEL_NAME, SMALL_SERVER_ARGS, RemoteServer
    from process_utils import child_pids, pid_running, wait_gone

    server = RemoteServer([*SMALL_SERVER_ARGS, "--no-dashboard"])
    cores: list[int] = []
    try:
        cores = child_pids(server.proc.pid)
        assert len(cores) == 1 and pid_running(cores[0])
        body = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 4}
        assert httpx.post(server.url("/v1/completions"), json=body, timeout=60).status_code == 200
        if how == "sigkill":
            server.proc.kill()
        else:
            server.proc.terminate()
        server.proc.wait(timeout=60)
        assert wait_gone(cores) == []
    finally:
        server.stop()
        for pid in cores:
            if pid_running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("split", [True, False])
def test_serve_with_a_bad_model_path_says_so_in_one_line(tmp_path, split):
    """A bad argument found while the engine-core process builds the engine is reported by `pagedllm serve` as
    it is in-process: one `error:` line, exit status 2, no traceback."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--model", str(tmp_path / "missing"),
           "--port", "0", *([] if split else ["--disable-frontend-multiprocessing"])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: Model path" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
