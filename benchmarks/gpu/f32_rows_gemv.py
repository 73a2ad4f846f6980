"""A GEMV-style Triton kernel for float32 rows (products and a tl.sum per weight tile, no tl.dot), tried as the
row-invariant float32 GEMM that §61.1 left untried: could it serve decodes and k = 12 verifications at cuBLAS's
speed, each row's bits independent of the row count? The bundled model's GEMMs (30 layers × 4 plus the LM head,
distinct weights) in one CUDA graph, by rows, against cuBLAS in the same run; every tile is first checked against
torch (closeness) and for row invariance (rows 0..12 of a 13-row call bit-equal to the same rows alone).

Two designs: ROWS_PER_PASS 1 (each row its own pass over the weight tile: the weights re-read from cache per
row) and 4 (four rows share each weight load; a [4, BLOCK_N, BLOCK_K] product reduced over K, rows past M
masked). In both a row's arithmetic is the same code whatever M is.

    python benchmarks/gpu/f32_rows_gemv.py
"""
import itertools

import torch
import triton
import triton.language as tl

from f32_skinny_gemm import gemms_ms  # this directory (the script's own)

ROWS = (1, 4, 13, 26, 52)


@triton.jit(do_not_specialize=["M"])
def _rows_gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                      ROWS_PER_PASS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, ROWS_PER_PASS)
    for m0 in range(0, M, ROWS_PER_PASS):
        rows = m0 + offs_r
        r_mask = rows < M
        acc = tl.zeros((ROWS_PER_PASS, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                        other=0.0)
            acc += tl.sum(w[None, :, :] * x[:, None, :], axis=2)
        tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], acc, mask=r_mask[:, None] & n_mask[None, :])


def rows_gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, rpp: int, bn: int, bk: int, warps: int) -> None:
    m, k = x.shape
    n = w.shape[0]
    _rows_gemv_kernel[(triton.cdiv(n, bn),)](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                                             ROWS_PER_PASS=rpp, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)


def check(cfg: tuple) -> str:
    """'' when the tile matches torch and gives each row the same bits at 13 rows as alone; else what failed."""
    w = torch.randn(960, 576, device="cuda") / 24
    x = torch.randn(13, 576, device="cuda")
    out = torch.empty(13, 960, device="cuda")
    rows_gemv(x, w, out, *cfg)
    if not torch.allclose(out, x @ w.T, atol=1e-4, rtol=1e-4):
        return "wrong result"
    for m in range(13):
        one = torch.empty(1, 960, device="cuda")
        rows_gemv(x[m : m + 1], w, one, *cfg)
        if not torch.equal(one[0], out[m]):
            return f"row {m} differs alone"
    return ""


def step_ms(rows: int, cfg: tuple | None) -> float:
    """One forward's GEMMs replayed from a CUDA graph: ms per replay. `cfg` None: F.linear (cuBLAS); else the tile."""
    return gemms_ms(rows, None if cfg is None else lambda x, w, out: rows_gemv(x, w, out, *cfg))


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    print("cublas               " + "  ".join(f"{r}: {step_ms(r, None):.3f}" for r in ROWS), flush=True)
    for rpp, bn, bk, warps in itertools.product((1, 4), (8, 16, 32, 64), (64, 128, 256), (1, 2, 4, 8)):
        cfg = (rpp, bn, bk, warps)
        try:
            bad = check(cfg)
            row = bad or "  ".join(f"{r}: {step_ms(r, cfg):.3f}" for r in ROWS)
        except Exception as exc:  # a tile Triton cannot build: say so, go on
            row = f"failed: {type(exc).__name__}"
        print(f"r{rpp} n{bn:<3} k{bk:<3} w{warps}  {row}", flush=True)


if __name__ == "__main__":
    main()
