"""Diagnosis of tests/test_spec_decode.py::test_engine_sampling_distribution_on_off on CUDA (issue 20).

The test's tiny random Llama (vocab 8) samples 4 tokens at temperature 1 from one repetitive prompt with
speculation (n-gram) off and on. Here, per dtype (bf16: the CUDA default; fp32), and per mode (off/on):
the empirical marginal of each of the 4 output positions against the *exact* marginal computed by
enumerating every path with HF transformers in float32 (and in bf16, to show how far bf16 numerics alone
move it), plus the on-vs-off homogeneity test the unit test makes, and greedy on/off identity on random
prompts. Tells a sampler bug (on ≠ exact while off = exact, in fp32 too) from numerics (bf16 only).

    python benchmarks/gpu/spec_sampling_diag.py --bundled --n 3000 --out diag.json   (H100 run: BENCHMARKS §20.2)
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
import time

import numpy as np
import torch
from scipy.stats import chi2_contingency, chisquare

PROMPT = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "disable_by_batch_size": 4096}
VOCAB, STEPS = 8, 4
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def build_model(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the unit test's model, weight for weight
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg).eval()
    for p in hf.parameters():
        p.data.normal_(0, 0.3)
    hf.save_pretrained(path)


@torch.no_grad()
def exact_marginals(path: str, dtype: torch.dtype) -> np.ndarray:
    """[STEPS, VOCAB]: P(output token j = v), summing over all earlier paths (8^j of them)."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(path, dtype=dtype).to(DEV).eval()
    out = np.zeros((STEPS, VOCAB))
    for j in range(STEPS):
        paths = list(itertools.product(range(VOCAB), repeat=j))
        ids = torch.tensor([PROMPT + list(p) for p in paths], device=DEV)
        probs = hf(ids).logits[:, -1].float().softmax(-1).double().cpu().numpy()  # [paths, vocab]
        if j == 0:
            out[0] = probs[0]
            continue
        # P(path) = Π_i p(path_i | prefix): recompute prefix probabilities from the previous level.
        w = np.ones(len(paths))
        for i in range(j):
            pre = torch.tensor([PROMPT + list(p[:i]) for p in paths], device=DEV)
            pi = hf(pre).logits[:, -1].float().softmax(-1).double().cpu().numpy()
            w *= pi[np.arange(len(paths)), [p[i] for p in paths]]
        out[j] = (w[:, None] * probs).sum(0)
    return out


def run_engine(path: str, dtype: str, spec, n: int, greedy_prompts) -> dict:
    from pagedllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=path, skip_tokenizer_init=True, max_model_len=64, num_gpu_blocks_override=4096,
              block_size=4, max_num_seqs=512, speculative_config=spec, seed=7, dtype=dtype, device=DEV)
    params = SamplingParams(temperature=1.0, max_tokens=STEPS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * n, params, use_tqdm=False)
    toks = np.array([o.outputs[0].token_ids for o in outs])
    counts = np.stack([np.bincount(toks[:, j], minlength=VOCAB) for j in range(STEPS)])
    st = llm.stats()
    g = llm.generate([{"prompt_token_ids": p} for p in greedy_prompts],
                     SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    greedy = [list(o.outputs[0].token_ids) for o in g]
    res = {"counts": counts.tolist(), "greedy": greedy, "s": time.perf_counter() - t0,
           "accepted": st.get("spec_decode_num_accepted_tokens", 0), "drafted": st.get("spec_decode_num_draft_tokens", 0)}
    del llm
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return res


def verify_on_device(draws: int, top_p: float) -> list[float]:
    """The rejection sampler alone with logits on DEV and torch's default generator (the engine's case for
    unseeded requests): chi-square p of the first and second emitted tokens against the target."""
    from pagedllm import SamplingParams
    from pagedllm.model.layers.sampler import SamplingRow
    from pagedllm.spec_decode.rejection_sampler import processed_logits, verify

    g = torch.Generator().manual_seed(1234)
    logits = (torch.randn(3, 6, generator=g) * 1.5).to(DEV)
    params = SamplingParams(temperature=1.0, top_p=top_p)
    drafts = [int(logits[0].argmax()), 3]
    rows = [SamplingRow(params, [0], drafts[:i]) for i in range(3)]
    p = processed_logits(logits, rows).softmax(-1).double().cpu().numpy()
    first, second = np.zeros(6), np.zeros(6)
    for _ in range(draws):
        res = verify(logits, rows, drafts)
        first[res.token_ids[0]] += 1
        if len(res.token_ids) > 1:
            second[res.token_ids[1]] += 1
    out = []
    for c, pr in ((first, p[0]), (second, p[1])):
        keep = pr > 0
        out.append(float(chisquare(c[keep], pr[keep] / pr[keep].sum() * c.sum()).pvalue) if c[~keep].sum() == 0
                   else 0.0)
    return out


def bundled_divergence(dtype: str, num_prompts: int = 32, max_tokens: int = 48) -> dict:
    """The bundled model, greedy with n-gram speculation off and on (windows of the fixed evaluation text):
    identical requests, and for each request that differs the off run's gap between its top-2 logprobs at
    the first divergence (a near-tie flipped by rounding has a gap near 0)."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.fp8_accuracy import eval_text, make_prompts
    from pagedllm.model.loader import prepare_model_dir
    from pagedllm.tokenizer import get_tokenizer

    tok = get_tokenizer(str(prepare_model_dir(None)))
    prompts = make_prompts(tok.encode(eval_text()), num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    runs = {}
    for mode, spec in (("off", None), ("on", {**NGRAM, "disable_by_batch_size": 64})):
        llm = LLM(dtype=dtype, device=DEV, max_model_len=1024, kv_cache_memory_bytes=1 << 30,
                  speculative_config=spec, seed=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[mode] = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
        if spec:
            st = llm.stats()
            accepted, drafted = st["spec_decode_num_accepted_tokens"], st["spec_decode_num_draft_tokens"]
        del llm
        if DEV == "cuda":
            torch.cuda.empty_cache()
    gaps = []
    for (a, lps), (b, _) in zip(runs["off"], runs["on"]):
        i = next((j for j in range(len(a)) if a[j] != b[j]), None)
        if i is not None:
            v = sorted((float(getattr(x, "logprob", x)) for x in lps[i].values()), reverse=True)
            gaps.append(v[0] - v[1])
    same = sum(a == b for (a, _), (b, _) in zip(runs["off"], runs["on"]))
    print(f"bundled model {dtype}: greedy identical on/off {same}/{len(prompts)}, accepted {accepted}/{drafted} "
          f"drafts; top-2 logprob gap of the off run at each first divergence: {[round(g, 4) for g in gaps]}",
          flush=True)
    return {"identical": same, "total": len(prompts), "gaps_at_divergence": gaps, "accepted": accepted,
            "drafted": drafted}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--out", default="spec_diag.json")
    ap.add_argument("--bundled", action="store_true", help="also the bundled model's greedy on/off per dtype")
    args = ap.parse_args()
    report: dict = {"bundled": {}}
    if args.bundled:
        for dtype in args.dtypes:
            report["bundled"][dtype] = bundled_divergence(dtype)
            with open(args.out, "w") as f:
                json.dump(report, f)
    path = tempfile.mkdtemp(prefix="tiny_spec_")
    build_model(path)
    exact = {"float32": exact_marginals(path, torch.float32), "bfloat16": exact_marginals(path, torch.bfloat16)}
    print("exact marginals (fp32):\n", np.round(exact["float32"], 4))
    print("max |bf16 - fp32| of the HF marginals:", float(np.abs(exact["bfloat16"] - exact["float32"]).max()))
    report_verify = {str(tp): verify_on_device(20_000, tp) for tp in (1.0, 0.8)}
    print(f"rejection sampler alone on {DEV}: p (first, second) per top_p: {report_verify}")
    rng = random.Random(0)
    greedy_prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 20))] for _ in range(32)]
    report.update({"exact_fp32": exact["float32"].tolist(), "exact_bf16_hf": exact["bfloat16"].tolist(), "runs": {},
                   "verify_alone_p": report_verify})
    for dtype in args.dtypes:
        runs = {}
        for mode, spec in (("off", None), ("on", NGRAM)):
            r = run_engine(path, dtype, spec, args.n, greedy_prompts)
            counts = np.array(r["counts"])
            r["gof_p_vs_exact_fp32"] = []
            for j in range(STEPS):
                p = exact["float32"][j]
                keep = p > 1e-9
                r["gof_p_vs_exact_fp32"].append(float(chisquare(counts[j][keep], p[keep] / p[keep].sum()
                                                                * counts[j].sum()).pvalue))
            runs[mode] = r
            print(f"{dtype} {mode}: {r['s']:.1f} s, accepted {r['accepted']}/{r['drafted']} drafts, "
                  f"goodness-of-fit p vs exact per position: {[f'{x:.3g}' for x in r['gof_p_vs_exact_fp32']]}")
            print("  empirical:", np.round(counts / counts.sum(1, keepdims=True), 4).tolist())
        homog = []
        for j in range(STEPS):
            t = np.stack([runs["off"]["counts"][j], runs["on"]["counts"][j]])
            t = t[:, t.sum(0) > 0]
            homog.append(float(chi2_contingency(t).pvalue))
        same = sum(a == b for a, b in zip(runs["off"]["greedy"], runs["on"]["greedy"]))
        print(f"{dtype}: on-vs-off homogeneity p per position {[f'{x:.3g}' for x in homog]}; "
              f"greedy identical {same}/{len(greedy_prompts)}")
        report["runs"][dtype] = {"off": runs["off"], "on": runs["on"], "homogeneity_p": homog,
                                 "greedy_identical": same, "greedy_total": len(greedy_prompts)}
        with open(args.out, "w") as f:
            json.dump(report, f)
    with open(args.out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
