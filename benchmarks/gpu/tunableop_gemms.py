"""Issue 16 probe: do PyTorch's TunableOp picks beat cuBLAS's heuristic on the Llama-3-8B decode GEMMs at large
batch? Times the five weight GEMMs (F.linear, bf16) at each M with the default heuristic, then with TunableOp
tuning on (reporting how long tuning took), then with the tuned picks; L2 is not flushed (weights of these shapes
exceed it except qkv/o at small M).

    python benchmarks/gpu/tunableop_gemms.py [M,M,...]   (default 992,1000,1024)
"""
import sys
import time

import torch
import torch.cuda.tunable as tunable

from pagedllm.benchmarks.lower_bound import measure_matmul_peak
from pagedllm.benchmarks.roofline import LLAMA3_8B


def shapes() -> dict[str, tuple[int, int]]:
    h, i, v = LLAMA3_8B["hidden_size"], LLAMA3_8B["intermediate_size"], LLAMA3_8B["vocab_size"]
    kv = LLAMA3_8B["num_key_value_heads"] * h // LLAMA3_8B["num_attention_heads"]
    return {"qkv": (h, h + 2 * kv), "o": (h, h), "gate_up": (h, 2 * i), "down": (i, h), "lm_head": (h, v)}


def time_us(a: torch.Tensor, w: torch.Tensor, reps: int = 50) -> float:
    for _ in range(3):
        torch.nn.functional.linear(a, w)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        torch.nn.functional.linear(a, w)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def main() -> None:
    ms = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "992,1000,1024").split(",")]
    peak = measure_matmul_peak()
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for name, (k, n) in shapes().items()}
    acts = {(m, k): torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in ms for k, _ in shapes().values()}

    def table(label: str) -> dict:
        out = {}
        for m in ms:
            row, layer_us = [], 0.0
            for name, (k, n) in shapes().items():
                us = time_us(acts[(m, k)], weights[name])
                out[(m, name)] = us
                layer_us += us if name != "lm_head" else 0.0
                row.append(f"{name} {us:.0f} µs ({2 * m * n * k / peak / us * 1e6:.0%})")
            print(f"{label} M={m}: " + ", ".join(row) + f"; 32 layers + head {(32 * layer_us + out[(m, 'lm_head')]) / 1e3:.2f} ms",
                  flush=True)
        return out

    print(f"bf16 matmul peak {peak / 1e12:.0f} TFLOP/s")
    table("heuristic")
    tunable.enable(True)
    tunable.tuning_enable(True)
    tunable.set_max_tuning_duration(30)
    tunable.set_filename("/tmp/tunableop_results.csv")
    t0 = time.perf_counter()
    for m in ms:
        for name, (k, n) in shapes().items():
            torch.nn.functional.linear(acts[(m, k)], weights[name])
    torch.cuda.synchronize()
    print(f"tuning {len(ms) * len(shapes())} shapes took {time.perf_counter() - t0:.1f} s", flush=True)
    tunable.tuning_enable(False)
    table("tuned")


if __name__ == "__main__":
    main()
