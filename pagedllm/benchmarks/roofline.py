"""Decode roofline: time one decode step of a Llama-3-8B-shaped dummy bf16 model through the engine.

Model-bandwidth utilisation = (weight bytes + K/V bytes read) ÷ step time ÷ device-to-device copy
bandwidth (measured in the same run). Needs CUDA.

    python benchmarks/roofline.py --batch 1 64 256 --context 1024
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                 rope_theta=500000.0, tie_word_embeddings=False)
# The paper's 13B model (LLaMA-13B / Llama-2-13B shape): 13.0 B parameters, 40 heads, no GQA.
LLAMA_13B = dict(vocab_size=32000, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                 num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096,
                 tie_word_embeddings=False)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--layers", type=int, default=32, help="fewer layers for a quick look")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--device", default="cuda", help="cpu only for a smoke run of the script")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (the eager baseline)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap scheduling with the device (default: the engine's, on for CUDA)")
    p.add_argument("--json", default=None)


def run(args) -> int:
    from transformers import LlamaConfig

    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.kernels import copy_bandwidth

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("benchmarks/roofline.py needs a CUDA GPU.")
        return 1
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    bw = copy_bandwidth() if cuda else 1e11
    cfg = LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": args.layers})
    tmp = tempfile.mkdtemp(prefix="pagedllm-roofline-")
    cfg.save_pretrained(tmp)
    max_len = args.context + args.steps + 12
    t0 = time.perf_counter()
    llm = LLM(model=tmp, load_format="dummy", skip_tokenizer_init=True, device=args.device, dtype="bfloat16" if cuda else "float32",
              max_model_len=max(2048, max_len), max_num_seqs=max(args.batch),
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
              async_scheduling=args.async_scheduling)
    print(f"engine up in {time.perf_counter() - t0:.1f} s; pool {llm.stats()['kv_blocks_total']} blocks", flush=True)
    engine = llm.llm_engine
    h, layers, kvh = cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads
    d = h // cfg.num_attention_heads
    weight_bytes = 2 * (2 * cfg.vocab_size * h + layers * (h * (h + 2 * kvh * d) + h * h + 3 * h * cfg.intermediate_size))
    kv_per_token = 2 * layers * kvh * d * 2
    rng = random.Random(0)
    rows = []
    for b in args.batch:
        ids = [f"r{b}-{i}" for i in range(b)]
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
        for rid in ids:
            engine.add_request(rid, {"prompt_token_ids": [rng.randrange(100, cfg.vocab_size) for _ in range(args.context)]}, params)
        started: set[str] = set()
        while len(started) < b:  # prefill every prompt (first token sampled)
            for out in engine.step():
                if out.outputs and len(out.outputs[0].token_ids) >= 1:
                    started.add(out.request_id)
        for _ in range(2):  # reach the steady state (with asynchronous scheduling a step is in flight)
            engine.step()
        sync()
        # Back-to-back steps, as in serving: a sync after each would hide the host/device overlap.
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        sync()
        step = (time.perf_counter() - t) / args.steps
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
        kv_bytes = b * (args.context + args.steps // 2) * kv_per_token
        mbu = (weight_bytes + kv_bytes) / step / bw
        row = dict(batch=b, context=args.context, step_ms=step * 1e3, tokens_per_s=b / step,
                   weight_GB=weight_bytes / 1e9, kv_GB=kv_bytes / 1e9, mbu=mbu)
        rows.append(row)
        print(json.dumps(row), flush=True)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    mode = ("eager" if args.enforce_eager else "CUDA graphs") + (
        ", async scheduling" if llm.llm_engine.async_scheduling else ", synchronous scheduling")
    print(f"\n{name}, copy bandwidth {bw / 1e12:.2f} TB/s, {layers} layers, {mode}")
    print("| batch | context | step ms | tokens/s | weights GB | K/V GB | MBU |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['context']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{r['weight_GB']:.2f} | {r['kv_GB']:.2f} | {100 * r['mbu']:.0f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "copy_bw": bw, "rows": rows}, f, indent=1)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    return run(p.parse_args())
