"""Issue 20: how many tokens per step n-gram drafts could give on the copy workload, whatever verification costs.

Runs the bundled model greedily over `pagedllm bench spec-decode`'s 100 input-copying prompts (128 tokens at most,
the benchmark's default), then replays the n-gram proposer over each output: a step with no draft emits one
token; a step with a draft emits the accepted prefix plus the target's token. Prints, per configuration and
prompt kind, the steps with and without drafts and the tokens per step: the ceiling of the on/off ratio if a
verification step cost what a plain step costs.

    python benchmarks/results/cpu_1128/spec_ceiling.py [NUM_PROMPTS] [--outputs FILE]
"""
import argparse
import json
import os

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.spec_decode import make_copy_prompts
from pagedllm.spec_decode.ngram_proposer import NgramProposer


def replay(results, k, nmin, nmax, kinds=None):
    prop = NgramProposer(k, nmin, nmax)
    tokens = steps = plain = 0
    for i, (prompt, out) in enumerate(results):
        if kinds is not None and i % 3 not in kinds:
            continue
        pos = 0
        while pos < len(out):
            draft = prop.propose(prompt + out[:pos])
            if not draft:
                plain += 1
                pos += 1
            else:
                a = 0
                while a < len(draft) and pos + a < len(out) and draft[a] == out[pos + a]:
                    a += 1
                pos += a + 1
            steps += 1
        tokens += len(out)
    return tokens, steps, plain, steps - plain


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("num_prompts", nargs="?", type=int, default=100)
    p.add_argument("--outputs", default="/tmp/spec_ceiling_outputs.json", help="cache of the greedy outputs")
    a = p.parse_args()
    if os.path.exists(a.outputs):
        results = json.load(open(a.outputs))
    else:
        llm = LLM(max_model_len=1024)
        prompts = make_copy_prompts(llm.llm_engine.tokenizer, a.num_prompts)
        outs = llm.generate([{"prompt_token_ids": q} for q in prompts], SamplingParams(temperature=0, max_tokens=128))
        results = [(q, list(o.outputs[0].token_ids)) for q, o in zip(prompts, outs)]
        json.dump(results, open(a.outputs, "w"))
    names = {None: "all", 0: "repeat code", 1: "rename + output code", 2: "summarize, quoting"}
    print(f"{'prompts':<22}{'k:min:max':>10}{'tokens':>8}{'steps':>7}{'plain':>7}{'verify':>8}{'tok/step':>9}")
    for kind in (None, 0, 1, 2):
        for k, mn, mx in ((4, 4, 4), (4, 2, 4), (4, 1, 4), (8, 4, 4), (8, 2, 4), (8, 1, 4), (16, 2, 4)):
            t, s, pl, v = replay(results, k, mn, mx, None if kind is None else [kind])
            print(f"{names[kind]:<22}{f'{k}:{mn}:{mx}':>10}{t:>8}{s:>7}{pl:>7}{v:>8}{t / s:>9.2f}")
    lens = [len(o) for _, o in results]
    print(f"mean output {sum(lens) / len(lens):.1f} tokens; {sum(n == 128 for n in lens)} of {len(lens)} hit the cap")


if __name__ == "__main__":
    main()
