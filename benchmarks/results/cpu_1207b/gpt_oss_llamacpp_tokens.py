"""Does pagedllm read a gpt-oss GGUF as llama.cpp does? The same file, the same token-id prompts, greedy: llama.cpp's
tokens against pagedllm's (quantized default and float), and the rank pagedllm gives each of llama.cpp's tokens when
fed llama.cpp's continuation (teacher forcing: one early flip does not hide the rest).

    python benchmarks/results/cpu_1207b/gpt_oss_llamacpp_tokens.py /tmp/gpt-oss-small.gguf
"""
from __future__ import annotations

import sys

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.llama_cpp import LlamaServer, find_llama_server

TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "The three laws of thermodynamics are", "Water boils at", "In 1969, the first humans",
         "A list of prime numbers: 2, 3, 5,", "Translate to French: good morning"]
N = 32


def main(path: str) -> None:
    binary = find_llama_server()
    if binary is None:
        sys.exit("no llama-server (README: llama.cpp as a CPU peer)")
    for quantization in ("gguf", "none"):
        llm = LLM(path, max_model_len=512, quantization=quantization)
        prompts = [llm.get_tokenizer().encode(t) for t in TEXTS]
        if quantization == "gguf":
            with LlamaServer(binary, path, parallel=1, ctx_per_slot=512, threads=2) as srv:
                theirs = [srv.complete(p, N)["tokens"] for p in prompts]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)
        ours = [list(o.outputs[0].token_ids) for o in outs]
        same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), N) for x, y in zip(ours, theirs)]
        forced = [p + t for p, t in zip(prompts, theirs)]
        lp = llm.generate([{"prompt_token_ids": f} for f in forced],
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        ranks = [o.prompt_logprobs[i][f[i]].rank for o, f, p in zip(lp, forced, prompts)
                 for i in range(len(p), len(f))]
        top1 = sum(r == 1 for r in ranks) / len(ranks)
        print(f"quantization={quantization}: greedy tokens equal to llama.cpp's for the first {same} of {N} "
              f"(identical sequences: {sum(s == N for s in same)}/{len(same)}); llama.cpp's tokens are pagedllm's "
              f"top choice at {top1:.1%} of {len(ranks)} teacher-forced positions (max rank {max(ranks)})")
        del llm


if __name__ == "__main__":
    main(sys.argv[1])
