"""Accuracy of FP8 (issue 21) on the real bundled model: greedy agreement and perplexity against bf16.

Each configuration (an engine built with its flags, one after the other in this process) runs
1. greedy decoding of the same prompts (``ignore_eos``, fixed length): windows of a fixed English text
   shipped in the package (``data/eval_text.txt``, ~2 000 tokens of original prose written for this
   benchmark), and
2. perplexity of that whole text from ``prompt_logprobs`` (one request, chunked prefill).

Against the baseline configuration it reports token agreement over all positions, agreement of the
prefix up to each request's first divergence (tokens before it ÷ all tokens), identical requests,
perplexity, its relative difference and the mean absolute per-token NLL difference. Free-running
greedy agreement compounds: one flipped near-tie changes the rest of the request. So it also reports
teacher-forced agreement: each configuration scores the *baseline's* prompt + greedy continuation in
one prefill (``prompt_logprobs=1``), and a position agrees when its argmax is the baseline's token
(the baseline against itself gives the floor set by prefill-vs-decode numerics); and the argmax
agreement over every position of the fixed text.

    pagedllm bench fp8-accuracy --configs bf16 fp8-kv fp8-kv-w8          # GPU (issue 21 targets)
    pagedllm bench fp8-accuracy --configs bf16 fp8-kv fp8-kv-s1 fp8-kv-w8 fp8-kv-s1-w8   # calibrated vs 1.0
    pagedllm bench fp8-accuracy --device cpu --configs fp32 bf16 --num-prompts 4 --max-tokens 8
    pagedllm bench fp8-accuracy --device cpu --configs fp32 fp32-fp8-kv fp32-fp8-kv-e5m2 fp32-bf16-kv  # CPU pools
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import time
from importlib import resources

logger = logging.getLogger("pagedllm")

#: name → engine arguments (beyond device / model); FP8 weights need CUDA. FP8 KV pools use scales of 1.0 (the
#: engine's default); the "-cal" configurations calibrate per-layer scales at start-up (calculate_kv_scales).
CONFIGS: dict[str, dict] = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "fp8-kv": {"dtype": "bfloat16", "kv_cache_dtype": "fp8"},
    "fp8-kv-cal": {"dtype": "bfloat16", "kv_cache_dtype": "fp8", "calculate_kv_scales": True},
    "fp8-kv-e5m2": {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e5m2"},
    "fp8-kv-e5m2-cal": {"dtype": "bfloat16", "kv_cache_dtype": "fp8_e5m2", "calculate_kv_scales": True},
    "fp8-w8": {"dtype": "bfloat16", "quantization": "fp8"},
    "fp8-kv-w8": {"dtype": "bfloat16", "kv_cache_dtype": "fp8", "quantization": "fp8"},
    "fp8-kv-cal-w8": {"dtype": "bfloat16", "kv_cache_dtype": "fp8", "quantization": "fp8",
                      "calculate_kv_scales": True},
    # The CPU's FP8 pools (native kernels) under a float32 model: against "fp32".
    "fp32-fp8-kv": {"dtype": "float32", "kv_cache_dtype": "fp8"},
    "fp32-fp8-kv-cal": {"dtype": "float32", "kv_cache_dtype": "fp8", "calculate_kv_scales": True},
    "fp32-fp8-kv-e5m2": {"dtype": "float32", "kv_cache_dtype": "fp8_e5m2"},
    "fp32-bf16-kv": {"dtype": "float32", "kv_cache_dtype": "bfloat16"},
}


def eval_text() -> str:
    """The fixed evaluation text shipped with the package."""
    return resources.files("pagedllm.benchmarks").joinpath("data/eval_text.txt").read_text(encoding="utf-8")


def make_prompts(text_ids: list[int], num: int, min_len: int = 32, max_len: int = 128) -> list[list[int]]:
    """`num` windows of the text, at deterministic offsets and lengths spread over [min_len, max_len]."""
    if len(text_ids) <= max_len:
        raise ValueError(f"the evaluation text has {len(text_ids)} tokens; need more than max_len={max_len}.")
    span = len(text_ids) - max_len
    out = []
    for i in range(num):
        start = (i * 997) % span
        length = min_len + (i * 37) % (max_len - min_len + 1)
        out.append(text_ids[start:start + length])
    return out


def agreement(outs: list[list[int]], base: list[list[int]]) -> dict:
    """Token agreement of `outs` with `base` (same prompts): all positions, and the prefix before each
    request's first divergence (after it, contexts differ and agreement means little)."""
    total = same = prefix = identical = 0
    for a, b in zip(outs, base):
        n = min(len(a), len(b))
        total += max(len(a), len(b))
        same += sum(x == y for x, y in zip(a[:n], b[:n]))
        first = next((i for i in range(n) if a[i] != b[i]), n)
        prefix += first
        identical += a == b
    return {"agreement_all": same / total, "agreement_prefix": prefix / total,
            "identical_requests": identical, "num_requests": len(base)}


def _logprob(entry, token: int) -> float:
    return entry[token].logprob


def _argmax(entry) -> int:
    return max(entry, key=lambda t: _logprob(entry, t))


def teacher_forced(llm, prompts: list[list[int]], continuations: list[list[int]]) -> tuple[int, int]:
    """(positions whose argmax equals the given continuation token, positions) with prompt + continuation
    scored in one prefill."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p + c} for p, c in zip(prompts, continuations)], params,
                        use_tqdm=False)
    same = total = 0
    for o, p, c in zip(outs, prompts, continuations):
        for j, tok in enumerate(c):
            same += _argmax(o.prompt_logprobs[len(p) + j]) == tok
            total += 1
    return same, total


def run_config(name: str, args, prompts: list[list[int]], text_ids: list[int],
               base_tokens: list[list[int]] | None = None) -> dict:
    import torch

    from pagedllm import LLM, SamplingParams

    kw = dict(CONFIGS[name])
    t0 = time.perf_counter()
    llm = LLM(device=args.device, max_model_len=args.max_model_len, seed=0,
              kv_cache_memory_bytes=int(args.kv_cache_memory_gib * (1 << 30)), **kw)
    pool = llm.llm_engine.scheduler.block_manager.num_gpu_blocks
    worker = getattr(llm.llm_engine.executor, "driver_worker", None)  # one process: the calibrated scales
    kv_scales = [list(s) for s in worker.kv_spec.layer_scales] if worker is not None else []
    t1 = time.perf_counter()
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=True)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    t2 = time.perf_counter()
    ppl_params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    res = llm.generate([{"prompt_token_ids": text_ids}], ppl_params, use_tqdm=False)[0]
    nll = [-_logprob(res.prompt_logprobs[i], text_ids[i]) for i in range(1, len(text_ids))]
    text_argmax = [_argmax(res.prompt_logprobs[i]) for i in range(1, len(text_ids))]
    tf_same, tf_total = teacher_forced(llm, prompts, tokens if base_tokens is None else base_tokens)
    t3 = time.perf_counter()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    ppl = math.exp(sum(nll) / len(nll))
    logger.info("%s: ppl %.4f over %d tokens; %d greedy requests in %.1f s (engine %.1f s, ppl %.1f s), "
                "%d KV blocks", name, ppl, len(nll), len(prompts), t2 - t1, t1 - t0, t3 - t2, pool)
    return {"config": name, "engine_args": kw, "tokens": tokens, "nll": nll, "perplexity": ppl,
            "text_argmax": text_argmax, "teacher_forced_agreement": tf_same / tf_total,
            "num_gpu_blocks": pool, "greedy_s": t2 - t1, "kv_layer_scales": kv_scales}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", nargs="+", default=["bf16", "fp8-kv", "fp8-kv-w8"], choices=sorted(CONFIGS),
                   help="Engine configurations, in order; the first is the baseline unless --baseline.")
    p.add_argument("--baseline", default=None, help="Configuration the others are compared with.")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64, help="Greedy tokens per prompt (ignore_eos).")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    p.add_argument("--output-json", default=None, help="Write the figures (and the token ids) here.")


def run(args) -> int:
    from pagedllm.model.loader import prepare_model_dir
    from pagedllm.tokenizer import get_tokenizer

    baseline = args.baseline or args.configs[0]
    if baseline not in args.configs:
        raise ValueError(f"--baseline {baseline!r} must be one of --configs {args.configs}.")
    tok = get_tokenizer(str(prepare_model_dir(None)))
    text_ids = tok.encode(eval_text())
    if len(text_ids) + 1 > args.max_model_len:
        raise ValueError(f"--max-model-len {args.max_model_len} is below the text's {len(text_ids)} tokens + 1.")
    prompts = make_prompts(text_ids, args.num_prompts)
    order = [baseline] + [c for c in args.configs if c != baseline]
    results: dict[str, dict] = {}
    summary = []
    print(f"{'config':<14} {'agree all':>9} {'agree prefix':>12} {'identical':>9} {'teacher-forced':>14} "
          f"{'text argmax':>11} {'ppl':>9} {'ppl rel':>8} {'|dNLL|':>7}", flush=True)
    for name in order:  # one row as soon as each configuration is done (and the JSON rewritten)
        base_tokens = results[baseline]["tokens"] if results else None
        r = results[name] = run_config(name, args, prompts, text_ids, base_tokens)
        base = results[baseline]
        ag = agreement(r["tokens"], base["tokens"])
        ag["agreement_teacher_forced"] = r["teacher_forced_agreement"]
        ag["text_argmax_agreement"] = (sum(a == b for a, b in zip(r["text_argmax"], base["text_argmax"]))
                                       / len(base["text_argmax"]))
        rel = r["perplexity"] / base["perplexity"] - 1.0
        dnll = sum(abs(a - b) for a, b in zip(r["nll"], base["nll"])) / len(base["nll"])
        summary.append({"config": name, "baseline": baseline, **ag, "perplexity": r["perplexity"],
                        "ppl_rel_diff": rel, "mean_abs_nll_diff": dnll, "num_gpu_blocks": r["num_gpu_blocks"],
                        "engine_args": r["engine_args"], "kv_layer_scales": r["kv_layer_scales"]})
        print(f"{name:<14} {ag['agreement_all']:>9.2%} {ag['agreement_prefix']:>12.2%} "
              f"{ag['identical_requests']:>4}/{ag['num_requests']:<4} {ag['agreement_teacher_forced']:>14.2%} "
              f"{ag['text_argmax_agreement']:>11.2%} {r['perplexity']:>9.4f} {rel:>+8.3%} "
              f"{dnll:>7.4f}", flush=True)
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump({"summary": summary, "text_tokens": len(text_ids), "num_prompts": len(prompts),
                           "max_tokens": args.max_tokens,
                           "tokens": {n: x["tokens"] for n, x in results.items()}}, f, indent=1)
    return 0
