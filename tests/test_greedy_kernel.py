"""Greedy sampling with its log-probability in one pass (kernels/triton_greedy.py, compiled on CUDA,
interpreted on CPU) against the plain-torch reference, and the sampler's use of it."""
from __future__ import annotations

import pytest
import torch

# First: without CUDA it sets TRITON_INTERPRET, which the kernel module's @triton.jit reads at import.
from tests.triton_setup import DEVICE, ON_CUDA, interpreter_numpy_shim

# isort: split
from pagedllm.kernels.reference import greedy_sample_with_logprob as reference
from pagedllm.kernels.triton_greedy import greedy_sample_with_logprob

interpreter_numpy_shim()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [7, 4096, 4097, 12000])
def test_kernel_matches_reference(dtype: torch.dtype, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(5, vocab, generator=g) * 4).to(dtype)
    logits[1] = float("-inf")
    logits[1, vocab // 2] = 3.0  # one allowed token (a structured-output mask)
    logits[2, :] = 1.5  # all tied: the first token wins
    logits[3, -1] = 1e4  # the max in the last, partial chunk
    logits[4, : min(vocab - 1, 4096)] = float("-inf")  # the whole first chunk masked (all but one for small vocabs)
    tok, lp = greedy_sample_with_logprob(logits.to(DEVICE))
    want_tok, want_lp = reference(logits)
    assert tok.cpu().tolist() == want_tok.tolist()
    torch.testing.assert_close(lp.cpu(), want_lp, rtol=1e-5, atol=1e-5)
    assert tok[2].item() == 0 and lp[1].item() == 0.0


def test_rejects_a_non_contiguous_vocabulary() -> None:
    with pytest.raises(ValueError, match="contiguous along the vocabulary"):
        greedy_sample_with_logprob(torch.zeros(8, 4, device=DEVICE).t())


@pytest.mark.skipif(not ON_CUDA, reason="the sampler uses the kernel on CUDA only")
def test_sampler_greedy_rows_take_the_fused_path_and_agree() -> None:
    from pagedllm.model.layers.sampler import Sampler, SamplingRow
    from pagedllm.sampling_params import SamplingParams

    logits = torch.randn(64, 128256, device="cuda", dtype=torch.bfloat16) * 3
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1, 2], [], eos_token_ids=(2,)) for _ in range(64)]
    got, _ = Sampler().launch(logits, rows).result()
    want_tok, want_lp = reference(logits)
    assert [r.token_ids[0] for r in got] == want_tok.tolist()
    torch.testing.assert_close(torch.tensor([r.logprobs[0] for r in got], dtype=torch.float64), want_lp.cpu().double(),
                               rtol=1e-5, atol=1e-5)
