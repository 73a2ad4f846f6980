"""Where a single-sequence CPU decode step's milliseconds go, with the CPU direct forward on and off.

One engine (the bundled model by default, GGUF served quantized; or ``--model``: a GGUF file or an HF safetensors
directory of the Llama or Gemma family, a tokenizer optional: the prompts are token ids), one sequence at a time,
greedy: every decode step is timed by phase (``time.perf_counter_ns`` around the scheduler, input staging, the
forward, the LM head, the sampler, output processing), first with the direct forward (model/cpu_direct_forward.py)
and then with the module path, on the same prompts. Then the linears alone, called in a loop with the model's own
shapes: the layers' linears (4 per layer) and the LM head, one row (GGUF blocks through the C kernel, dense float32
weights through their layer's GEMM); then the forward of one token with each group of kernels made a no-op in turn
(linears, attention, then the rest: norms, q/k norms, RoPE, cache writes, SiLU or GeGLU), leaving the Python.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import torch

_INT8 = 0  # the GGUF linears' int8 design (cpu_quant.choose_method)
PHASES = ("step", "schedule", "prepare_inputs", "forward", "lm_head", "sampler", "complete", "other")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model (default: the bundled GGUF)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)


class _PhaseTimer:
    """Accumulates ns per phase over the decode steps (one token in the batch) of an engine."""

    def __init__(self, llm) -> None:
        eng = llm.llm_engine
        self.eng, self.runner = eng, eng.executor.driver_worker.model_runner
        self.acc: dict[str, int] = defaultdict(int)
        self.steps = 0
        self._cur: dict[str, int] = {}
        self._tokens = 0
        self._saved: list[tuple[object, str]] = []
        runner = self.runner
        self._wrap(eng.scheduler, "schedule", "schedule")
        self._wrap(runner, "prepare_inputs", "prepare_inputs", count_tokens=True)
        self._wrap(runner.model, "forward", "forward")
        self._wrap(runner.model, "compute_logits", "lm_head")
        self._wrap(eng.sampler, "launch", "sampler")
        self._wrap(eng, "_complete_step", "complete")
        self._wrap(eng, "step", "step", outer=True)

    def _wrap(self, obj, name: str, label: str, count_tokens: bool = False, outer: bool = False) -> None:
        f = getattr(obj, name)
        cur = self._cur

        def timed(*a, **k):
            if outer:
                cur.clear()
            if count_tokens:
                self._tokens = sum(len(c.token_ids) for c in a[0])
            t = time.perf_counter_ns()
            r = f(*a, **k)
            cur[label] = cur.get(label, 0) + time.perf_counter_ns() - t
            if outer and self._tokens == 1 and "prepare_inputs" in cur:
                self.steps += 1
                for key, v in cur.items():
                    self.acc[key] += v
            return r

        self._saved.append((obj, name))
        setattr(obj, name, timed)

    def wrap_direct(self) -> None:
        """Time the direct forward as the forward phase (it replaces model.forward)."""
        fwd = self.runner.direct_forward
        if fwd is None:
            return
        cur = self._cur

        class Timed:
            def can_run(self, meta):
                return fwd.can_run(meta)

            def __call__(self, *a):
                t = time.perf_counter_ns()
                r = fwd(*a)
                cur["forward"] = cur.get("forward", 0) + time.perf_counter_ns() - t
                return r

        self.runner.direct_forward = Timed()
        self._direct = fwd

    def restore(self) -> None:
        for obj, name in self._saved:
            delattr(obj, name)  # back to the class's method
        if getattr(self, "_direct", None) is not None:
            self.runner.direct_forward = self._direct

    def per_step_ms(self) -> dict[str, float]:
        n = max(self.steps, 1)
        out = {k: self.acc[k] / n / 1e6 for k in PHASES if k != "other"}
        out["other"] = out["step"] - sum(out[k] for k in PHASES if k not in ("step", "other"))
        return out


def _run(llm, prompts, output_len: int, direct: bool) -> dict:
    from pagedllm import SamplingParams

    runner = llm.llm_engine.executor.driver_worker.model_runner
    saved = runner.direct_forward
    if not direct:
        runner.direct_forward = None
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompts[0]], params, use_tqdm=False)  # warm
    timer = _PhaseTimer(llm)
    timer.wrap_direct()
    tokens = []
    try:
        t0 = time.perf_counter()
        for p in prompts:
            tokens.append(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
        wall = time.perf_counter() - t0
    finally:
        timer.restore()
        runner.direct_forward = saved
    return {"out_tok_s": len(prompts) * output_len / wall, "decode_steps": timer.steps,
            "ms_per_step": timer.per_step_ms(), "token_ids": tokens}


def _best_ms(fn, n: int = 30, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n * 1e3)
    return best


@torch.inference_mode()
def kernel_times(llm) -> dict[str, float]:
    """One row through the layer linears and the LM head alone: GGUF blocks by the C kernel's pointer call (no
    Python around them but the ctypes call), dense float32 weights through their layer's ``forward`` (oneDNN)."""
    runner = llm.llm_engine.executor.driver_worker.model_runner
    fwd = runner.direct_forward
    if fwd is None:
        return {}
    lins = [lin for layer in fwd.layers for lin in layer.linears]
    if fwd.gemm_method == "dense":
        rows = {lin.in_features: torch.randn(1, lin.in_features) for lin in lins}

        def layers() -> None:
            for lin in lins:
                lin.dense.forward(rows[lin.in_features])

        times = {f"{len(lins)} layer linears (dense)": _best_ms(layers)}
    else:
        linear = fwd._linear
        x = torch.randn(1, max(lin.in_features for lin in lins))
        y = torch.empty(1, max(lin.out_features for lin in lins))

        def layers() -> None:
            for lin in lins:
                linear(lin.qtype, lin.data_ptr, lin.out_features, lin.in_features, x.data_ptr(), 1, y.data_ptr(),
                       _INT8)

        times = {f"{len(lins)} layer linears (C)": _best_ms(layers)}
    times.update(_lm_head_time(runner.model.lm_head, fwd))
    times.update(_forward_without_kernels(llm, fwd))
    return times


def _lm_head_time(head, fwd) -> dict[str, float]:
    """One row through the LM head: its GGUF blocks by the C kernel, or its dense weight (tied embeddings too)."""
    w = head.gguf_weight
    if w is None:
        hidden = torch.randn(1, fwd.hidden)
        return {"lm_head linear (dense)": _best_ms(lambda: head.compute_logits(hidden))}
    x, out = torch.randn(1, w.in_features), torch.empty(1, w.out_features)
    linear = fwd._linear
    return {"lm_head linear (C)": _best_ms(lambda: linear(w.qtype, w.data_ptr, w.out_features, w.in_features,
                                                          x.data_ptr(), 1, out.data_ptr(), _INT8))}


#: The direct forward's C entry points other than the linears and attention (DirectForward's attributes):
#: norms (Gemma 3's and Qwen3's per-head q/k norms too), RoPE, the cache writes, the gated activations.
_OTHER_KERNELS = ("_rms", "_heads_norm", "_rope", "_cache", "_cache_bf16", "_cache_fp8", "_silu", "_gelu_tanh")


class _SkippedDenseLinears:
    """Each dense linear's ``forward`` replaced by one returning a fixed output of its shape (restored on exit)."""

    def __init__(self, lins, t: int) -> None:
        self.modules = {id(lin.dense): (lin.dense, torch.zeros(t, lin.out_features)) for lin in lins
                        if lin.dense is not None}

    def __enter__(self) -> None:
        for module, out in self.modules.values():
            module.forward = lambda *a, _out=out: _out

    def __exit__(self, *exc) -> None:
        for module, _ in self.modules.values():
            del module.forward  # back to the class's method


def _forward_without_kernels(llm, fwd, context: int = 64) -> dict[str, float]:
    """The direct forward of one decode token at ``context``, whole and with kernels turned into no-ops one
    group at a time: what is left is the other kernels' time, then the Python around the calls."""
    from pagedllm.worker.model_input import SequenceChunk

    runner = llm.llm_engine.executor.driver_worker.model_runner
    kv = llm.llm_engine.executor.driver_worker.cache_engine.gpu_cache
    bs = runner.block_size
    table = list(range(context // bs + 1))
    # Fills blocks no request holds: run after the timed generations (a later request would not read them).
    runner.execute_model([SequenceChunk(-1, [5] * context, 0, table, sample=True)], kv)
    ids, pos, meta, _ = runner.prepare_inputs([SequenceChunk(-1, [7], context, table, sample=True)])
    names = ("_linear", "_attention", *_OTHER_KERNELS)
    saved = {n: getattr(fwd, n) for n in names}
    lins = [lin for layer in fwd.layers for lin in layer.linears]
    out = {"direct forward, 1 token": _best_ms(lambda: fwd(ids, pos, kv, meta))}
    try:
        with _SkippedDenseLinears(lins, 1):
            fwd._linear = lambda *a: 0
            out["  linears skipped"] = _best_ms(lambda: fwd(ids, pos, kv, meta))
            fwd._attention = lambda *a: 0
            out["  and attention skipped"] = _best_ms(lambda: fwd(ids, pos, kv, meta))
            for n in _OTHER_KERNELS:
                setattr(fwd, n, lambda *a: None)
            out["  every kernel skipped (Python)"] = _best_ms(lambda: fwd(ids, pos, kv, meta))
    finally:
        for n, f in saved.items():
            setattr(fwd, n, f)
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def run(args: argparse.Namespace) -> int:
    from pagedllm import LLM
    llm = LLM(args.model, max_num_seqs=1, num_gpu_blocks_override=1024, device="cpu",
              skip_tokenizer_init=True)  # prompts are token ids: a checkpoint without a tokenizer runs too
    vocab = int(llm.llm_engine.hf_config.vocab_size)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 64))] for _ in range(args.num_prompts)]
    threads = torch.get_num_threads()
    results = {"cpu": _cpu_model(), "threads": threads,
               "direct": _run(llm, prompts, args.output_len, True),
               "module": _run(llm, prompts, args.output_len, False),
               "kernels_ms": kernel_times(llm)}
    same = results["direct"].pop("token_ids") == results["module"].pop("token_ids")
    results["identical_tokens"] = same
    print(f"{results['cpu']}, {threads} threads; one sequence, {args.num_prompts} prompts x {args.output_len} tokens")
    print(f"{'ms per decode step':<22}{'direct':>10}{'module':>10}")
    for k in PHASES:
        print(f"{k:<22}{results['direct']['ms_per_step'][k]:>10.3f}{results['module']['ms_per_step'][k]:>10.3f}")
    print(f"{'out tok/s':<22}{results['direct']['out_tok_s']:>10.1f}{results['module']['out_tok_s']:>10.1f}")
    for k, v in results["kernels_ms"].items():
        print(f"{k:<32}{v:>8.3f} ms")
    print(f"greedy tokens identical on both paths: {same}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    raise SystemExit(run(parser.parse_args()))
