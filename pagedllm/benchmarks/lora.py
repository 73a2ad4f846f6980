"""Multi-LoRA throughput: the same requests with no adapter, one adapter, and several mixed in every batch.

Random PEFT adapters (rank --lora-rank, every projection) are made for the model on the fly. pagedllm runs the
workload four ways in one process, each the median of --repeats passes after an untimed one: an engine without
LoRA (the baseline, measured first and again last), and a LoRA engine with no adapter,
one adapter for all requests, and --num-adapters adapters round-robin. The peer is transformers + peft on the
same weights and adapters in padded static batches, mixing adapters per row with peft's `adapter_names`
(its multi-adapter batch inference). Prints output tokens/s, pagedllm's LoRA cost against its own baseline,
and pagedllm ÷ peer.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from pagedllm.benchmarks.throughput import left_padded, make_workload


def add_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-min", type=int, default=16)
    p.add_argument("--input-len-max", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=int, default=16, help="Static batch size of the transformers + peft peer.")
    p.add_argument("--repeats", type=int, default=3, help="Timed passes of each pagedllm configuration (median kept).")
    p.add_argument("--output-json", default=None)
    EngineArgs.add_cli_args(p)


def _make_adapters(hf_model, root: Path, n: int, rank: int) -> list[str]:
    import copy

    import peft
    import torch

    paths = []
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for i in range(n):
        torch.manual_seed(100 + i)
        m = peft.get_peft_model(copy.deepcopy(hf_model), peft.LoraConfig(r=rank, lora_alpha=2 * rank,
                                                                         target_modules=targets, init_lora_weights=False))
        for name, param in m.named_parameters():
            if "lora_" in name:
                param.data.normal_(0, 0.02)
        path = root / f"adapter{i}"
        m.save_pretrained(str(path))
        paths.append(str(path))
    return paths


def _run_pagedllm(llm, prompts, output_len: int, loras, repeats: int) -> float:
    """The median of `repeats` timed passes, after an untimed one."""
    import statistics

    from pagedllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    # A whole untimed pass first: an eager engine (--enforce-eager, or a CPU one) has no warm start, so its first
    # steps of each shape compile kernels; the timed passes are the steady state. On a GPU a pass can take a
    # fraction of a second, so one pass alone is at the mercy of the host.
    llm.generate(inputs, sp, lora_request=loras, use_tqdm=False)
    seconds = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        llm.generate(inputs, sp, lora_request=loras, use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def _run_peer(peft_model, prompts, output_len: int, names: list[str], batch_size: int, pad_id: int) -> float:
    import torch

    device = next(peft_model.parameters()).device
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        ids, mask = left_padded(prompts[i:i + batch_size], pad_id)
        with torch.inference_mode():
            peft_model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=pad_id,
                                adapter_names=names[i:i + batch_size])
    return time.perf_counter() - t0


def _release() -> None:
    """Free a dropped engine's weights and KV pool now (it sits in reference cycles), before the next one sizes
    its pool from free memory."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(args: argparse.Namespace) -> int:
    import peft
    import torch

    from pagedllm import LLM, LoRARequest
    from pagedllm.benchmarks.throughput import load_hf_reference
    from pagedllm.engine.arg_utils import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    kw = {k: v for k, v in vars(engine_args).items() if k not in ("enable_lora", "max_loras", "max_lora_rank")}
    base = LLM(**kw)
    device = str(base.llm_engine.executor.device)
    wl = make_workload(args.num_prompts, args.input_len_min, args.input_len_max, args.output_len,
                       int(base.llm_engine.hf_config.vocab_size), args.workload_seed)
    n_out = args.num_prompts * args.output_len
    times = {"base engine": _run_pagedllm(base, wl.prompts, args.output_len, None, args.repeats)}
    del base
    _release()
    hf = load_hf_reference(engine_args.model, engine_args.dtype, device.split(":")[0])
    with tempfile.TemporaryDirectory() as tmp:
        paths = _make_adapters(hf, Path(tmp), args.num_adapters, args.lora_rank)
        loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
        llm = LLM(**kw, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.lora_rank)
        times["LoRA engine, no adapter"] = _run_pagedllm(llm, wl.prompts, args.output_len, None, args.repeats)
        times["1 adapter"] = _run_pagedllm(llm, wl.prompts, args.output_len, loras[0], args.repeats)
        mixed = [loras[i % len(loras)] for i in range(len(wl.prompts))]
        times[f"{args.num_adapters} adapters mixed"] = _run_pagedllm(llm, wl.prompts, args.output_len, mixed,
                                                                     args.repeats)
        del llm
        _release()
        # The base engine once more, last: the spread between its two measurements is the host's drift.
        base = LLM(**kw)
        times["base engine, again"] = _run_pagedllm(base, wl.prompts, args.output_len, None, args.repeats)
        del base
        _release()
        peer = peft.PeftModel.from_pretrained(hf, paths[0], adapter_name="a0")
        for i, p in enumerate(paths[1:], start=1):
            peer.load_adapter(p, adapter_name=f"a{i}")
        peer.eval()
        pad = int(hf.config.eos_token_id if isinstance(hf.config.eos_token_id, int) else 0)
        names = [f"a{i % len(paths)}" for i in range(len(wl.prompts))]
        _run_peer(peer, wl.prompts[:2], 2, names[:2], args.hf_batch_size, pad)  # warm-up
        peer_s = _run_peer(peer, wl.prompts, args.output_len, names, args.hf_batch_size, pad)
    base_s = min(times["base engine"], times["base engine, again"])  # the faster: the ratios do not flatter LoRA
    mixed_s = times[f"{args.num_adapters} adapters mixed"]
    for name, s in times.items():
        print(f"pagedllm {name:>26}: {s:7.2f} s, {n_out / s:8.1f} out tok/s ({base_s / s:.2f}× the base engine)")
    print(f"transformers + peft ({args.num_adapters} adapters mixed, batch {args.hf_batch_size}): {peer_s:.2f} s, "
          f"{n_out / peer_s:.1f} out tok/s | pagedllm ÷ peer (mixed): {peer_s / mixed_s:.2f}×")
    figures = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
               "dtype": str(hf.dtype).removeprefix("torch."), "num_prompts": args.num_prompts,
               "output_len": args.output_len, "lora_rank": args.lora_rank, "num_adapters": args.num_adapters,
               "seconds": times, "peer_seconds": peer_s, "ratio_vs_peer": peer_s / mixed_s,
               "mixed_vs_base": base_s / mixed_s}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0
