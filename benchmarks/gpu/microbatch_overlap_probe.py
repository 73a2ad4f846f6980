"""Does splitting a large decode step into micro-batches on separate CUDA streams overlap its memory-bound
kernels (paged attention, norms, SiLU) with the other micro-batch's GEMMs? (issue 16, short workload)

A decode step of B sequences at context C through L Llama-shaped layers (distinct weights per layer, so they
stream from memory; a real paged KV pool), captured as one CUDA graph:
  - ``1 stream``: the whole batch, layer after layer (what the engine's decode graphs do);
  - ``N streams``: the batch split into N row ranges, each range through all layers on its own stream, joined at
    the end (independent sequences: no dependency between the ranges).
Prints each graph's replay time (median of warm replays) and the per-kernel-class time of the 1-stream step.

    python benchmarks/gpu/microbatch_overlap_probe.py --batch 1024 --context 70 --splits 1 2 4

``--blas cublaslt --carveouts -1 16 32`` also runs each split with cuBLASLt's GEMMs told to leave that many SMs
free, so that another stream's attention can run beside them (the partitioned GEMMs NanoFlow relies on).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from pagedllm.kernels.triton_attention import DecodeWorkspace, paged_decode_attention
from pagedllm.kernels.triton_fused_ops import fused_add_rms_norm, rms_norm, silu_and_mul

SHAPES = {  # hidden, heads, kv heads, head dim, intermediate, layers
    "l8b": (4096, 32, 8, 128, 14336, 32),
    "l7b": (4096, 32, 32, 128, 11008, 32),
}


class Layer:
    def __init__(self, hidden: int, hq: int, hk: int, d: int, inter: int, dev: torch.device) -> None:
        dt = torch.bfloat16
        s = hidden ** -0.5
        self.qkv = torch.randn((hq + 2 * hk) * d, hidden, device=dev, dtype=dt) * s
        self.o = torch.randn(hidden, hq * d, device=dev, dtype=dt) * s
        self.gate_up = torch.randn(2 * inter, hidden, device=dev, dtype=dt) * s
        self.down = torch.randn(hidden, inter, device=dev, dtype=dt) * inter ** -0.5
        self.n1 = torch.ones(hidden, device=dev, dtype=dt)
        self.n2 = torch.ones(hidden, device=dev, dtype=dt)


def layer_forward(layer: Layer, x: torch.Tensor, res: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                  tables: torch.Tensor, lens: torch.Tensor, ws: DecodeWorkspace, hq: int, hk: int, d: int,
                  max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    h, res = fused_add_rms_norm(x, res, layer.n1, 1e-5)
    qkv = h @ layer.qkv.t()
    q = qkv[:, : hq * d].view(-1, hq, d)
    attn = paged_decode_attention(q, kv[0], kv[1], tables, lens, d ** -0.5, max_len, workspace=ws)
    o = attn.view(-1, hq * d) @ layer.o.t()
    h, res = fused_add_rms_norm(o, res, layer.n2, 1e-5)
    return silu_and_mul(h @ layer.gate_up.t()) @ layer.down.t(), res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="l8b", choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--context", type=int, default=70)
    ap.add_argument("--layers", type=int, default=0, help="0: the shape's")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--carveouts", type=int, nargs="+", default=[-1],
                    help="SMs the GEMMs leave free (torch._C._set_sm_carveout_experimental; cuBLASLt only); -1: unset")
    ap.add_argument("--blas", default="default", choices=("default", "cublaslt"),
                    help="torch.backends.cuda.preferred_blas_library (the carve-out applies to cuBLASLt)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.blas != "default":
        torch.backends.cuda.preferred_blas_library(args.blas)
    hidden, hq, hk, d, inter, n_layers = SHAPES[args.shape]
    n_layers = args.layers or n_layers
    block = 16
    b, ctx = args.batch, args.context
    per_seq = -(-ctx // block)
    layers = [Layer(hidden, hq, hk, d, inter, dev) for _ in range(n_layers)]
    pools = [(torch.randn(b * per_seq, block, hk, d, device=dev, dtype=torch.bfloat16),
              torch.randn(b * per_seq, block, hk, d, device=dev, dtype=torch.bfloat16)) for _ in range(n_layers)]
    perm = torch.randperm(b * per_seq, device=dev, dtype=torch.int32)  # scattered blocks, as in a used pool
    tables = perm.view(b, per_seq).contiguous()
    lens = torch.full((b,), ctx, device=dev, dtype=torch.int32)
    x0 = torch.randn(b, hidden, device=dev, dtype=torch.bfloat16)
    max_len = per_seq * block
    results = {}
    profile_1 = None
    for carveout, n in [(c, n) for c in args.carveouts for n in args.splits]:
        torch._C._set_sm_carveout_experimental(None if carveout < 0 else carveout)
        bounds = [b * i // n for i in range(n + 1)]
        ranges = [(bounds[i], bounds[i + 1]) for i in range(n)]
        streams = [torch.cuda.Stream() for _ in range(n)]
        workspaces = [DecodeWorkspace.allocate(dev) for _ in range(n)]
        outs: list = [None] * n

        def step() -> None:
            main_stream = torch.cuda.current_stream()
            for i, (lo, hi) in enumerate(ranges):
                streams[i].wait_stream(main_stream)
                with torch.cuda.stream(streams[i]):
                    x, res = x0[lo:hi], torch.zeros_like(x0[lo:hi])
                    for li, layer in enumerate(layers):
                        x, res = layer_forward(layer, x, res, pools[li], tables[lo:hi], lens[lo:hi],
                                               workspaces[i], hq, hk, d, max_len)
                    outs[i] = rms_norm(x, layers[0].n1, 1e-5)
            for s in streams:
                main_stream.wait_stream(s)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        results[(carveout, n)] = statistics.median(times)
        print(f"{args.shape} batch {b} context {ctx} layers {n_layers}, carve-out {carveout}: {n} stream(s): "
              f"{results[(carveout, n)]:.3f} ms (min {min(times):.3f}, max {max(times):.3f})", flush=True)
        if n == 1 and profile_1 is None:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                graph.replay()
                torch.cuda.synchronize()
            kinds: dict[str, float] = {}
            for ev in prof.key_averages():
                name = ev.key
                kind = ("gemm" if any(k in name.lower() for k in ("gemm", "sm90", "cutlass", "nvjet", "xmma"))
                        else "attention" if "decode" in name else "other")
                kinds[kind] = kinds.get(kind, 0.0) + ev.device_time_total / 1000
            profile_1 = {k: round(v, 3) for k, v in kinds.items()}
            print("  1-stream kernel time by kind (ms):", profile_1, flush=True)
        del graph
        torch.cuda.synchronize()
    base = results.get((args.carveouts[0], 1))
    for (carveout, n), ms in results.items():
        if base:
            print(f"  carve-out {carveout}, {n} stream(s) ÷ carve-out {args.carveouts[0]}, 1 stream: {ms / base:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "ms": {f"carveout{c}_streams{n}": v for (c, n), v in results.items()},
                       "one_stream_kernels_ms": profile_1}, f, indent=1)


if __name__ == "__main__":
    main()
