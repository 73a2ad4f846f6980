"""The CPU direct forward against the module path on the LayerNorm families (GPT-NeoX, Phi, StableLM, StarCoder2) and
the Llama variants it also runs (Granite, OLMo 2).

For each family, a model of the bundled SmolLM2-135M's shape (30 layers, hidden 576, 9 heads (3 KV heads where the
family has GQA; GPT-NeoX has none), intermediate 1536, vocab 49 152) with the family's own layout (Pythia's parallel
residual with two norms and a quarter of each head rotated; Phi-2's one-norm parallel block, gelu_new, half the head
rotated, biased head; StableLM 2's sequential blocks, q/k/v biases, SwiGLU, a quarter rotated; StarCoder2's biased
sequential blocks, gelu_pytorch_tanh, window of 4 096, tied head; Granite 3's four multipliers, tied head; OLMo 2's
post-norms and whole-projection q/k norms, tied head) and random float32 weights (load_format="dummy"):
N requests of 16-256 prompt tokens, 128 greedy output tokens (ignore_eos), output tok/s with
PAGEDLLM_CPU_DIRECT_FORWARD=0 and =1, each in its own process, the two alternated `--rounds` times, `--runs` timed
runs per process after one warm-up.

    PYTHONPATH=. HF_HUB_OFFLINE=1 python benchmarks/cpu_direct_forward_families.py [--families ...] [--n 1 4 64]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

FAMILIES = ("gpt-neox", "phi", "stablelm", "starcoder2", "granite", "olmo2")
SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             max_position_embeddings=2048)
OUTPUT_LEN = 128


def _config(family: str):
    import transformers

    if family == "gpt-neox":
        return transformers.GPTNeoXConfig(**SHAPE, rotary_pct=0.25, use_parallel_residual=True, hidden_act="gelu",
                                          tie_word_embeddings=False)
    if family == "phi":
        return transformers.PhiConfig(**SHAPE, num_key_value_heads=3, partial_rotary_factor=0.5,
                                      hidden_act="gelu_new", tie_word_embeddings=False)
    if family == "stablelm":
        return transformers.StableLmConfig(**SHAPE, num_key_value_heads=3, partial_rotary_factor=0.25,
                                           use_qkv_bias=True, use_parallel_residual=False, tie_word_embeddings=False)
    if family == "starcoder2":
        return transformers.Starcoder2Config(**SHAPE, num_key_value_heads=3, sliding_window=4096, use_bias=True,
                                             hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True)
    if family == "granite":
        return transformers.GraniteConfig(**SHAPE, num_key_value_heads=3, embedding_multiplier=12.0,
                                          residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0,
                                          tie_word_embeddings=True)
    if family == "olmo2":
        return transformers.Olmo2Config(**SHAPE, num_key_value_heads=3, tie_word_embeddings=True)
    raise ValueError(family)


def child(family: str, n: int, runs: int) -> None:
    """One process: the model, one warm-up generation, `runs` timed ones; prints `tok/s <value>` per run."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.throughput import make_workload

    d = tempfile.mkdtemp()
    _config(family).save_pretrained(d)
    llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, dtype="float32", max_model_len=1024)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    want = os.environ.get("PAGEDLLM_CPU_DIRECT_FORWARD") == "1"
    assert (runner.direct_forward is not None) == want, (family, runner.direct_forward)
    wl = make_workload(n, 16, 256, OUTPUT_LEN, SHAPE["vocab_size"], 0)
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)
    for _ in range(runs):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        assert sum(len(o.outputs[0].token_ids) for o in outs) == n * OUTPUT_LEN
        print(f"tok/s {n * OUTPUT_LEN / elapsed:.2f}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--n", nargs="+", type=int, default=[1, 4, 64], help="concurrent requests")
    p.add_argument("--rounds", type=int, default=2, help="off/on process pairs per (family, N)")
    p.add_argument("--runs", type=int, default=2, help="timed runs per process")
    p.add_argument("--child", nargs=2, metavar=("FAMILY", "N"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.runs)
        return 0
    rows = []
    for family in args.families:
        for n in args.n:
            got: dict[str, list[float]] = {"0": [], "1": []}
            for _ in range(args.rounds):
                for flag in ("0", "1"):
                    env = {**os.environ, "PAGEDLLM_CPU_DIRECT_FORWARD": flag}
                    out = subprocess.run([sys.executable, __file__, "--child", family, str(n), "--runs",
                                          str(args.runs)], env=env, capture_output=True, text=True)
                    if out.returncode:
                        sys.stderr.write(out.stderr)
                        return out.returncode
                    vals = [float(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("tok/s ")]
                    got[flag] += vals
                    print(f"{family:10s} N={n:3d} direct={flag}: " + " ".join(f"{v:7.1f}" for v in vals), flush=True)
            off, on = statistics.median(got["0"]), statistics.median(got["1"])
            rows.append((family, n, got["0"], got["1"], off, on))
    print("\n| family | N | module path out tok/s (runs) | direct forward out tok/s (runs) | median speed-up |")
    print("|---|---:|---|---|---:|")
    for family, n, offs, ons, off, on in rows:
        print(f"| {family} | {n} | {' / '.join(f'{v:.1f}' for v in offs)} | {' / '.join(f'{v:.1f}' for v in ons)} "
              f"| {on / off:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
