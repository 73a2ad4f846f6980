"""GGUF weights served quantized vs dequantized: quality (greedy agreement, perplexity), memory, GEMM designs.

Runs the same GGUF through two engines in one process, ``--quantization gguf`` and ``--quantization none``:
  * greedy outputs of both over the same prompts: the share of reference tokens the quantized model also
    ranks first given the reference prefix (teacher-forced top-1 agreement), and the share of identical
    tokens when both run free (up to each output's first difference);
  * perplexity of both on a fixed text (prompt log-probs);
  * resident weight bytes vs the file's tensor bytes;
  * the two GEMM designs of kernels/cpu_quant.py (int8 dot products on interleaved rows vs dequantize + FMA) on the
    model's own layer shapes at several batch sizes, with torch float32 ``F.linear`` as the yardstick.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
import time

import numpy as np

FIXED_TEXT = (
    "The history of computing is a story of abstractions built on top of one another. Early machines were "
    "programmed by rewiring panels; later, stored programs let the same hardware run many tasks. Operating "
    "systems introduced virtual memory, which maps a process's contiguous logical pages to scattered physical "
    "frames, so that memory can be allocated on demand and shared between processes with copy-on-write. "
    "Large language model serving faces a similar problem: the key-value cache of each request grows and "
    "shrinks dynamically, and reserving contiguous memory for the maximum length wastes most of it. "
)
PROMPT_TEXTS = (
    "The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village by the sea,",
    "List three primary colors:", "In 1969, the first humans", "Translate to French: I love programming.",
    "The quick brown fox", "Water boils at a temperature of", "A haiku about autumn:\n",
    "Question: What is 12 times 12?\nAnswer:", "import numpy as np\nx = np.arange(10)\n", "My favourite book is",
    "The three laws of thermodynamics are", "Write a short email asking for a day off.", "SELECT name FROM",
    "The best way to learn a language is", "Photosynthesis is the process by which", "Here is a recipe for pancakes:",
    "The French Revolution began in", "To install Python packages, you", "The mitochondria is", "Dear diary, today",
    "A prime number is", "The weather tomorrow will be", "Explain recursion to a child:", "class Stack:\n    def",
    "The Pacific Ocean is", "Roses are red,", "The GDP of a country measures", "How do airplanes fly?",
    "The first step in solving a quadratic equation is", "Summarize the plot of Hamlet:",
)


def random_gguf_blocks(qtype: int, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF blocks of ``qtype`` (uint8 [rows, row_bytes]: random quants, small positive fp16 scales/minimums),
    for kernel tests and timings."""
    from pagedllm.kernels.cpu_quant import BLOCK_LAYOUT, GGML_TYPES

    rng = np.random.default_rng(seed)
    if qtype == GGML_TYPES["MXFP4"]:  # its scale is an exponent byte: random rows quantized (~N(0, 0.01) weights)
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        w = rng.standard_normal((rows, k), dtype=np.float32) * 0.01
        return quantize(w, GGMLQuantizationType.MXFP4).reshape(rows, -1)
    elems, nbytes = BLOCK_LAYOUT[qtype]
    blocks = rng.integers(0, 256, size=(rows, k // elems, nbytes), dtype=np.uint8)
    two = qtype in tuple(GGML_TYPES[t] for t in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"))  # d and a minimum
    for i in range(2 if two else 1):
        scale = rng.uniform(0.001, 0.02, size=(rows, k // elems)).astype(np.float16)
        at = nbytes - 2 if qtype == GGML_TYPES["Q6_K"] else 2 * i  # Q6_K's d ends its super-block
        blocks[:, :, at:at + 2] = scale.view(np.uint8).reshape(rows, k // elems, 2)
    return blocks.reshape(rows, -1)


def copy_gguf_tokenizer(writer, source: str | Path) -> int:
    """Write the tokenizer keys of the GGUF file ``source`` (BPE tokens, types, merges, special ids, chat template)
    into the gguf ``writer``; returns the vocabulary size."""
    from gguf import GGUFReader

    reader = GGUFReader(source)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    tokens = field("tokenizer.ggml.tokens")
    writer.add_tokenizer_model(field("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types(field("tokenizer.ggml.token_type"))
    writer.add_token_merges(field("tokenizer.ggml.merges"))
    writer.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    writer.add_chat_template(field("tokenizer.chat_template"))
    return len(tokens)


def perplexity(llm, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of ``token_ids[1:]`` given their prefixes, from prompt log-probs."""
    from pagedllm import SamplingParams

    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    out = llm.generate([{"prompt_token_ids": list(token_ids)}],
                       SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)[0]
    lps = [d[t].logprob for t, d in zip(token_ids[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(lps) / len(lps))


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pagedllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def teacher_forced_agreement(llm, prompts: list[list[int]], references: list[list[int]]) -> tuple[int, int]:
    """(reference tokens that ``llm`` also ranks first given the reference prefix, reference tokens)."""
    from pagedllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p + r} for p, r in zip(prompts, references)], sp, use_tqdm=False)
    agree = total = 0
    for p, r, o in zip(prompts, references, outs):
        for i, tok in enumerate(r):
            d = o.prompt_logprobs[len(p) + i]
            agree += max(d, key=lambda t: d[t].logprob) == tok
            total += 1
    return agree, total


def free_running_agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(tokens identical up to each pair's first difference, all tokens)."""
    same = total = 0
    for x, y in zip(a, b):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        same += n
        total += len(x)
    return same, total


def gemm_sweep(llm, batch_sizes: list[int], repeats: int) -> list[dict]:
    """Time int8 vs dequant vs torch float32 on the model's distinct quantized layer shapes."""
    import torch
    import torch.nn.functional as F

    from pagedllm.kernels import cpu_quant

    kern = cpu_quant.load_quant_kernels()
    model = llm.llm_engine.executor.driver_worker.model
    shapes: dict[tuple, object] = {}
    for m in model.modules():
        w = getattr(m, "gguf_weight", None)
        if w is not None:
            shapes.setdefault((w.type_name, w.out_features, w.in_features), w)
    rows = []
    for (tname, n, k), w in sorted(shapes.items()):
        dense = kern.dequantize_rows(w, torch.arange(n))
        for bs in batch_sizes:
            x = torch.randn(bs, k)
            fns = {"int8": lambda x=x, w=w: kern.linear(x, w, "int8"),
                   "dequant": lambda x=x, w=w: kern.linear(x, w, "dequant"),
                   "torch_f32": lambda x=x, dense=dense: F.linear(x, dense)}
            best = {}
            for name, fn in fns.items():
                fn()
                ts = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    ts.append(time.perf_counter() - t0)
                best[name] = min(ts)
            row = {"type": tname, "N": n, "K": k, "batch": bs} | {f"{a}_us": v * 1e6 for a, v in best.items()}
            row["winner"] = min(("int8", "dequant"), key=best.get)
            rows.append(row)
            print(f"{tname:5s} N={n:6d} K={k:5d} batch={bs:4d}  " + "  ".join(
                f"{a} {v * 1e6:9.0f} us ({2 * bs * n * k / v / 1e9:6.1f} GFLOP/s)" for a, v in best.items())
                + f"  → {row['winner']}", flush=True)
    return rows


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2 Q4_1).")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--batch-sizes", default="1,4,16,64,256", help="GEMM sweep batch sizes ('' to skip).")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output-json", default=None)


def run(args: argparse.Namespace) -> int:
    from pagedllm import LLM
    from pagedllm.model.layers.quantized_linear import resident_weight_bytes

    figures: dict = {}
    engines = {}
    for q in ("gguf", "none"):
        t0 = time.perf_counter()
        engines[q] = LLM(model=args.model, quantization=q, num_gpu_blocks_override=512, max_num_seqs=64)
        model = engines[q].llm_engine.executor.driver_worker.model
        figures[f"{q}_weight_bytes"] = resident_weight_bytes(model)
        print(f"{q}: engine ready in {time.perf_counter() - t0:.1f} s, weight bytes in memory "
              f"{figures[f'{q}_weight_bytes'] / 1e6:.1f} MB", flush=True)
    from pagedllm.model.gguf_loader import read_gguf_raw_tensors
    from pagedllm.model.loader import resolve_model

    _, file_bytes = read_gguf_raw_tensors(resolve_model(args.model))
    figures["file_tensor_bytes"] = file_bytes
    print(f"GGUF tensor bytes {file_bytes / 1e6:.1f} MB; quantized resident / file = "
          f"{figures['gguf_weight_bytes'] / file_bytes:.3f}x; dequantized = {figures['none_weight_bytes'] / file_bytes:.2f}x")
    tok = engines["none"].get_tokenizer()
    texts = [PROMPT_TEXTS[i % len(PROMPT_TEXTS)] for i in range(args.num_prompts)]
    prompts = [tok.encode(t) for t in texts]
    ref = greedy(engines["none"], prompts, args.max_tokens)
    quant = greedy(engines["gguf"], prompts, args.max_tokens)
    a, n = teacher_forced_agreement(engines["gguf"], prompts, ref)
    s, _ = free_running_agreement(quant, ref)
    figures |= {"teacher_forced_agreement": a / n, "free_running_identical": s / n, "tokens": n}
    print(f"greedy agreement over {len(prompts)} prompts × {args.max_tokens} tokens: teacher-forced top-1 "
          f"{a}/{n} = {100 * a / n:.1f} %; free-running identical {s}/{n} = {100 * s / n:.1f} %")
    ids = tok.encode(FIXED_TEXT * 2)
    ppl = {q: perplexity(engines[q], ids) for q in engines}
    figures |= {"perplexity_gguf": ppl["gguf"], "perplexity_none": ppl["none"]}
    print(f"perplexity on the fixed text ({len(ids)} tokens): gguf {ppl['gguf']:.4f}, none {ppl['none']:.4f} "
          f"({100 * (ppl['gguf'] / ppl['none'] - 1):+.2f} %)")
    del engines["none"]
    sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if sizes:
        figures["gemm"] = gemm_sweep(engines["gguf"], sizes, args.repeats)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0
