"""The thin server path: pydantic-free SSE chunks, coalescing streams, and a burst of concurrent requests
through a real server that must match `LLM.generate` and give back every block when clients leave."""
from __future__ import annotations

import asyncio
import json
import random
import signal

import httpx
import pytest

pytest.importorskip("fastapi")

from conftest_server import SMALL_SERVER_ARGS, RemoteServer  # noqa: E402

from pagedllm.engine.async_engine import AsyncStream  # noqa: E402
from pagedllm.entrypoints.openai.protocol import (  # noqa: E402
    ChatChoiceLogprobs,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogProbs,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaMessage,
    dump,
)
from pagedllm.entrypoints.openai.stream_format import ChatChunker, CompletionChunker  # noqa: E402
from pagedllm.outputs import CompletionOutput, RequestOutput  # noqa: E402


def _payload(line: str) -> dict:
    assert line.startswith("data: ") and line.endswith("\n\n"), line
    return json.loads(line[6:])


@pytest.mark.parametrize("finish,stop_reason,with_lp", [(None, None, False), ("stop", "\n", True), ("length", 7, False)])
def test_chunks_equal_the_pydantic_models(finish, stop_reason, with_lp):
    lp = CompletionLogProbs(tokens=[" a"], token_logprobs=[-0.5], top_logprobs=[{" a": -0.5}], text_offset=[3])
    # return_token_ids: the chunk's new token ids, and the prompt's in a choice's first chunk
    ids, prompt_ids = ([5, 6], [1, 2, 3]) if with_lp else (None, None)
    expected = dump(CompletionStreamResponse(id="cmpl-1", created=11, model="m", choices=[CompletionStreamChoice(
        index=2, text=" a\u00e9", logprobs=lp if with_lp else None, finish_reason=finish, stop_reason=stop_reason,
        token_ids=ids, prompt_token_ids=prompt_ids)]))
    got = CompletionChunker("cmpl-1", 11, "m").chunk(2, " a\u00e9", lp if with_lp else None, finish, stop_reason,
                                                       None, ids, prompt_ids)
    assert _payload(got) == expected

    clp = ChatChoiceLogprobs(content=[ChatTokenLogprob(token="a", logprob=-1.0, bytes=[97], top_logprobs=[
        ChatTopLogprob(token="a", logprob=-1.0, bytes=[97])])])
    for role, content in (("assistant", ""), (None, "hi"), (None, None)):
        expected = dump(ChatCompletionStreamResponse(id="chat-1", created=5, model="m", choices=[
            ChatCompletionStreamChoice(index=1, delta=DeltaMessage(role=role, content=content),
                                       logprobs=clp if with_lp else None, finish_reason=finish,
                                       stop_reason=stop_reason, token_ids=ids)], prompt_token_ids=prompt_ids))
        got = ChatChunker("chat-1", 5, "m").chunk(1, role, content, clp if with_lp else None, finish, stop_reason,
                                                  None, ids, prompt_ids)
        assert _payload(got) == expected


def _out(n_tokens: int, finished: bool = False) -> RequestOutput:
    comp = CompletionOutput(index=0, text="x" * n_tokens, token_ids=list(range(n_tokens)), cumulative_logprob=0.0,
                            logprobs=None, finish_reason="length" if finished else None)
    return RequestOutput("r", None, [1], [comp], finished)


def test_async_stream_coalesces_only_when_asked():
    async def read_all(stream: AsyncStream) -> list[int]:
        return [len(o.outputs[0].token_ids) async for o in stream]

    async def main():
        plain, merged = AsyncStream("a"), AsyncStream("b", coalesce=True)
        for s in (plain, merged):
            for n in (1, 2, 3):
                s.put(_out(n))
            s.put(_out(4, finished=True))
            s.finish()
        assert await read_all(plain) == [1, 2, 3, 4]
        assert await read_all(merged) == [4]  # the consumer was behind: only the latest, finished state
        # An error is never merged away, and a consumer waiting on an empty stream wakes up for it.
        s = AsyncStream("c", coalesce=True)
        reader = asyncio.ensure_future(read_all(s))
        await asyncio.sleep(0)
        s.put(_out(1))
        s.put(RuntimeError("boom"))
        with pytest.raises(RuntimeError, match="boom"):
            await reader

    asyncio.run(main())


# -- a real server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    srv = RemoteServer(SMALL_SERVER_ARGS)
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.logs()[-3000:]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 30000) for _ in range(rng.randint(8, 40))] for _ in range(n)]


async def _read_stream(client: httpx.AsyncClient, url: str, body: dict) -> str:
    text = []
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                payload = json.loads(line[6:])
                assert "error" not in payload, payload
                text += [c["text"] for c in payload["choices"]]
    return "".join(text)


def test_concurrent_burst_matches_llm_generate_and_frees_blocks(server):
    """32 requests at once (streamed and not), greedy: the texts `LLM.generate` gives the same batch;
    then a burst where half the clients leave mid-stream: all blocks come back, the rest finish."""
    from pagedllm import LLM, SamplingParams

    prompts = _prompts(32, seed=1)
    url = server.url("/v1/completions")

    async def burst() -> list[str]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client:
            async def one(i: int, p: list[int]) -> str:
                body = {"prompt": p, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "stream": i % 4 != 0}
                if body["stream"]:
                    return await _read_stream(client, url, body)
                r = await client.post(url, json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])

    before = server.metrics()
    texts = asyncio.run(burst())
    llm = LLM(num_gpu_blocks_override=256, max_model_len=1024, swap_space=0.05)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    del llm
    assert texts == [o.outputs[0].text for o in outs]
    after = server.wait_idle()
    success = "vllm:request_success_total"  # labelled by finish reason: absent before the first one
    assert after.get(success, 0.0) - before.get(success, 0.0) == 32

    async def half_leave() -> None:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client:
            async def leaver(p: list[int]) -> None:
                body = {"prompt": p, "max_tokens": 500, "ignore_eos": True, "stream": True}
                async with client.stream("POST", url, json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            return  # leave after the first token

            async def stayer(p: list[int]) -> str:
                return await _read_stream(client, url, {"prompt": p, "max_tokens": 4, "ignore_eos": True,
                                                        "stream": True, "temperature": 0.0})

            ps = _prompts(16, seed=2)
            res = await asyncio.gather(*[leaver(p) for p in ps[:8]], *[stayer(p) for p in ps[8:]])
            assert all(isinstance(t, str) and t for t in res[8:])

    before = server.metrics()
    asyncio.run(half_leave())
    idle = server.wait_idle(timeout=60)
    assert idle["pagedllm:kv_blocks_free"] == idle["pagedllm:kv_blocks_total"] == 256
    aborted = "pagedllm:request_aborted_total"
    assert idle.get(aborted, 0.0) - before.get(aborted, 0.0) == 8
    assert idle["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 8 * 100
