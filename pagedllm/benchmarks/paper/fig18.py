"""Fig. 18: (a) attention kernel latency, paged vs contiguous; (b) block size vs normalized latency.

(a) On CPU: the native PagedAttention kernel (pagedllm/kernels/cpu_kernels) over block tables scattered
across a pool (block 16), against the same kernel over contiguous per-sequence KV (one block of the whole
context per sequence: no indirection), and torch SDPA over dense padded contiguous K/V; one decode layer
with the bundled model's heads (9 query / 3 KV of 64), batch 8 and 32, contexts 64-1024; outputs are
checked against each other. On CUDA: benchmarks/decode_attention.py's bench_point (the Triton kernel vs SDPA).
Paper (Fig. 18a): the paged kernel is 20-26 % slower than FasterTransformer's contiguous one.
(b) Paged only, both traces at one fixed rate each, block sizes 1..32 at small scale (lengths x1/8, so
block b here is block 8b of the paper's workload: 8..256) or 1..256 at paper scale; the pool keeps the
same number of token slots. Paper (Fig. 18b): 16-128 best on ShareGPT, 8-32 on Alpaca; 16 the default.
"""
from __future__ import annotations

import logging
import os
from types import SimpleNamespace

from pagedllm.benchmarks.cpu_kernels import median_ms
from pagedllm.benchmarks.paper import common
from pagedllm.benchmarks.paper.fig12 import trace_requests
from pagedllm.benchmarks.paper.sweep import sweep_system

logger = logging.getLogger("pagedllm.bench.paper")
BATCHES, CONTEXTS = [8, 32], [64, 128, 256, 512, 1024]
BLOCK_SIZES = {"small": [1, 2, 4, 8, 16, 32], "paper": [1, 2, 4, 8, 16, 32, 64, 128, 256]}
FIXED_RATES = {("small", "sharegpt"): 64.0, ("small", "alpaca"): 512.0, ("paper", "sharegpt"): 2.0,
               ("paper", "alpaca"): 20.0}
Q_HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def kernel_point_cpu(batch: int, ctx: int, block_size: int = 16) -> dict:
    """One decode layer: paged (scattered blocks) vs contiguous (same kernel, one block per sequence) vs SDPA."""
    import torch
    import torch.nn.functional as F

    from pagedllm.kernels import cpu_kernels

    k = cpu_kernels.load_cpu_kernels()
    if k is None:
        raise RuntimeError("fig18a needs the native CPU kernels (a C compiler; PAGEDLLM_CPU_KERNELS unset)")
    g = torch.Generator().manual_seed(batch * 7919 + ctx)
    lens = [ctx] * batch
    width = -(-ctx // block_size)
    pool = 4 * batch * width
    kc = torch.randn(pool, block_size, KV_HEADS, HEAD_DIM, generator=g)
    vc = torch.randn(pool, block_size, KV_HEADS, HEAD_DIM, generator=g)
    tables = torch.randperm(pool, generator=g)[: batch * width].view(batch, width).to(torch.int32)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    scale = HEAD_DIM ** -0.5
    # the same K/V, laid out contiguously per sequence
    kd = kc[tables.long()].reshape(batch, width * block_size, KV_HEADS, HEAD_DIM)[:, :ctx].contiguous()
    vd = vc[tables.long()].reshape(batch, width * block_size, KV_HEADS, HEAD_DIM)[:, :ctx].contiguous()
    one = torch.arange(batch, dtype=torch.int32).view(batch, 1)
    out_p, out_c = torch.empty_like(q), torch.empty_like(q)
    rep = Q_HEADS // KV_HEADS
    kt = kd.permute(0, 2, 1, 3).repeat_interleave(rep, 1)
    vt = vd.permute(0, 2, 1, 3).repeat_interleave(rep, 1)

    def sdpa():
        return F.scaled_dot_product_attention(q.unsqueeze(2), kt, vt, scale=scale).squeeze(2)

    t_paged = median_ms(lambda: k.paged_attention(out_p, q, kc, vc, tables, seq_lens, qsl, scale), 20)
    t_contig = median_ms(lambda: k.paged_attention(out_c, q, kd, vd, one, seq_lens, qsl, scale), 20)
    t_sdpa = median_ms(sdpa, 20)
    torch.testing.assert_close(out_p, out_c, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out_p, sdpa(), atol=1e-4, rtol=1e-3)
    return {"batch": batch, "context": ctx, "block_size": block_size, "paged_ms": t_paged,
            "contiguous_ms": t_contig, "sdpa_contiguous_ms": t_sdpa, "paged_over_contiguous": t_paged / t_contig}


def kernel_points(args) -> list[dict]:
    if (args.device or common.SCALES[args.scale].device) == "cpu":
        return [kernel_point_cpu(b, c) for b in BATCHES for c in CONTEXTS]
    import torch

    from pagedllm.benchmarks import kernels

    kargs = SimpleNamespace(num_heads=40, num_kv_heads=40, head_dim=128, block_size=16)  # OPT-13B's attention
    rows = [kernels.bench_point(b, c, kargs, torch.float16, False) for b in BATCHES for c in CONTEXTS]
    for r in rows:  # the Triton paged kernel vs the best contiguous SDPA backend (benchmarks/decode_attention.py)
        r.update(contiguous_ms=r["best_contig_ms"], paged_over_contiguous=r["ratio"])
    return rows


def run(args) -> dict:
    data: dict = {"scale": args.scale, "kernel": kernel_points(args), "block_size": {}}
    scale = common.SCALES[args.scale]
    slots = (args.num_blocks or scale.num_blocks or 0) * scale.block_size
    traces = args.traces or ["sharegpt", "alpaca"]
    for trace in traces:
        data["block_size"][trace] = {"rate": (args.rates or [FIXED_RATES[(args.scale, trace)]])[0], "block_sizes": [],
                                     "normalized_latency": [], "mean_batched_requests": [], "num_preemptions": []}
    with common.EngineCache(args) as engines:  # one engine per block size, both traces on it
        for bs in args.block_sizes or BLOCK_SIZES[args.scale]:
            engine = engines.get("paged", block_size=bs, num_blocks=max(1, slots // bs) if slots else None)
            for trace in traces:
                pts = data["block_size"][trace]
                reqs = trace_requests(args, engine, trace)
                r = sweep_system(engine, reqs, [pts["rate"]], seed=args.seed, max_point_seconds=args.max_point_seconds,
                                 label=f"fig18b {trace} block {bs}")
                pts["block_sizes"].append(bs)
                for k in ("normalized_latency", "mean_batched_requests", "num_preemptions"):
                    pts[k].append(r[k][0])
                pts["num_requests"] = len(reqs)
            common.write_json(os.path.join(args.output_dir, "fig18.json"), data)
        data["engine_builds"] = engines.num_builds
    common.write_json(os.path.join(args.output_dir, "fig18.json"), data)
    write_outputs(args.output_dir, data)
    return data


def write_outputs(out_dir: str, data: dict) -> None:
    plt = common.pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.6))
    kp = data["kernel"]
    for b, ls in zip(sorted({p["batch"] for p in kp}), ("-", "--")):
        pts = [p for p in kp if p["batch"] == b]
        ctx = [p["context"] for p in pts]
        for key, color, lab in (("paged_ms", "tab:red", "paged"), ("contiguous_ms", "tab:blue", "contiguous"),
                                ("sdpa_contiguous_ms", "tab:gray", "SDPA, contiguous")):
            if all(key in p for p in pts):
                ax.plot(ctx, [p[key] for p in pts], ls, marker="o", color=color, label=f"{lab}, batch {b}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length")
    ax.set_ylabel("latency (ms)")
    ax.set_title("(a) decode attention, one layer", fontsize=9)
    ax.legend(fontsize=6)
    ax.grid(alpha=0.3)
    for trace, d in data["block_size"].items():
        bx.plot(d["block_sizes"], [common.finite(y) for y in d["normalized_latency"]], marker="o",
                label=f"{trace}-like @ {d['rate']:g} req/s")
    bx.set_xscale("log", base=2)
    bx.set_xlabel("block size (tokens)")
    bx.set_ylabel("normalized latency (s/token)")
    bx.set_title(f"(b) block size ({data['scale']} scale)", fontsize=9)
    bx.legend(fontsize=7)
    bx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "fig18.png"), dpi=120)
    plt.close(fig)
    krows = [[p["batch"], p["context"], common.fmt(p.get("paged_ms")), common.fmt(p.get("contiguous_ms")),
              common.fmt(p.get("sdpa_contiguous_ms")), common.fmt(p.get("paged_over_contiguous"))] for p in kp]
    lines = [f"# fig18\n\n(a) Decode attention, one layer ({data['scale']} scale), median ms.\n\n",
             common.md_table(["batch", "context", "paged", "contiguous (same kernel)", "SDPA contiguous",
                              "paged ÷ contiguous"], krows),
             "\nPaper: the paged kernel 20-26 % slower than FasterTransformer's.\n\n(b) Block size, paged.\n\n"]
    for trace, d in data["block_size"].items():
        lines.append(f"\n**{trace}-like** at {d['rate']:g} req/s, {d.get('num_requests')} requests\n\n")
        lines.append(common.md_table(["block size", "normalized latency (s/token)", "mean batched", "preemptions"],
                                     [[b, common.fmt(y), f"{m:.1f}", p] for b, y, m, p in zip(
                                         d["block_sizes"], d["normalized_latency"], d["mean_batched_requests"],
                                         d["num_preemptions"])]))
    lines.append("\nPaper: block 16-128 best on ShareGPT, 8-32 on Alpaca (too small: kernel inefficiency; "
                 "too large: internal fragmentation).\n")
    text = "".join(lines)
    with open(os.path.join(out_dir, "fig18.md"), "w") as f:
        f.write(text)
    print(text, flush=True)


