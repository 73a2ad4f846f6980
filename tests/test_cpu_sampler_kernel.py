"""The native CPU sampling kernel (cpu_ops.c: sample_rows_f32) against the torch reference, and the sampler's
use of it: greedy rows are the argmax, random rows follow the inverse CDF of the tempered softmax, logprobs
are the raw distribution's."""
from __future__ import annotations

import random

import pytest
import torch

from pagedllm.kernels import cpu_kernels
from pagedllm.model.layers.inverse_cdf import inverse_cdf_sample
from pagedllm.model.layers.sampler import Sampler, SamplingRow
from pagedllm.sampling_params import SamplingParams
from tests.test_cpu_isa import ALL_ISAS

native = cpu_kernels.load_cpu_kernels()
pytestmark = pytest.mark.skipif(native is None, reason="no C compiler: the native CPU kernels are unavailable")


@pytest.fixture(params=ALL_ISAS)
def kernels(request: pytest.FixtureRequest) -> cpu_kernels.CpuKernels:
    """The kernels built for each ISA level this CPU runs (AVX-512, AVX2+FMA, portable)."""
    return cpu_kernels.load_cpu_kernels(request.param)


def test_greedy_rows_are_the_first_argmax_with_raw_logprobs(kernels: cpu_kernels.CpuKernels) -> None:
    x = torch.randn(50, 1003, generator=torch.Generator().manual_seed(0)) * 3
    x[7, [10, 500]] = 50.0  # a tie: the first index wins, as torch.argmax
    tokens, lp = kernels.sample_rows(x, torch.ones(50), torch.full((50,), -1.0, dtype=torch.float64))
    assert tokens.tolist() == x.argmax(-1).tolist() and tokens[7] == 10
    ref = x.log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lp, ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_random_rows_match_the_inverse_cdf_reference(kernels: cpu_kernels.CpuKernels, temperature: float) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2000, 1000, generator=g) * 2
    x[:, 100:300] = float("-inf")  # masked tokens
    u = torch.rand(2000, generator=g, dtype=torch.float64)
    tokens, lp = kernels.sample_rows(x, torch.full((2000,), 1 / temperature), u)
    ref = inverse_cdf_sample((x / temperature).softmax(-1), u)
    assert (tokens == ref).float().mean() >= 0.999  # only a u within rounding of a boundary may differ
    assert not ((tokens >= 100) & (tokens < 300)).any()
    torch.testing.assert_close(lp, x.log_softmax(-1).gather(1, tokens[:, None])[:, 0], rtol=0, atol=2e-5)


def test_mostly_masked_rows_with_far_tails(kernels: cpu_kernels.CpuKernels) -> None:
    """A grammar's bitmask leaves ~2 % of the vocabulary: every other logit is -inf, and the allowed ones spread
    far below the row's max (at temperature 0.5 down to -400 after scaling: the lanes that the kernel flushes to
    0 before libmvec's expf, whose vector code goes scalar for them). Draws and logprobs still follow the torch
    reference, and no masked token is drawn."""
    g = torch.Generator().manual_seed(2)
    x = torch.rand(512, 4096, generator=g) * -200.0
    x[torch.rand(512, 4096, generator=g) > 0.02] = float("-inf")
    x[:, 7] = 0.0  # every row keeps a token
    for temperature in (1.0, 0.5):
        u = torch.rand(512, generator=g, dtype=torch.float64)
        u[::8] = -1.0  # greedy rows too
        tokens, lp = kernels.sample_rows(x, torch.full((512,), 1 / temperature), u)
        greedy = u < 0
        ref = inverse_cdf_sample((x / temperature).softmax(-1), u.clamp(min=0))
        assert tokens[greedy].tolist() == x[greedy].argmax(-1).tolist()
        assert (tokens[~greedy] == ref[~greedy]).float().mean() >= 0.999
        assert torch.isfinite(x.gather(1, tokens[:, None])).all()
        torch.testing.assert_close(lp, x.log_softmax(-1).gather(1, tokens[:, None])[:, 0], rtol=0, atol=2e-5)


def test_edges_of_the_distribution(kernels: cpu_kernels.CpuKernels) -> None:
    vocab = 700
    x = torch.full((4, vocab), float("-inf"))
    x[:, [3, 256, 699]] = torch.tensor([0.0, 1.0, -2.0])
    u = torch.tensor([0.0, 1.0 - 2**-53, 0.5, 1e-300], dtype=torch.float64)
    tokens, _ = kernels.sample_rows(x, torch.ones(4), u)
    assert tokens.tolist()[:2] == [3, 699] and set(tokens.tolist()) <= {3, 256, 699}


def test_bad_arguments_are_refused() -> None:
    x = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="u must be"):
        native.sample_rows(x, torch.ones(2), torch.zeros(2))  # float32 u
    with pytest.raises(ValueError, match="logits must be"):
        native.sample_rows(x.double(), torch.ones(2), torch.zeros(2, dtype=torch.float64))


def test_sampler_rows_take_the_kernel_and_keep_the_softmax() -> None:
    """Many one-sample rows of one small distribution (one native call): frequencies match the tempered
    softmax; the same rows through the torch path (PAGEDLLM_CPU_KERNELS=torch) match it too."""
    vocab, n = 12, 30_000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(4)).expand(n, vocab).contiguous() * 1.5
    params = SamplingParams(temperature=0.8)
    rows = [SamplingRow(params, [], [], random.Random(i)) for i in range(n)]
    target = (logits[0] / 0.8).softmax(-1).double()
    tokens = [r.token_ids[0] for r in Sampler()(logits, rows)[0]]
    freq = torch.bincount(torch.tensor(tokens), minlength=vocab).double() / n
    assert 0.5 * (freq - target).abs().sum() < 0.02
    # Seeded rows repeat: the same generators give the same tokens.
    again = [r.token_ids[0] for r in Sampler()(logits, [SamplingRow(params, [], [], random.Random(i))
                                                        for i in range(n)])[0]]
    assert again == tokens


def test_greedy_sampler_is_the_same_with_and_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(16, 4000, generator=torch.Generator().manual_seed(5)) * 2
    rows = [SamplingRow(SamplingParams(temperature=0.0), [], []) for _ in range(16)]
    with_kernel = Sampler()(x, rows)[0]
    monkeypatch.setenv(cpu_kernels.KERNELS_ENV, "torch")
    cpu_kernels.load_cpu_kernels.cache_clear()
    try:
        without = Sampler()(x, rows)[0]
    finally:
        monkeypatch.delenv(cpu_kernels.KERNELS_ENV)
        cpu_kernels.load_cpu_kernels.cache_clear()
    assert [r.token_ids for r in with_kernel] == [r.token_ids for r in without]
    torch.testing.assert_close(torch.tensor([r.logprobs[0] for r in with_kernel]),
                               torch.tensor([r.logprobs[0] for r in without]), rtol=0, atol=2e-5)
