"""Structured outputs: cost of the grammar constraint, measured against the unconstrained peer in one run.

    python benchmarks/structured_outputs.py --num-requests 16
    python benchmarks/structured_outputs.py --num-requests 64 --model DIR --tokenizer TOK --load-format dummy

The default model is the bundled one. `--model` takes any HF directory (a config alone with `--load-format
dummy`: random weights of a GPU-sized shape, e.g. Llama-3-8B's, with the bundled tokenizer through `--tokenizer`,
so the grammars see a real vocabulary).

1. Compile time of the 20 sample schemas under each backend (xgrammar, llguidance).
2. Per-step mask cost: fill the packed bitmask for a batch of live matchers + apply it to the logits,
   in µs per sequence, for each backend.
3. End-to-end: a batch of JSON-schema requests vs the same prompts unconstrained, each unconstrained request
   forced (ignore_eos) to produce exactly as many tokens as its constrained twin; ratio of throughputs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.model.layers.sampler import apply_token_bitmask_
from pagedllm.structured_output.manager import StructuredOutputManager
from pagedllm.structured_output.sample_schemas import SCHEMAS, max_tokens_for


def _compile_and_mask(llm: LLM, backend: str, batch: int, steps: int) -> dict:
    eng = llm.llm_engine
    mgr = StructuredOutputManager(backend, eng.tokenizer, int(eng.hf_config.vocab_size), eng.eos_token_ids,
                                  pin_memory=eng.executor.device.type == "cuda")
    t0 = time.perf_counter()
    _ = mgr.backend  # tokenizer tables: once per engine, not per grammar
    init_ms = 1e3 * (time.perf_counter() - t0)
    compile_ms = []
    compiled = []
    for schema in SCHEMAS:
        t0 = time.perf_counter()
        compiled.append(mgr.request(StructuredOutputsParams(json=schema)).result())
        compile_ms.append(1e3 * (time.perf_counter() - t0))
    # Live matchers advanced by real tokens: drive each with greedy choices from its own mask.
    seqs = [SimpleNamespace(extra={}, output_token_ids=[], seq_id=i, is_finished=lambda: False)
            for i in range(batch)]
    pairs = [(s, compiled[i % len(compiled)]) for i, s in enumerate(seqs)]
    vocab = int(eng.hf_config.vocab_size)
    # The engine's own logits device: on CUDA the apply is the pinned copy + one kernel, timed to completion.
    device = eng.executor.device
    logits = torch.randn(batch, vocab, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fill_s = apply_s = 0.0
    n_rows = 0
    for _ in range(steps):
        live = [(s, c) for s, c in pairs if not mgr.backend.is_terminated(mgr.sync(s, c).matcher)]
        if not live:
            break
        t0 = time.perf_counter()
        mask = mgr.fill(live)
        t1 = time.perf_counter()
        lg = logits[: len(live)].clone()
        sync()
        t2 = time.perf_counter()
        apply_token_bitmask_(lg, mask, list(range(len(live))))
        sync()
        t3 = time.perf_counter()
        fill_s += t1 - t0
        apply_s += t3 - t2
        n_rows += len(live)
        for (s, _), tok in zip(live, lg.argmax(dim=1).tolist()):
            s.output_token_ids.append(tok)
    best_us, peer_us = _apply_peer_us(mask, logits, sync)
    mgr.shutdown()
    return {"backend": backend, "apply_best_us_per_seq": best_us, "xgrammar_apply_us_per_seq": peer_us,
            "init_ms": init_ms, "compile_ms_mean": sum(compile_ms) / len(compile_ms),
            "compile_ms_max": max(compile_ms), "fill_us_per_seq": 1e6 * fill_s / n_rows,
            "apply_us_per_seq": 1e6 * apply_s / n_rows, "rows": n_rows, "threads": mgr.num_threads,
            "device": str(device)}


def _apply_peer_us(mask: torch.Tensor, logits: torch.Tensor, sync) -> tuple[float, float]:
    """The engine's apply and its peer, xgrammar's own kernel, on the same bitmask and logits (the host
    bitmask copied to the device included): best of 5, µs per row → (engine, xgrammar)."""
    import xgrammar

    rows = min(mask.shape[0], logits.shape[0])
    dev = logits.device

    def engine(lg):
        apply_token_bitmask_(lg, mask, list(range(rows)))

    def peer(lg):
        m = mask[:rows].to(dev, non_blocking=True) if dev.type != "cpu" else mask[:rows]
        xgrammar.apply_token_bitmask_inplace(lg, m, vocab_size=lg.shape[1])

    out = []
    for fn in (engine, peer):
        best = float("inf")
        for _ in range(5):
            lg = logits[:rows].clone()
            sync()
            t0 = time.perf_counter()
            fn(lg)
            sync()
            best = min(best, time.perf_counter() - t0)
        out.append(1e6 * best / rows)
    return out[0], out[1]


def _end_to_end(llm: LLM, n: int, repeats: int) -> dict:
    """The constrained batch and its unconstrained twin, timed alternately `repeats` times after a warm-up
    of each; the ratio is of the summed times (per-round ratios are returned too). Each round's twin makes
    exactly as many tokens per request as that round's constrained batch did: seeded sampling repeats a
    batch only as far as the logits repeat, and on random weights in bf16 near-ties break differently when
    sequences finish in another order (another batch size, other GEMM kernels)."""
    prompts = [f"Reply with JSON matching {json.dumps(SCHEMAS[i % len(SCHEMAS)])[:60]}\n" for i in range(n)]
    cons = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens_for(SCHEMAS[i % len(SCHEMAS)]),
                           structured_outputs=StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)]))
            for i in range(n)]

    def twins(lens: list[int]) -> list[SamplingParams]:
        return [SamplingParams(temperature=1.0, seed=i, max_tokens=lens[i], ignore_eos=True) for i in range(n)]

    outs = llm.generate(prompts, cons, use_tqdm=False)  # compile + warm-up (grammars are cached afterwards)
    llm.generate(prompts, twins([len(o.outputs[0].token_ids) for o in outs]), use_tqdm=False)
    t_cons, t_plain, tokens, rounds_differ = [], [], 0, 0
    first: list[int] | None = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        got = llm.generate(prompts, cons, use_tqdm=False)
        t_cons.append(time.perf_counter() - t0)
        lens = [len(o.outputs[0].token_ids) for o in got]
        first = lens if first is None else first
        rounds_differ += lens != first
        plain = twins(lens)
        t0 = time.perf_counter()
        llm.generate(prompts, plain, use_tqdm=False)
        t_plain.append(time.perf_counter() - t0)
        tokens += sum(lens)
    return {"requests": n, "output_tokens": tokens // repeats, "constrained_tok_s": tokens / sum(t_cons),
            "unconstrained_tok_s": tokens / sum(t_plain), "ratio": sum(t_plain) / sum(t_cons),
            "round_ratios": [p / c for p, c in zip(t_plain, t_cons)], "rounds_with_other_lengths": rounds_differ}


def _ttft_while_compiling(llm: LLM, n_plain: int = 8, prompt: str = "JSON:") -> dict:
    """Plain requests decode; a request with a never-seen schema arrives alone, so the steps while its grammar
    compiles are the plain requests' decode steps (TPOT before vs during the compile). Then, under the same load,
    a plain twin of it arrives: the new request's TTFT is bounded by the twin's TTFT plus the compile time (its
    prompt runs, all but the last token, while the grammar compiles, so a long prompt hides the compile)."""
    eng = llm.llm_engine
    for i in range(n_plain):
        eng.add_request(f"plain{i}", f"Story {i}:", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))

    def step_times(k: int) -> list[float]:
        out = []
        for _ in range(k):
            t0 = time.perf_counter()
            eng.step()
            out.append(time.perf_counter() - t0)
        return out

    def first_token(request_id: str, t_add: float, during: list[float] | None = None, fut=None) -> float:
        while True:
            t0 = time.perf_counter()
            compiling = fut is not None and not fut.done()
            outs = eng.step()
            if compiling and during is not None:
                during.append(time.perf_counter() - t0)
            for o in outs:
                if o.request_id == request_id and o.outputs[0].token_ids:
                    return time.perf_counter() - t_add

    step_times(3)
    before = step_times(8)
    # A fresh schema (a unique property name defeats the cache).
    schema = {"type": "object", "properties": {f"k{time.time_ns()}": {"type": "array", "items": SCHEMAS[9]}},
              "required": []}
    during: list[float] = []
    t_add = time.perf_counter()
    group = eng.add_request("new_schema", prompt, SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(json=schema)))
    ttft_new = first_token("new_schema", t_add, during, group.extra["grammar_future"])
    step_times(3)
    t_add = time.perf_counter()
    eng.add_request("plain_twin", prompt, SamplingParams(temperature=0, max_tokens=8))
    ttft_plain = first_token("plain_twin", t_add)
    eng.abort_request([f"plain{i}" for i in range(n_plain)] + ["new_schema", "plain_twin"])
    while eng.has_unfinished_requests():
        eng.step()
    so = eng.structured_output
    compile_s = so.compile_seconds[so.cache_key(StructuredOutputsParams(json=schema))]
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
    return {"ttft_new_ms": 1e3 * ttft_new, "ttft_plain_ms": 1e3 * ttft_plain,
            "compile_ms": 1e3 * compile_s, "tpot_before_ms": 1e3 * med(before), "tpot_during_ms": 1e3 * med(during),
            "tpot_during_max_ms": 1e3 * max(during, default=float("nan")), "steps_during": len(during)}


def ttft_summary(samples: list[dict]) -> tuple[dict, str]:
    """Medians of `_ttft_while_compiling` samples, and each sample's TTFT minus its bound (twin + compile), in ms."""
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    excess = ", ".join(f"{s['ttft_new_ms'] - s['ttft_plain_ms'] - s['compile_ms']:+.1f}" for s in samples)
    return med, excess


def _use_previous_sampler(llm: LLM) -> None:
    """The engine's sampling as before one-kernel sampling: seeded requests get a generator on the device,
    and every random row takes the race over torch ops."""
    from pagedllm.model.layers.sampler import Sampler

    eng = llm.llm_engine
    dev = eng.executor.device
    eng.sampler = Sampler("race", native_cpu=False)
    eng._make_generator = lambda params, index: (  # shadows the engine's (static) method on this instance
        None if params.seed is None else torch.Generator(dev).manual_seed((params.seed * 1_000_003 + index) % 2**63))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--mask-batch", type=int, default=64)
    ap.add_argument("--mask-steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3, help="end-to-end rounds of each batch, timed alternately")
    ap.add_argument("--ttft-repeats", type=int, default=5, help="new-schema TTFT samples (medians are printed)")
    ap.add_argument("--ttft-prompt-words", type=int, default=0,
                    help="the new-schema request's (and its twin's) prompt: this many words of filler text before "
                         "'JSON:' (0: just 'JSON:')")
    ap.add_argument("--backend", default="xgrammar", choices=["xgrammar", "guidance"],
                    help="the engine's backend for the TTFT and end-to-end parts")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="synchronous steps (the engine's default on a GPU is asynchronous scheduling)")
    ap.add_argument("--model", default=None, help="model directory or GGUF (default: the bundled model)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--previous-sampler", action="store_true",
                    help="sample as the engine did before one-kernel sampling: a device generator per seeded "
                         "request and the Gumbel-max race over torch ops (the A/B's other arm)")
    args = ap.parse_args()
    model_kwargs = {k: v for k, v in (("model", args.model), ("tokenizer", args.tokenizer)) if v is not None}
    llm = LLM(**model_kwargs, load_format=args.load_format, dtype=args.dtype, num_gpu_blocks_override=1024, max_num_seqs=max(64, args.num_requests), max_model_len=1024,
              structured_outputs_backend=args.backend,
              **({"async_scheduling": False} if args.no_async_scheduling else {}))
    if args.previous_sampler:
        _use_previous_sampler(llm)
    cfg = llm.llm_engine.hf_config
    print(f"[model] {args.model or 'bundled'} ({args.load_format} weights): {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, vocab {cfg.vocab_size}, {llm.llm_engine.config.model_config.dtype} on "
          f"{llm.llm_engine.executor.device}", flush=True)
    for backend in ("xgrammar", "guidance"):
        try:
            r = _compile_and_mask(llm, backend, args.mask_batch, args.mask_steps)
        except ImportError as e:  # llguidance is an optional engine
            print(f"[{backend}] skipped: {e}", flush=True)
            continue
        print(f"[{backend}] backend init {r['init_ms']:.0f} ms; compile {r['compile_ms_mean']:.1f} ms mean / {r['compile_ms_max']:.1f} ms max over "
              f"{len(SCHEMAS)} schemas; mask fill {r['fill_us_per_seq']:.1f} µs/seq + apply "
              f"{r['apply_us_per_seq']:.1f} µs/seq on {r['device']} (best of 5 on one mask: "
              f"{r['apply_best_us_per_seq']:.1f} µs/seq vs xgrammar's apply kernel {r['xgrammar_apply_us_per_seq']:.1f} "
              f"µs/seq) (batch {args.mask_batch}, {r['rows']} rows, "
              f"{r['threads']} fill threads)", flush=True)
    so = llm.llm_engine.structured_output
    _ = so.backend  # started at engine start-up on a device; waits for it (or builds it, on CPU) here
    when = "at start-up" if llm.llm_engine.executor.device.type != "cpu" else "here (lazily on CPU)"
    print(f"[engine] {args.backend} tokenizer tables built in "
          f"{1e3 * (so.init_seconds or 0):.0f} ms {when}, before any request", flush=True)
    filler = " ".join(("the quick brown fox jumps over the lazy dog " * (args.ttft_prompt_words // 9 + 1)).split()
                      [:args.ttft_prompt_words])
    prompt = f"{filler} JSON:" if filler else "JSON:"
    samples = [_ttft_while_compiling(llm, prompt=prompt) for _ in range(args.ttft_repeats)]
    t, excess = ttft_summary(samples)
    print(f"[new schema] prompt of {len(llm.get_tokenizer().encode(prompt))} tokens; median of {len(samples)} fresh schemas: TTFT {t['ttft_new_ms']:.1f} ms vs plain twin "
          f"{t['ttft_plain_ms']:.1f} ms + compile {t['compile_ms']:.1f} ms = "
          f"{t['ttft_plain_ms'] + t['compile_ms']:.1f} ms bound (each: TTFT - bound {excess} ms); others' step time "
          f"{t['tpot_before_ms']:.2f} ms before vs {t['tpot_during_ms']:.2f} ms (max {t['tpot_during_max_ms']:.2f}) "
          f"while it compiled ({t['steps_during']:.0f} steps)", flush=True)
    e = _end_to_end(llm, args.num_requests, args.repeats)
    rounds = ", ".join(f"{100 * r:.1f}" for r in e["round_ratios"])
    mode = "async" if llm.llm_engine.async_scheduling else "sync"
    mode += " scheduling" + (", previous sampler" if args.previous_sampler else "")
    print(f"[end-to-end {args.backend}, {mode}] {e['requests']} JSON-schema requests, {e['output_tokens']} tokens x "
          f"{args.repeats} rounds ({e['rounds_with_other_lengths']} with other lengths than the first) (per round: {rounds} %): constrained "
          f"{e['constrained_tok_s']:.1f} tok/s vs unconstrained {e['unconstrained_tok_s']:.1f} tok/s "
          f"-> {100 * e['ratio']:.1f} % (target >= 85 % on CPU, >= 90 % on a GPU)", flush=True)


if __name__ == "__main__":
    main()
