"""The CPU default (GGUF weights served quantized) gives a request the same greedy tokens and the same
logprobs, bit for bit, whatever shares its steps: alone, or batched with a long prompt whose chunk takes
torch's attention (the choice of attention is per chunk, not per step)."""
from __future__ import annotations

from pagedllm import LLM, SamplingParams


def test_cpu_outputs_do_not_depend_on_what_shares_the_step(tokenizer):
    long_prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 70)[:600]  # > 512: torch SDPA
    shorts = [tokenizer.encode(t) for t in ("The capital of France is", "List three primary colors:",
                                            "def fibonacci(n):")]
    prompts = [{"prompt_token_ids": p} for p in [long_prompt, *shorts]]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    runs = {}
    for seqs in (1, 4):
        llm = LLM(quantization="gguf", max_num_seqs=seqs, max_model_len=1024, num_gpu_blocks_override=256,
                  device="cpu")
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[seqs] = [(list(o.outputs[0].token_ids), [lp[t] for lp, t in
                                                      zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                      for o in outs]
    assert runs[4] == runs[1]
