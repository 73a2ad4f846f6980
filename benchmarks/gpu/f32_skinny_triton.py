"""Could the row-invariant Triton GEMM (kernels/triton_invariant_matmul.py) serve float32 decodes and k=12
verifications faster than cuBLAS (BENCHMARKS.md §52.7: cuBLAS's SIMT SGEMMs make a 13-row step's GEMMs 2.5x a
1-row step's)? The bundled model's GEMM shapes for all 30 layers plus the LM head (distinct weights, streamed from
memory), one forward captured in a CUDA graph, timed by rows for cuBLAS and for the Triton kernel at a sweep of
tiles (BLOCK_N, BLOCK_K, warps, stages; BLOCK_M 16). Tiles with another BLOCK_K sum in another order: they are
candidates for a float32 BLOCK_K, not interchangeable with today's 32.

    python benchmarks/gpu/f32_skinny_triton.py
"""
import itertools

import torch
import triton

from f32_skinny_gemm import gemms_ms  # this directory (the script's own)
from pagedllm.kernels.triton_invariant_matmul import _invariant_matmul_kernel

ROWS = (1, 4, 13, 26, 52)


def triton_linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bn: int, bk: int, warps: int, stages: int):
    m, k = x.shape
    n = w.shape[0]
    grid = (triton.cdiv(m, 16), triton.cdiv(n, bn))
    _invariant_matmul_kernel[grid](x, w, out, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                                   HAS_BIAS=False, PREC="ieee", BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk,
                                   num_warps=warps, num_stages=stages)


def step_ms(rows: int, cfg: tuple | None) -> float:
    """One forward's GEMMs replayed from a CUDA graph: ms per replay. `cfg` None: F.linear (cuBLAS); else the tile."""
    return gemms_ms(rows, None if cfg is None else lambda x, w, out: triton_linear(x, w, out, *cfg))


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    print("cublas          " + "  ".join(f"{r}: {step_ms(r, None):.3f}" for r in ROWS), flush=True)
    for bn, bk, warps, stages in itertools.product((16, 32, 64), (32, 64, 128), (1, 2, 4), (2, 4)):
        try:
            row = "  ".join(f"{r}: {step_ms(r, (bn, bk, warps, stages)):.3f}" for r in ROWS)
        except Exception as exc:  # a tile Triton cannot build (shared memory): say so, go on
            row = f"failed: {type(exc).__name__}"
        print(f"n{bn:<3} k{bk:<3} w{warps} s{stages}  {row}", flush=True)


if __name__ == "__main__":
    main()
