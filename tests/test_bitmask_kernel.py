"""The structured-output bitmask: the Triton kernel (compiled on CUDA, interpreted on CPU) and the engine's
apply op against the plain-torch oracle."""
from __future__ import annotations

import pytest
import torch

from tests.test_cpu_isa import ALL_ISAS
from tests.triton_setup import DEVICE, interpreter_numpy_shim

from pagedllm.kernels.reference import apply_token_bitmask as reference  # noqa: E402
from pagedllm.kernels.triton_bitmask import apply_token_bitmask_triton  # noqa: E402
from pagedllm.model.layers.sampler import apply_token_bitmask_  # noqa: E402

interpreter_numpy_shim()


def _case(batch: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-2**31, 2**31 - 1, (batch, words), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[0] = -1  # everything allowed
    bitmask[-1] = 0  # nothing allowed
    return logits, bitmask


@pytest.mark.parametrize("vocab", [100, 4096, 5000])
@pytest.mark.parametrize("rows", [None, [0, 1, 2, 3], [1, 3], [2]])
def test_triton_kernel_matches_reference(vocab: int, rows: list[int] | None) -> None:
    logits, bitmask = _case(4, vocab, seed=vocab + len(rows or ()))
    want = reference(logits, bitmask, rows if rows is not None else [0, 1, 2, 3])
    got = logits.to(DEVICE)
    apply_token_bitmask_triton(got, bitmask.to(DEVICE), None if rows is None else torch.tensor(rows, device=DEVICE))
    rows = rows if rows is not None else [0, 1, 2, 3]
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    untouched = [r for r in range(4) if r not in rows]
    torch.testing.assert_close(got.cpu()[untouched], logits[untouched], rtol=0, atol=0)


def test_engine_apply_matches_reference_on_its_device() -> None:
    logits, bitmask = _case(6, 49152, seed=7)
    rows = [0, 2, 5]
    want = reference(logits, bitmask, rows)
    got = logits.to(DEVICE)
    apply_token_bitmask_(got, bitmask, rows)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


@pytest.mark.skipif(DEVICE != "cuda", reason="pinned host memory read by a CUDA kernel")
def test_kernel_reads_a_pinned_host_mask_in_place() -> None:
    """The engine's bitmask buffers are pinned: the kernel reads them without a copy, with the same result."""
    logits, bitmask = _case(6, 49152, seed=11)
    rows = [1, 2, 4]
    want = reference(logits, bitmask, rows)
    pinned = bitmask.pin_memory()
    got = logits.to(DEVICE)
    apply_token_bitmask_triton(got, pinned, torch.tensor(rows, device=DEVICE))
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    got = logits.to(DEVICE)
    apply_token_bitmask_(got, pinned, rows)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


@pytest.mark.parametrize("isa", ALL_ISAS)
def test_native_cpu_kernel_matches_reference(isa: str) -> None:
    """Each ISA build's kernel (the vector builds take whole words branch-free) against the oracle: every
    word pattern (random bits, all set, none), a vocabulary that ends mid-word."""
    from pagedllm.kernels.cpu_kernels import load_cpu_kernels

    native = load_cpu_kernels(isa)
    if native is None:
        pytest.skip("no native CPU kernels on this machine")
    for vocab, rows in ((100, [0, 1, 2, 3]), (5000, [1, 3]), (49152, [2])):
        logits, bitmask = _case(4, vocab, seed=vocab)
        want = reference(logits, bitmask, rows)
        got = logits.clone()
        native.apply_token_bitmask(got, bitmask, rows)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="rows must be in"):
        native.apply_token_bitmask(logits.clone(), bitmask, [4])
    with pytest.raises(ValueError, match="too small"):
        native.apply_token_bitmask(logits.clone(), bitmask[:, :2], [0])
