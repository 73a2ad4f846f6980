"""The native CPU top-k / top-p filter (cpu_ops.c: top_k_top_p_f32, bucketed selection without a sort of the
vocabulary) against the torch sort it replaces on a CPU (logits_ops.top_k_top_p_by_sort), on every ISA build."""
from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import cpu_kernels
from pagedllm.model.layers.logits_ops import apply_top_k_top_p, top_k_top_p_by_sort
from tests.test_cpu_isa import ALL_ISAS

native = cpu_kernels.load_cpu_kernels()
pytestmark = pytest.mark.skipif(native is None, reason="no C compiler: the native CPU kernels are unavailable")
ROWS, VOCAB = 16, 6000


def _logits(kind: str, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(ROWS, VOCAB, generator=g)
    if kind == "flat":  # a nucleus of thousands: the selection bucket holds many tokens
        return x * 1.5
    if kind == "peaky":
        return x * 6
    if kind == "masked":  # a grammar's bitmask: 98 % -inf
        x = (x * 4).masked_fill(torch.rand(ROWS, VOCAB, generator=g) > 0.02, float("-inf"))
        return x.index_fill_(1, torch.tensor([5]), 1.0)
    if kind == "ties":  # few distinct values: ties at the k-th value and at the nucleus' edge
        return torch.randint(0, 6, (ROWS, VOCAB), generator=g).float()
    return x * 40  # "wide": weights far below 2^-64 of the top (the last bucket)


@pytest.fixture(params=ALL_ISAS)
def kernels(request: pytest.FixtureRequest) -> cpu_kernels.CpuKernels:
    return cpu_kernels.load_cpu_kernels(request.param)


@pytest.mark.parametrize("kind", ["flat", "peaky", "masked", "ties", "wide"])
def test_same_tokens_kept_as_the_sort(kernels: cpu_kernels.CpuKernels, kind: str) -> None:
    g = torch.Generator().manual_seed(hash(kind) % 1000)
    x = _logits(kind, g)
    cases = [([0] * ROWS, [p] * ROWS) for p in (1e-6, 0.3, 0.9, 0.99)]
    cases += [([k] * ROWS, [1.0] * ROWS) for k in (1, 7, 300)]
    cases += [([k] * ROWS, [p] * ROWS) for k, p in ((5, 0.5), (300, 0.95), (VOCAB, 0.8))]
    cases.append(([0, 3, 50, 0] * (ROWS // 4), [1.0, 0.9, 1.0, 0.3] * (ROWS // 4)))  # rows of every kind in a batch
    # Tokens whose float32 probability is 0 are never drawn: the sort drops them even at top_p 1 (their cumulative
    # mass is 0), the kernel leaves them; only the others are compared.
    alive = x.softmax(-1) > 0
    for ks, ps in cases:
        want = top_k_top_p_by_sort(x, ks if any(ks) else None, ps if min(ps) < 1.0 else None)
        want = want.masked_fill(~alive, float("-inf"))
        got = kernels.top_k_top_p(x, ks, ps)
        kept = torch.isfinite(got)
        assert torch.equal(got[kept], x[kept]) and kept.any(-1).all()
        got = got.masked_fill(~alive, float("-inf"))
        if kind == "ties":  # the sort keeps an arbitrary part of a tie at the edge; the kernel keeps all of it
            edge = got.masked_fill(~torch.isfinite(want), float("inf")).amin(-1, keepdim=True)
            assert (torch.isfinite(got) >= torch.isfinite(want)).all(), (ks[0], ps[0])
            assert (~torch.isfinite(got) | torch.isfinite(want) | (x == edge)).all(), (ks[0], ps[0])
        else:
            assert torch.equal(torch.isfinite(got), torch.isfinite(want)), (ks[0], ps[0])


def test_apply_top_k_top_p_takes_the_kernel_on_cpu_and_bad_arguments_are_refused() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 500, generator=g) * 3
    got = apply_top_k_top_p(x, [0, 10, 0, 0], [0.9, 1.0, 0.5, 1.0])
    assert torch.equal(got, native.top_k_top_p(x, [0, 10, 0, 0], [0.9, 1.0, 0.5, 1.0]))
    assert torch.equal(got[3], x[3])  # a row with neither filter is left as it is
    with pytest.raises(ValueError, match="one value per row"):
        native.top_k_top_p(x, [0], [0.9] * 4)
    with pytest.raises(ValueError, match="top_p values must be > 0"):
        native.top_k_top_p(x, [0] * 4, [0.0] * 4)
