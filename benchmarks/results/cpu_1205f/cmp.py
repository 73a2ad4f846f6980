"""Several engines (off + spec configs as JSON) in one process, the 100 copy prompts at CONCURRENCY in ROUNDS
interleaved slices: python cmp.py CONCURRENCY ROUNDS off CONFIG_JSON..."""
import json
import sys

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.spec_decode import make_copy_prompts, run_closed_loop


def interleaved(engines: dict, conc: int, rounds: int) -> tuple[dict, dict]:
    """Each slice of the prompts on every engine, in alternating order → (tokens, seconds) and outputs per engine."""
    cfgs = list(engines)
    prompts = make_copy_prompts(engines[cfgs[0]].get_tokenizer(), 100)
    cuts = [100 * r // rounds for r in range(rounds + 1)]
    tot = {c: [0, 0.0] for c in cfgs}
    outs = {c: [] for c in cfgs}
    for r in range(rounds):
        ps = prompts[cuts[r]:cuts[r + 1]]
        for c in (cfgs if r % 2 == 0 else cfgs[::-1]):
            params = [SamplingParams(temperature=0.0, max_tokens=512) for _ in ps]
            t, o = run_closed_loop(engines[c].llm_engine, ps, params, conc, "p")
            tot[c][0] += sum(len(x) for x in o)
            tot[c][1] += t
            outs[c] += o
            print(f"round {r} {c}: {sum(len(x) for x in o) / t:.1f} tok/s", flush=True)
    return tot, outs


def report(tot: dict, outs: dict, extra=lambda c: "") -> None:
    cfgs = list(tot)
    base = tot[cfgs[0]][0] / tot[cfgs[0]][1]
    for c in cfgs:
        rate = tot[c][0] / tot[c][1]
        same = sum(a == b for a, b in zip(outs[c], outs[cfgs[0]]))
        print(f"{c}: {rate:.1f} tok/s, x{rate / base:.3f} of {cfgs[0]}, identical {same}/100{extra(c)}")


if __name__ == "__main__":
    conc, rounds = int(sys.argv[1]), int(sys.argv[2])
    engines = {c: LLM(max_model_len=2048, num_gpu_blocks_override=2048,
                      **({} if c == "off" else {"speculative_config": json.loads(c)})) for c in sys.argv[3:]}
    report(*interleaved(engines, conc, rounds))
