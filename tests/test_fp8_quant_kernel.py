"""The fused per-token FP8 activation quantization kernel against its plain-torch oracle
(fp8_linear.quantize_activation); Triton's interpreter on CPU, compiled on CUDA."""
from __future__ import annotations

import pytest
import torch

from triton_setup import DEVICE, ON_CUDA, interpreter_numpy_shim  # sets TRITON_INTERPRET without CUDA
from pagedllm.kernels import fp8_linear
from pagedllm.kernels.triton_fp8_quant import quantize_activation_rows

interpreter_numpy_shim()


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Rows of very different magnitude, one all-zero row, one with a large outlier.
    x = torch.randn(m, k, generator=g) * torch.logspace(-4, 3, m)[:, None]
    x[0] = 0.0
    if m > 2:
        x[2, k // 3] = 5e4
    return x.to(DEVICE, dtype)


@pytest.mark.parametrize("m,k", [(1, 64), (7, 576), (33, 1536), (3, 5000)])  # 5000: two loop iterations
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_quant_matches_torch(m, k, dtype):
    x = _rows(m, k, dtype, seed=m * k)
    q, s = quantize_activation_rows(x)
    q_ref, s_ref = fp8_linear.quantize_activation(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k)
    assert s.dtype == torch.float32 and s.shape == (m, 1)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    a, b = q.float(), q_ref.float()
    bad = a != b
    if ON_CUDA:
        # The GPU's cvt rounds to nearest even like torch; only x / scale on a rounding boundary (division
        # rounding) may land one e4m3 step (2^-3 relative) away.
        assert bad.float().mean().item() < 1e-3
        assert ((a - b).abs() <= b.abs() * 2.0**-3 + 2.0**-9).all()
    else:
        # Triton's interpreter rounds ties away from zero and drops the carry into the next binade
        # (127.7 → 64 instead of 128, see test_fp8_kv_cache.py): a few elements, same sign, within half.
        assert bad.float().mean().item() < 0.03
        g, w = a[bad], b[bad]
        assert torch.all(g * w >= 0) and torch.all((g - w).abs() <= w.abs() / 2 + 2.0**-9)
    assert a.abs().max().item() <= 448.0
    assert torch.equal(a[0], torch.zeros(k, device=a.device))  # the zero row stays zero (no NaN)
    # Round trip (elements the conversion got right): within e4m3's half step of x in its normal range.
    xf = x.float()
    ok = ~bad & (xf.abs() >= s * 2.0**-6)
    assert ((a * s - xf).abs() <= xf.abs() * 2.0**-4 + 1e-30)[ok].all()
    assert (a.abs().amax(dim=1)[1:] >= 416.0).all()  # every non-zero row uses the top of the range

def test_fused_quant_strided_rows_and_empty():
    x = _rows(5, 256, torch.bfloat16, seed=3)
    wide = torch.zeros(5, 320, dtype=torch.bfloat16, device=DEVICE)
    wide[:, 32:288] = x
    view = wide[:, 32:288]  # row stride 320, unit stride along K
    q, s = quantize_activation_rows(view)
    q_ref, s_ref = quantize_activation_rows(x)
    assert torch.equal(q.float(), q_ref.float()) and torch.equal(s, s_ref)
    q0, s0 = quantize_activation_rows(x[:0])
    assert q0.shape == (0, 256) and s0.shape == (0, 1)
    with pytest.raises(ValueError, match="2-D"):
        quantize_activation_rows(x[0])
