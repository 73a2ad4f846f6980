"""`pagedllm run-batch`'s path (an OpenAI Batch API file through the server's handlers, the engine in its own
process as the command runs it) against `LLM.generate` on the same 64 completion requests, greedy, same engine
arguments, in one run; checks both give the same text.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/results/cpu_1205/run_batch_vs_generate.py
"""
import asyncio
import io
import json
import random
import time

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_client import AsyncMPClient
from pagedllm.entrypoints.openai.run_batch import run_batch
from pagedllm.entrypoints.openai.serving_common import ServingContext
from pagedllm.tokenizer import get_tokenizer

N, MAX_TOKENS = 64, 64
WORDS = "the a river mountain city quiet storm light paper engine memory block table page cache window".split()
rng = random.Random(0)
prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 48))) for _ in range(N)]
lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                     "body": {"model": "m", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                              "ignore_eos": True}}) for i, p in enumerate(prompts)]
engine_kw = dict(max_num_seqs=64)


async def batch() -> tuple[float, list[str]]:
    engine = AsyncMPClient.from_engine_args(EngineArgs(**engine_kw))
    info = engine.info
    ctx = ServingContext(engine=engine, tokenizer=get_tokenizer(info.model_dir), served_model_names=["m"],
                         model_path=info.model_dir, max_model_len=info.max_seq_len, max_n=8)
    engine.start()
    out = io.StringIO()
    try:
        t0 = time.perf_counter()
        await run_batch(ctx, lines, out, max_in_flight=128)
        elapsed = time.perf_counter() - t0
    finally:
        await engine.shutdown()
    answers = [json.loads(line) for line in out.getvalue().splitlines()]
    return elapsed, [a["response"]["body"]["choices"][0]["text"] for a in answers]


def generate() -> tuple[float, list[str]]:
    llm = LLM(**engine_kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm, as the batch engine's start-up is not timed either
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].text for o in outs]


if __name__ == "__main__":  # the engine-core process re-imports this module (spawn)
    for round_ in (1, 2):
        tb, texts_b = asyncio.run(batch())
        tg, texts_g = generate()
        tokens = N * MAX_TOKENS
        print(f"round {round_}: run-batch path {tb:.2f} s ({tokens / tb:.1f} out tok/s), LLM.generate {tg:.2f} s "
              f"({tokens / tg:.1f} out tok/s), run-batch / generate time {tb / tg:.3f}; same texts: {texts_b == texts_g}")
