"""The batch-invariant GEMM (kernels/triton_invariant_matmul.py): each row's bits are those of the row alone, at
any row count and tile remainder, and the result is F.linear's to rounding. Compiled on CUDA (float32, bfloat16,
float16); under Triton's interpreter on the CPU (float32, float16: the interpreter's tl.dot mishandles bf16)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_setup import (DEVICE, ON_CUDA, interpreter_numpy_shim,  # sets TRITON_INTERPRET without CUDA
                          row_invariant_interpreter_dot)

triton = pytest.importorskip("triton")
interpreter_numpy_shim()

from pagedllm.kernels.triton_invariant_matmul import (BLOCK_M, TILES_16BIT, WIDE_TILE,  # noqa: E402
                                                      invariant_linear, tile_config, warm_up_invariant_linears,
                                                      warm_up_row_counts)

DTYPES = [torch.float32, torch.bfloat16, torch.float16] if ON_CUDA else [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_rows_have_their_lone_bits_and_match_f_linear(dtype, bias, monkeypatch):
    row_invariant_interpreter_dot(monkeypatch)
    g = torch.Generator().manual_seed(0)
    n, k = 80, 200 if ON_CUDA else 96  # neither a multiple of the tile width or depth
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    # On CUDA the 16-bit launches below take every tile class of TILES_16BIT (by their row counts).
    rows = 300 if ON_CUDA else BLOCK_M + 3
    x = torch.randn(rows, k, generator=g).to(DEVICE, dtype)
    y = invariant_linear(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert ((y.float() - ref).norm() / ref.norm()).item() < TOL[dtype]
    counts = (1, 2, 16, 17, 32, 33, 64, 65, 256, 257, rows) if ON_CUDA else (1, 2, 17, BLOCK_M, rows)
    for m in counts:  # the first m rows, as their own launches
        assert torch.equal(invariant_linear(x[:m], w, b), y[:m]), m
    for i in (0, BLOCK_M - 1, BLOCK_M, rows - 1):
        assert torch.equal(invariant_linear(x[i:i + 1], w, b)[0], y[i]), i
    if ON_CUDA and dtype != torch.float32:  # a layer wide enough for WIDE_TILE from 65 rows (every SM gets a tile)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        wide = (torch.randn(128 * sms, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
        assert tile_config(65, wide.shape[0], dtype, sms) == WIDE_TILE
        yw = invariant_linear(x, wide)
        for m in (1, 64, 65, 200, 256, rows):
            assert torch.equal(invariant_linear(x[:m], wide), yw[:m]), m


def test_tile_classes_cover_every_row_count():
    """Launches take the first class that holds their rows (a wide 16-bit layer the 128 × 128 tile from 65 rows;
    float32 16-row tiles up to 16 rows, else 64 × 64); the warm-up's row counts reach every tile."""
    sms = 132
    assert [tile_config(m, 4096, torch.bfloat16, sms)[:2] for m in (1, 16, 17, 32, 33, 64, 65, 256, 257, 10 ** 6)] == \
        [(16, 64), (16, 64), (32, 64), (32, 64), (64, 64), (64, 64), (128, 64), (128, 64), (128, 128), (128, 128)]
    assert tile_config(200, 28672, torch.bfloat16, sms) == WIDE_TILE  # 2 × 224 tiles of 128 × 128 ≥ 132 SMs
    assert tile_config(200, 4096, torch.float16, sms)[:2] == (128, 64)  # 2 × 32 < 132
    assert tile_config(200, 4096, torch.bfloat16, 16)[:2] == (128, 128)  # a GPU of 16 SMs
    assert [tile_config(m, 4096, torch.float32, sms)[:2] for m in (1, 16, 17, 10 ** 6)] == \
        [(16, 64), (16, 64), (BLOCK_M, 64), (BLOCK_M, 64)]
    counts = warm_up_row_counts(torch.bfloat16)
    assert len(counts) == len(TILES_16BIT)
    reached = {tile_config(m, n, torch.bfloat16, sms) for m in counts for n in (64, 10 ** 6)}
    assert reached == {cfg for _, cfg in TILES_16BIT} | {WIDE_TILE}
    assert warm_up_row_counts(torch.float32) == [16, 17]


def test_leading_dims_strides_and_errors():
    w = torch.randn(8, 16).to(DEVICE)
    x = torch.randn(2, 3, 32).to(DEVICE)[..., ::2]  # a strided last dim
    y = invariant_linear(x, w)
    assert y.shape == (2, 3, 8)
    assert torch.allclose(y, F.linear(x, w), atol=1e-5)
    assert invariant_linear(torch.empty(0, 16).to(DEVICE), w).shape == (0, 8)
    with pytest.raises(ValueError, match="one dtype"):
        invariant_linear(x.half(), w)
    with pytest.raises(ValueError, match=r"weight must be \[out, 16\]"):
        invariant_linear(torch.randn(4, 16).to(DEVICE), torch.randn(8, 15).to(DEVICE))


def test_warm_up_launches_each_layer_shape_once_per_tile_class():
    """The worker's warm-up: layers that share a shape (and bias-ness and dtype) compile once; every tile class of
    each is launched."""
    dt = torch.float16 if ON_CUDA else torch.float32
    w1, w2 = torch.randn(8, 16).to(DEVICE, dt), torch.randn(8, 16).to(DEVICE, dt)
    w3, b3 = torch.randn(4, 16).to(DEVICE, dt), torch.randn(4).to(DEVICE, dt)
    launches = warm_up_invariant_linears([(w1, None), (w2, None), (w3, b3), (w3, None)])
    assert launches == 3 * len(warm_up_row_counts(dt))
