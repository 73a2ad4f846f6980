"""Embedding throughput: pagedllm's pooling runner against transformers on the same prompts and weights.

pagedllm embeds every prompt with `LLM.embed` (continuous batching, chunked prompts, no padding). The peer runs
the same prompts through transformers' base model in padded batches sorted by length (as sentence-transformers
batches them, which keeps the padding small), pools the same way and normalizes. Both are timed after one
warm-up batch; the run prints prompt tokens/s, the ratio, and how far apart the two sets of vectors are
(the peer is also the correctness reference).
"""
from __future__ import annotations

import argparse
import json
import time

from pagedllm.benchmarks.throughput import make_workload


def add_args(p: argparse.ArgumentParser) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len-min", type=int, default=16)
    p.add_argument("--input-len-max", type=int, default=256)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=int, default=32, help="Batch size of the transformers peer.")
    p.add_argument("--output-json", default=None, help="Write the figures to this JSON file.")
    EngineArgs.add_cli_args(p)
    p.set_defaults(runner="pooling")


def _hf_base_model(model: str | None, dtype: str, device: str):
    """transformers' base model (no LM head) with the same weights: a GGUF file through its own loader."""
    from pathlib import Path

    from transformers import AutoModel

    from pagedllm.benchmarks.throughput import load_hf_reference
    from pagedllm.model.loader import resolve_model
    from pagedllm.worker.worker import resolve_dtype

    path = Path(resolve_model(model))
    if path.suffix == ".gguf":
        return load_hf_reference(model, dtype, device).model
    return AutoModel.from_pretrained(str(path), dtype=resolve_dtype(dtype, device)).to(device).eval()


def run_hf(model, prompts: list[list[int]], batch_size: int, pooling: str, normalize: bool):
    """(seconds, vectors in prompt order) for the padded, length-sorted peer."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    vectors: list = [None] * len(prompts)
    t0 = time.perf_counter()
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            ids[row, :len(prompts[i])] = torch.tensor(prompts[i])
            mask[row, :len(prompts[i])] = 1
        with torch.inference_mode():
            h = model(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state.float()
        m = mask.to(device).unsqueeze(-1).float()
        lens = mask.sum(1).to(device)
        if pooling == "LAST":
            pooled = h[torch.arange(len(idx), device=device), lens - 1]
        elif pooling == "MEAN":
            pooled = (h * m).sum(1) / lens.unsqueeze(-1)
        else:
            pooled = h[:, 0]
        if normalize:
            pooled = F.normalize(pooled, dim=-1)
        for row, i in enumerate(idx):
            vectors[i] = pooled[row].cpu()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, vectors


def _useful_flops(hf_config, prompts: list[list[int]]) -> float:
    """The decoder's matmuls for every prompt token plus causal attention (no LM head: nothing is sampled)."""
    from pagedllm.benchmarks.cpu_flops import step_flops
    from pagedllm.benchmarks.lower_bound import ModelShape

    shape = ModelShape.from_hf_config(hf_config)
    attended = sum(n * (n + 1) // 2 for n in map(len, prompts))
    return step_flops(shape, sum(map(len, prompts)), attended, 0)


def _peak(device: str) -> tuple[float, str]:
    """(FLOP/s, what it is): the bf16 matmul peak on a GPU, the fp32 FMA peak on the CPU, both measured here."""
    if device.startswith("cuda"):
        from pagedllm.benchmarks.lower_bound import measure_matmul_peak

        return measure_matmul_peak(), "bf16 matmul peak"
    from pagedllm.benchmarks.cpu_flops import measure_fma_peak

    return measure_fma_peak(), "fp32 FMA peak"


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedllm import LLM
    from pagedllm.engine.arg_utils import EngineArgs

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**{**vars(engine_args), "runner": "pooling"})
    engine = llm.llm_engine
    pooler = engine.config.model_config.pooler_config
    device = str(engine.executor.device)
    wl = make_workload(args.num_prompts, args.input_len_min, args.input_len_max, 0, int(engine.hf_config.vocab_size),
                       args.workload_seed)
    n_tokens = sum(map(len, wl.prompts))
    inputs = [{"prompt_token_ids": p} for p in wl.prompts]
    llm.embed(inputs[:8], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.embed(inputs, use_tqdm=True)
    ours_s = time.perf_counter() - t0
    ours = [o.outputs.embedding for o in outs]
    hf = _hf_base_model(engine_args.model, engine_args.dtype, device.split(":")[0])
    run_hf(hf, wl.prompts[:8], args.hf_batch_size, pooler.pooling_type, pooler.normalize)  # warm-up
    hf_s, theirs = run_hf(hf, wl.prompts, args.hf_batch_size, pooler.pooling_type, pooler.normalize)
    flops, peak, peak_name = _useful_flops(engine.hf_config, wl.prompts), *_peak(device)
    diff = max(float((torch.tensor(a) - b).abs().max()) for a, b in zip(ours, theirs))
    cos = min(float(torch.nn.functional.cosine_similarity(torch.tensor(a), b, dim=0)) for a, b in zip(ours, theirs))
    figures = {
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "dtype": str(engine.executor.dtype).removeprefix("torch."), "pooling_type": pooler.pooling_type,
        "num_prompts": len(wl.prompts), "prompt_tokens": n_tokens, "hf_batch_size": args.hf_batch_size,
        "pagedllm_s": ours_s, "hf_s": hf_s, "pagedllm_tok_s": n_tokens / ours_s, "hf_tok_s": n_tokens / hf_s,
        "ratio": hf_s / ours_s, "max_abs_diff": diff, "min_cosine": cos, "useful_flops": flops,
        "peak_name": peak_name, "peak_flops": peak, "pagedllm_frac_of_peak": flops / ours_s / peak,
        "hf_frac_of_peak": flops / hf_s / peak,
    }
    print(f"pagedllm: {ours_s:.2f} s, {n_tokens / ours_s:.0f} prompt tok/s | transformers (batch "
          f"{args.hf_batch_size}, length-sorted): {hf_s:.2f} s, {n_tokens / hf_s:.0f} prompt tok/s | "
          f"pagedllm ÷ HF speed {hf_s / ours_s:.2f}× | vectors: max |diff| {diff:.2e}, min cosine {cos:.6f}")
    print(f"useful work {flops / 1e12:.2f} TFLOP: pagedllm {flops / ours_s / 1e9:.0f} GFLOP/s = "
          f"{figures['pagedllm_frac_of_peak']:.0%} of the {peak_name} ({peak / 1e9:.0f} GFLOP/s, measured here), "
          f"transformers {figures['hf_frac_of_peak']:.0%}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0
