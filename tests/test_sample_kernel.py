"""One-launch sampling on a GPU (kernels/triton_sample.py, compiled on CUDA, interpreted on CPU) against the
plain-torch references: greedy rows are the first argmax, random rows the inverse CDF of the tempered softmax
(model/layers/inverse_cdf.py), logprobs the raw distribution's."""
from __future__ import annotations

import pytest
import torch

# First: without CUDA it sets TRITON_INTERPRET, which the kernel module's @triton.jit reads at import.
from tests.triton_setup import DEVICE, ON_CUDA, interpreter_numpy_shim

# isort: split
from pagedllm.kernels.reference import apply_token_bitmask
from pagedllm.kernels.reference import greedy_sample_with_logprob as greedy_reference
from pagedllm.kernels.triton_sample import sample_with_logprob
from pagedllm.model.layers.inverse_cdf import inverse_cdf_sample

interpreter_numpy_shim()


def _params(u: torch.Tensor, inv_temp: torch.Tensor) -> torch.Tensor:
    return torch.stack([u.double(), inv_temp.double()], dim=1).contiguous().to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [7, 2048, 5000])
def test_greedy_rows_match_the_reference(dtype: torch.dtype, vocab: int) -> None:
    logits = (torch.randn(4, vocab, generator=torch.Generator().manual_seed(vocab)) * 4).to(dtype)
    logits[1] = float("-inf")
    logits[1, vocab // 2] = 3.0
    logits[2, :] = 1.5  # all tied: the first token
    tok, lp = sample_with_logprob(logits.to(DEVICE), _params(torch.full((4,), -1.0), torch.ones(4)))
    want_tok, want_lp = greedy_reference(logits)
    assert tok.cpu().tolist() == want_tok.tolist()
    torch.testing.assert_close(lp.cpu(), want_lp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_random_rows_match_the_inverse_cdf_reference(temperature: float) -> None:
    rows, vocab = (256, 5000) if ON_CUDA else (24, 5000)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=g) * 2
    logits[:, 1000:3000] = float("-inf")  # a masked span crossing the kernel's blocks
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    u[:3] = torch.tensor([0.0, 1.0 - 2**-53, 0.5], dtype=torch.float64)
    tok, lp = sample_with_logprob(logits.to(DEVICE), _params(u, torch.full((rows,), 1 / temperature)))
    tok = tok.cpu()
    ref = inverse_cdf_sample((logits / temperature).softmax(-1), u)
    assert (tok == ref).float().mean() >= 0.99  # only a u within rounding of a boundary may differ
    assert not ((tok >= 1000) & (tok < 3000)).any()
    torch.testing.assert_close(lp.cpu(), logits.log_softmax(-1).gather(1, tok[:, None])[:, 0], rtol=0, atol=2e-5)


def test_frequencies_follow_the_tempered_softmax() -> None:
    n, vocab = (20_000, 12) if ON_CUDA else (3_000, 12)
    logits = (torch.randn(1, vocab, generator=torch.Generator().manual_seed(9)) * 1.5).expand(n, vocab).contiguous()
    u = torch.rand(n, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    tok, _ = sample_with_logprob(logits.to(DEVICE), _params(u, torch.full((n,), 1 / 0.8)))
    freq = torch.bincount(tok.cpu(), minlength=vocab).double() / n
    target = (logits[0] / 0.8).softmax(-1).double()
    assert 0.5 * (freq - target).abs().sum() < (0.02 if ON_CUDA else 0.05)


def _random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Packed int32 rows (bit t % 32 of word t // 32), about a third of the tokens allowed, never none."""
    allowed = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(seed)) < 0.33
    allowed[:, seed % vocab] = True
    words = torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int64)
    for t in range(vocab):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bitmask_read_in_the_kernel_equals_masking_the_logits_first(dtype: torch.dtype) -> None:
    """Flagged rows (a negative 1 / temperature) sample, greedy and random, and score as if the logits had been
    masked in place; rows not flagged ignore their bitmask row."""
    rows, vocab = 12, 5000  # two of the kernel's blocks, the last one partial
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    bitmask = _random_bitmask(rows + 2, vocab, 7)  # more mask rows than logits rows, as the manager's buffer
    flagged = [0, 1, 2, 5, 6, 7, 9]
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    u[[0, 3, 5]] = -1.0  # greedy rows, flagged and not
    inv_temp = torch.full((rows,), 1 / 0.7, dtype=torch.float64)
    signed = inv_temp.clone()
    signed[flagged] *= -1  # a negative 1 / temperature flags a masked row
    mask_dev = bitmask.pin_memory() if ON_CUDA else bitmask
    tok, lp = sample_with_logprob(logits.to(DEVICE), _params(u, signed), mask_dev)
    masked = apply_token_bitmask(logits.float(), bitmask[:rows], flagged)
    want_tok, want_lp = sample_with_logprob(masked.to(DEVICE), _params(u, inv_temp))
    assert tok.cpu().tolist() == want_tok.cpu().tolist()
    torch.testing.assert_close(lp.cpu(), want_lp.cpu(), rtol=0, atol=1e-5)
    allowed = ((bitmask[:rows, tok.cpu() // 32].diagonal() >> (tok.cpu() % 32)) & 1) == 1
    assert allowed[flagged].all()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="contiguous along the vocabulary"):
        sample_with_logprob(torch.zeros(8, 4, device=DEVICE).t(), torch.zeros(4, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="params must be"):
        sample_with_logprob(torch.zeros(2, 4, device=DEVICE), torch.zeros(2, 2, device=DEVICE))
    with pytest.raises(ValueError, match="bitmask must be"):  # too few words for the vocabulary
        sample_with_logprob(torch.zeros(2, 64, device=DEVICE), torch.zeros(2, 2, dtype=torch.float64, device=DEVICE),
                            torch.zeros(2, 1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="bitmask must be"):  # fewer mask rows than logits rows
        sample_with_logprob(torch.zeros(2, 64, device=DEVICE), torch.zeros(2, 2, dtype=torch.float64, device=DEVICE),
                            torch.zeros(1, 2, dtype=torch.int32, device=DEVICE))


@pytest.mark.skipif(not ON_CUDA, reason="the sampler takes the Triton kernel on CUDA only")
def test_sampler_seeded_rows_take_the_kernel_with_their_own_uniforms() -> None:
    import random

    from pagedllm.model.layers.sampler import Sampler, SamplingRow
    from pagedllm.sampling_params import SamplingParams

    logits = torch.randn(64, 128256, device="cuda", dtype=torch.bfloat16) * 3
    params = SamplingParams(temperature=0.7, seed=1)
    rows = [SamplingRow(params, [1, 2], [], random.Random(i)) if i % 4 else
            SamplingRow(SamplingParams(temperature=0.0), [1, 2], []) for i in range(64)]
    got, _ = Sampler().launch(logits, rows).result()
    u = torch.tensor([random.Random(i).random() if i % 4 else 0.0 for i in range(64)], dtype=torch.float64)
    want = inverse_cdf_sample((logits.float() / 0.7).softmax(-1), u.cuda()).cpu()
    want[::4] = logits.float().argmax(-1).cpu()[::4]
    tokens = torch.tensor([r.token_ids[0] for r in got])
    assert (tokens == want).float().mean() >= 0.95
    lp = logits.float().log_softmax(-1).cpu().gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([r.logprobs[0] for r in got], dtype=torch.float32), lp, rtol=0, atol=1e-4)


@pytest.mark.skipif(not ON_CUDA, reason="the sampler folds the bitmask into the Triton kernel on CUDA only")
@pytest.mark.parametrize("all_greedy", [False, True])
def test_sampler_folds_the_bitmask_as_masking_first_would(all_greedy: bool) -> None:
    """`Sampler.launch(token_bitmask=...)` with the manager's pinned mask gives the tokens and logprobs of
    masking the logits in place first (the same seeded draws), for greedy-only and mixed batches."""
    import random

    from pagedllm.model.layers.sampler import Sampler, SamplingRow, apply_token_bitmask_
    from pagedllm.sampling_params import SamplingParams

    rows_n, vocab = 16, 49152
    logits = torch.randn(rows_n, vocab, device="cuda", dtype=torch.bfloat16) * 3
    bitmask = _random_bitmask(rows_n, vocab, 11).pin_memory()
    constrained = [0, 2, 3, 8, 15]

    def rows():
        return [SamplingRow(SamplingParams(temperature=0.0), [1], []) if all_greedy or i % 3 == 0 else
                SamplingRow(SamplingParams(temperature=0.9, seed=i), [1], [], random.Random(i)) for i in range(rows_n)]

    got, _ = Sampler().launch(logits.clone(), rows(), token_bitmask=(bitmask, constrained)).result()
    first = logits.clone()
    apply_token_bitmask_(first, bitmask, constrained)
    want, _ = Sampler().launch(first, rows()).result()
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    torch.testing.assert_close(torch.tensor([r.logprobs[0] for r in got]), torch.tensor([r.logprobs[0] for r in want]),
                               rtol=0, atol=1e-5)
