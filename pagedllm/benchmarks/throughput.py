"""Offline throughput on a fixed, seeded workload, with Hugging Face transformers as the peer.

pagedllm runs every request through continuous batching; `--compare hf` runs the same prompts
through transformers' padded static-batch `model.generate` on the same weights in the same process
and prints the ratio.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass


@dataclass
class Workload:
    prompts: list[list[int]]
    output_len: list[int]


def make_workload(num_prompts: int, min_in: int, max_in: int, output_len: int, vocab: int, seed: int) -> Workload:
    """Random token-id prompts with lengths uniform in [min_in, max_in]; fixed output length."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(min_in, max_in))] for _ in range(num_prompts)]
    return Workload(prompts, [output_len] * num_prompts)


def make_sharegpt_like(num_prompts: int, vocab: int, seed: int, max_prompt: int = 1024, max_total: int = 2048) -> Workload:
    """Lengths from log-normal fits to ShareGPT (means ≈161 in / 338 out, paper Fig. 11)."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(num_prompts):
        n_in = min(max_prompt, max(4, int(rng.lognormvariate(4.6, 0.9))))
        n_out = max(4, min(max_total - n_in, int(rng.lognormvariate(5.4, 0.9))))
        prompts.append([rng.randrange(100, vocab) for _ in range(n_in)])
        outs.append(n_out)
    return Workload(prompts, outs)


@dataclass
class Result:
    system: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    def row(self) -> str:
        return (f"{self.system:<10} {self.elapsed_s:9.2f} s  {self.requests_per_s:8.3f} req/s  "
                f"{self.output_tokens_per_s:10.1f} out tok/s  {self.total_tokens_per_s:10.1f} total tok/s")


def run_pagedllm(llm, wl: Workload, longest_first: bool = False) -> Result:
    """`longest_first`: each request's priority is minus its output length (the engine runs the priority policy),
    so long requests start early and the schedule's tail is made of short ones."""
    from pagedllm import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_len]
    prompts = [{"prompt_token_ids": p} for p in wl.prompts]
    priority = [-n for n in wl.output_len] if longest_first else None
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True, priority=priority)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return Result("pagedllm", elapsed, len(outs), sum(map(len, wl.prompts)), n_out)


def left_padded(batch: list[list[int]], pad_id: int):
    """(input ids, attention mask) of prompts left-padded to the longest, as transformers' generate takes them."""
    import torch

    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for j, p in enumerate(batch):
        ids[j, width - len(p):] = torch.tensor(p)
        mask[j, width - len(p):] = 1
    return ids, mask


def run_hf_static(model, wl: Workload, batch_size: int, pad_id: int) -> Result:
    """transformers' padded static batching: left-pad each batch to its longest prompt."""
    import torch

    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    n_out_total = 0
    t0 = time.perf_counter()
    for i in tqdm(range(0, len(wl.prompts), batch_size), desc="HF batches"):
        batch = wl.prompts[i : i + batch_size]
        new = max(wl.output_len[i : i + batch_size])
        ids, mask = left_padded(batch, pad_id)
        width = ids.shape[1]
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=pad_id)
        n_out_total += (out.shape[1] - width) * len(batch)
    elapsed = time.perf_counter() - t0
    return Result("hf", elapsed, len(wl.prompts), sum(map(len, wl.prompts)), n_out_total)


def build_hf_cb_model(model_dir: str, dtype: str, device: str, attn_implementation: str):
    """A transformers LlamaForCausalLM-style model from `model_dir`'s config, randomly initialised directly
    on `device` (no 16 GB CPU draw); pagedllm then loads these very weights (`copy_weights_to_pagedllm`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedllm.worker.worker import resolve_dtype

    torch_dtype = resolve_dtype(dtype, device)  # the engine's own choice for "auto"
    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        try:
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype, attn_implementation=attn_implementation)
        except (ValueError, ImportError) as e:  # older transformers: let continuous batching pick its own
            print(f"attn_implementation={attn_implementation!r} refused ({e}); using sdpa")
            m = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype, attn_implementation="sdpa")
    return m.eval()


def copy_weights_to_pagedllm(llm, hf_model) -> None:
    """Same weights on both sides: load the HF state dict into pagedllm's (single-worker) model."""
    llm.llm_engine.executor.driver_worker.load_weights(iter(hf_model.state_dict().items()))


def run_hf_cb(model, wl: Workload, num_blocks: int | None = None) -> Result:
    """transformers continuous batching (paged attention inside HF) with each request's own output length;
    EOS is disabled (eos_token_id=-1) so every request produces exactly its output_len tokens."""
    import inspect

    from transformers import GenerationConfig

    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(wl.output_len), eos_token_id=-1, pad_token_id=0)
    kwargs = {"generation_config": gen_cfg}
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        if "continuous_batching_config" in inspect.signature(model.init_continuous_batching).parameters:
            extra = {} if num_blocks is None else {"num_blocks": num_blocks, "max_batch_tokens": 256}
            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(**extra)
    except ImportError:
        pass
    manager = model.init_continuous_batching(**kwargs)
    manager.start()
    for i in range(2):  # untimed warm-up requests (kernel selection, allocator)
        manager.add_request(wl.prompts[i], request_id=f"warmup{i}", max_new_tokens=4)
    done = 0
    while done < 2:
        r = manager.get_result(timeout=1)
        if r is not None and r.is_finished():
            done += 1
        elif r is None and not manager.is_running():
            raise RuntimeError("transformers' continuous batching thread stopped during warm-up")
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(wl.prompts, wl.output_len)):
        manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
    n_out = finished = 0
    while finished < len(wl.prompts):
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped early")
            continue
        if result.is_finished():
            finished += 1
            n_out += len(result.generated_tokens)
    elapsed = time.perf_counter() - t0
    manager.stop(block=True)
    del manager
    return Result("hf-cb", elapsed, len(wl.prompts), sum(map(len, wl.prompts)), n_out)


def load_hf_reference(model: str | None, dtype: str, device: str, load_format: str = "auto"):
    """The same weights through transformers' own loader (GGUF or HF dir). `load_format` "dummy" (a config alone):
    transformers' own random initialisation of that config (values differ from pagedllm's dummy weights; shapes,
    dtype and so the work per token do not)."""
    from pathlib import Path
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedllm.model.gguf_loader import transformers_dense_gguf_kwargs
    from pagedllm.model.loader import resolve_model
    from pagedllm.worker.worker import resolve_dtype

    path = Path(resolve_model(model))
    torch_dtype = resolve_dtype(dtype, device)  # the engine's own choice for "auto"
    if load_format == "dummy":
        import torch

        with torch.device(device):  # a large random model initialised where it runs
            m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=torch_dtype)
    elif path.suffix == ".gguf":
        m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch_dtype,
                                                 **transformers_dense_gguf_kwargs())
    else:
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype)
    return m.to(device).eval()


def add_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-min", type=int, default=16)
    p.add_argument("--input-len-max", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset", choices=["uniform", "sharegpt-like"], default="uniform",
                   help="uniform: prompt lengths in [min,max], fixed output; sharegpt-like: paper Fig. 11 shapes.")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--compare", choices=["none", "hf", "hf-cb", "llama.cpp"], default="none",
                   help="Also run this peer in the same process: hf = padded static batches (model.generate), "
                        "hf-cb = transformers continuous batching on the same weights, llama.cpp = llama-server "
                        "(parallel slots) on the same GGUF file and prompts (CPU).")
    p.add_argument("--llama-server", default=None, help="llama-server binary for --compare llama.cpp (default: "
                   "$PAGEDLLM_LLAMA_SERVER, llama-server on PATH, or the pagedllm cache's build).")
    p.add_argument("--llama-parallel", default="1,4,16,64",
                   help="Slot counts (-np) to try for --compare llama.cpp, comma-separated; the best is the peer.")
    p.add_argument("--llama-threads", type=int, default=None, help="llama-server -t (default: torch's threads).")
    p.add_argument("--llama-args", default="--no-repack",
                   help="Extra llama-server arguments (default --no-repack: see benchmarks/llama_cpp.py).")
    p.add_argument("--hf-cb-num-blocks", type=int, default=None,
                   help="KV blocks for the hf-cb peer (default: transformers sizes its cache from free memory).")
    p.add_argument("--hf-attn-implementation", default="paged|sdpa", help="attn_implementation for --compare hf-cb.")
    p.add_argument("--hf-batch-size", type=int, default=64, help="Static batch size for the HF peer.")
    p.add_argument("--hf-num-prompts", type=int, default=None, help="Run the HF peer on only the first N prompts.")
    p.add_argument("--priority", choices=["none", "longest-output-first"], default="none",
                   help="longest-output-first: run pagedllm with --scheduling-policy priority and each request's "
                        "priority = -max_tokens (its output length; the workload sets ignore_eos), the order the "
                        "lower bound assumes. none: every request at priority 0 (FCFS unless the policy is set).")
    p.add_argument("--output-json", default=None, help="Write the figures to this JSON file.")
    p.add_argument("--lower-bound", action=argparse.BooleanOptionalAction, default=True,
                   help="On CUDA: measure copy bandwidth and bf16 matmul peak here and print the run's efficiency "
                        "against the lower bound of benchmarks/lower_bound.py, plus a step-time breakdown. On CPU: "
                        "measure the fp32 FMA peak here and print the run's GFLOP/s against it (benchmarks/cpu_flops.py).")
    EngineArgs.add_cli_args(p)


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    longest_first = args.priority == "longest-output-first"
    if longest_first:
        engine_args.scheduling_policy = "priority"
    hf_cb = None
    if args.compare == "hf-cb":  # build the peer first; pagedllm then loads its weights
        from pagedllm.model.loader import resolve_model

        engine_args.model = str(resolve_model(engine_args.model))
        hf_cb = build_hf_cb_model(engine_args.model, args.dtype, engine_args.device if engine_args.device != "auto"
                                  else ("cuda" if torch.cuda.is_available() else "cpu"), args.hf_attn_implementation)
    hf_result = None
    if hf_cb is not None:  # the peer runs first, so pagedllm's profiling sees its leftovers, not the reverse
        vocab = int(hf_cb.config.vocab_size)
        full = (make_workload(args.num_prompts, args.input_len_min, args.input_len_max, args.output_len, vocab,
                              args.workload_seed) if args.dataset == "uniform"
                else make_sharegpt_like(args.num_prompts, vocab, args.workload_seed))
        n = args.hf_num_prompts or len(full.prompts)
        hf_result = run_hf_cb(hf_cb, Workload(full.prompts[:n], full.output_len[:n]), args.hf_cb_num_blocks)
        print(hf_result.row(), flush=True)
        if hasattr(hf_cb, "destroy_cached_continuous_batching_manager"):
            hf_cb.destroy_cached_continuous_batching_manager()
        import gc

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            # The peer's weights stay resident (they are copied into pagedllm's below) and each engine takes its
            # gpu_memory_utilization share of the whole card: pagedllm's share shrinks by what the peer holds.
            resident = torch.cuda.memory_allocated()
            share = engine_args.gpu_memory_utilization - resident / torch.cuda.get_device_properties(0).total_memory
            print(f"the HF peer keeps {resident / 2**30:.2f} GiB resident: pagedllm runs with "
                  f"gpu_memory_utilization {share:.2f} (of {engine_args.gpu_memory_utilization})", flush=True)
            engine_args.gpu_memory_utilization = share
    t_init = time.perf_counter()
    llm = LLM(**vars(engine_args))
    t_init = time.perf_counter() - t_init
    print(f"engine init (LLM() incl. warm start): {t_init:.2f} s", flush=True)
    if hf_cb is not None:
        copy_weights_to_pagedllm(llm, hf_cb)
    vocab = int(llm.llm_engine.hf_config.vocab_size)
    if args.dataset == "uniform":
        wl = make_workload(args.num_prompts, args.input_len_min, args.input_len_max, args.output_len, vocab,
                           args.workload_seed)
    else:
        wl = make_sharegpt_like(args.num_prompts, vocab, args.workload_seed)
    device = str(llm.llm_engine.executor.device)
    print(f"workload: {len(wl.prompts)} requests, {sum(map(len, wl.prompts))} prompt tokens, "
          f"{sum(wl.output_len)} output tokens; device={device} dtype={llm.llm_engine.executor.dtype} "
          f"threads={torch.get_num_threads()}")
    # the FLOP and byte model (lower_bound.ModelShape) counts attention layers: none for a pure state-space model
    has_shape = getattr(llm.llm_engine.hf_config, "num_attention_heads", None) is not None
    if args.lower_bound and not has_shape:
        print("no lower bound or FLOP count: the model has no attention layers (a pure state-space model)")
    cuda_bound = args.lower_bound and has_shape and device.startswith("cuda")
    stats = None
    if cuda_bound:
        from pagedllm.benchmarks.kernels import copy_bandwidth
        from pagedllm.benchmarks.lower_bound import measure_matmul_peak

        bandwidth, peak = copy_bandwidth(), measure_matmul_peak()
        print(f"measured here: copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
        extra_ttft = probe_first_request(llm, wl.prompts[0])
        stats = llm.llm_engine.executor.driver_worker.model_runner.enable_step_stats()
    elif args.lower_bound and device.startswith("cuda"):  # no bound to compare with, but the steps still tell
        stats = llm.llm_engine.executor.driver_worker.model_runner.enable_step_stats()
    cpu_work = args.lower_bound and has_shape and device == "cpu"
    if cpu_work:
        from pagedllm.benchmarks import cpu_flops

        peak = cpu_flops.measure_cpu_peak()
        print(peak.line(), flush=True)
        stats = llm.llm_engine.executor.driver_worker.model_runner.enable_step_stats()
        shape = cpu_flops.ModelShape.from_hf_config(llm.llm_engine.hf_config, dtype_bytes=4)
    cpu0 = time.process_time()
    if longest_first:
        print("scheduling: priority policy, longest output first", flush=True)
    results = [run_pagedllm(llm, wl, longest_first)]
    run_cpu_s = time.process_time() - cpu0
    extra = {"engine_init_s": t_init, "priority": args.priority}
    st = llm.stats()  # pool-bound runs: how often the pool forced a preemption
    extra.update({k: st[k] for k in ("num_preemptions", "kv_blocks_total") if k in st})
    print(f"pool: {st.get('kv_blocks_total')} blocks, {st.get('num_preemptions')} preemptions", flush=True)
    if cuda_bound:
        extra["first_request_ttft_s"] = extra_ttft
    if cuda_bound:
        extra.update(report_bound(llm, wl, results[0].elapsed_s, bandwidth, peak, stats))
    elif stats is not None and device.startswith("cuda"):
        from pagedllm.worker.step_stats import format_summary

        extra["steps"] = stats.summary()
        print(format_summary(extra["steps"]))
    if cpu_work:
        extra.update(cpu_flops.report(shape, stats, peak, results[0].elapsed_s, run_cpu_s))
        fma_readings = [("before pagedllm", peak.fma_flops), ("after pagedllm", cpu_flops.measure_fma_peak(peak.isa))]
    if args.compare == "hf":
        del llm
        hf = load_hf_reference(engine_args.model, args.dtype, device)
        sub = wl if args.hf_num_prompts is None else Workload(wl.prompts[: args.hf_num_prompts],
                                                               wl.output_len[: args.hf_num_prompts])
        pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
        results.append(run_hf_static(hf, sub, args.hf_batch_size, pad))
    if hf_result is not None:
        results.append(hf_result)
    if args.compare == "llama.cpp":
        results.append(run_llama_cpp_peer(args, engine_args.model, wl, extra))
    for r in results:
        print(r.row())
    if cpu_work:
        if len(results) > 1:  # the peers have run too (hf-cb before pagedllm, the others after it)
            fma_readings.append(("at the end", cpu_flops.measure_fma_peak(peak.isa)))
        extra.update(cpu_flops.host_speed_report(fma_readings))
    if cpu_work and len(results) == 2 and results[1].num_requests == results[0].num_requests:
        useful = extra["steps_flops"]["all"]["flops"]
        print(f"same useful work ({useful / 1e12:.3f} TFLOP) per system: " + ", ".join(
            f"{r.system} {useful / r.elapsed_s / 1e9:.1f} GFLOP/s ({useful / r.elapsed_s / peak.fma_flops:.1%} "
            f"of peak)" for r in results))
    if len(results) == 2:
        ours, peer = results
        print(f"ratio pagedllm/{peer.system}: output tok/s {ours.output_tokens_per_s / peer.output_tokens_per_s:.2f}x, "
              f"total tok/s {ours.total_tokens_per_s / peer.total_tokens_per_s:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in results] + [extra], f,
                      indent=2)
    return 0


def run_llama_cpp_peer(args: argparse.Namespace, model: str | None, wl: Workload, extra: dict) -> Result:
    """llama-server on the same GGUF and prompts, once per slot count in --llama-parallel → the best run."""
    import torch

    from pagedllm.benchmarks.llama_cpp import find_llama_server, run_llama_server
    from pagedllm.model.loader import resolve_model

    gguf = resolve_model(model)
    if not gguf.endswith(".gguf"):
        raise ValueError(f"--compare llama.cpp needs a .gguf model, got {gguf}")
    binary = find_llama_server(args.llama_server)
    if binary is None:
        raise ValueError("--compare llama.cpp: no llama-server binary found (pass --llama-server, set "
                         "PAGEDLLM_LLAMA_SERVER, or build it: README.md, 'llama.cpp as a CPU peer')")
    try:
        slots = [int(s) for s in str(args.llama_parallel).split(",") if s.strip()]
    except ValueError:
        slots = []
    if not slots or min(slots) < 1:
        raise ValueError(f"--llama-parallel must list positive slot counts, got {args.llama_parallel!r}")
    threads = args.llama_threads or torch.get_num_threads()
    runs = []
    for n in slots:
        r, _ = run_llama_server(binary, gguf, wl, n, threads, extra_args=tuple(args.llama_args.split()))
        print(r.row(), flush=True)
        runs.append(r)
    best = max(runs, key=lambda r: r.output_tokens_per_s)
    extra["llama_cpp"] = {"binary": binary, "threads": threads,
                          "runs": [asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in runs]}
    print(f"llama.cpp best: {best.system} ({best.output_tokens_per_s:.1f} out tok/s)")
    return best


def report_bound(llm, wl: Workload, elapsed_s: float, bandwidth: float, peak: float, stats) -> dict:
    """Print the efficiency against the lower bound and the step-time breakdown; → figures for the JSON."""
    from pagedllm.benchmarks.lower_bound import ModelShape, format_bound, lower_bound, with_step_count
    from pagedllm.model.fp8_checkpoint import detect_fp8_checkpoint, keeps_fp8
    from pagedllm.model.int_weight_checkpoint import detect_int_weight_checkpoint
    from pagedllm.worker.step_stats import format_summary

    eng = llm.llm_engine
    cc, sc = eng.config.cache_config, eng.config.scheduler_config
    mc = eng.config.model_config
    # (an integer-weight checkpoint runs dequantized on CUDA: its linears stream model-dtype bytes)
    fp8_format = None if mc.load_format == "dummy" or detect_int_weight_checkpoint(eng.hf_config) is not None \
        else detect_fp8_checkpoint(eng.hf_config)
    # Decoder linears hold 1-byte weights with --quantization fp8, or from an FP8 checkpoint kept as such.
    fp8_weights = mc.quantization == "fp8" or (
        fp8_format is not None and fp8_format.weight_strategy != "block"
        and keeps_fp8("cuda", eng.executor.dtype, mc.quantization))
    shape = ModelShape.from_hf_config(eng.hf_config, dtype_bytes=eng.executor.dtype.itemsize,
                                      kv_dtype_bytes=1 if cc.cache_dtype.startswith("fp8") else None,
                                      matmul_weight_bytes=1 if fp8_weights else None)
    linear_peak = None
    if fp8_weights:
        from pagedllm.benchmarks.lower_bound import measure_matmul_peak

        linear_peak = measure_matmul_peak(fp8=True)
        print(f"measured here: fp8 matmul {linear_peak / 1e12:.0f} TFLOP/s (the FP8 linears' ceiling)")
    lb = lower_bound(shape, list(map(len, wl.prompts)), wl.output_len, sc.max_num_seqs,
                     cc.num_gpu_blocks * cc.block_size, bandwidth, peak, linear_peak)
    print(format_bound(lb, elapsed_s))
    first = None
    if stats.records:
        kind, path, n, a, b = stats.records[0]
        first = {"kind": f"{kind}/{path}", "tokens": n}
    summary = stats.summary()
    if first is not None:
        first["ms"] = stats.records[0][3].elapsed_time(stats.records[0][4])
        print(f"first step: {first['kind']} ({first['tokens']} tokens) {first['ms']:.2f} ms; "
              f"mean of its kind {summary[first['kind']]['mean_ms']:.2f} ms")
    print(format_summary(summary))
    out = {"lower_bound": lb.as_dict(), "efficiency": lb.total_s / elapsed_s, "steps": summary, "first_step": first}
    with_decodes = sum(v["count"] for k, v in summary.items() if not k.startswith("prefill/"))
    if with_decodes:
        run_lb = with_step_count(lb, shape, with_decodes)
        print(f"the same bound with this run's {with_decodes} decode-carrying steps (each reads the weights once): "
              f"{run_lb.total_s:.2f} s → efficiency {100 * run_lb.total_s / elapsed_s:.1f} %")
        out["lower_bound_at_run_steps"] = run_lb.as_dict()
        out["efficiency_at_run_steps"] = run_lb.total_s / elapsed_s
    return out


def probe_first_request(llm, prompt: list[int], repeats: int = 4) -> list[float]:
    """TTFT of one request (its prompt, one output token) sent to the fresh engine, then `repeats` - 1
    more times: the first is what a fresh engine's first user sees, the others the steady state."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    steady = min(times[1:])
    print(f"first request TTFT ({len(prompt)} prompt tokens, 1 output token): fresh engine {times[0] * 1e3:.1f} ms, "
          f"steady {steady * 1e3:.1f} ms → {times[0] / steady:.2f}x", flush=True)
    return times
