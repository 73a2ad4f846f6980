"""Shared set-up of the Triton kernel tests: compiled on CUDA, Triton's interpreter on CPU.

Import this module before any kernel module: without CUDA it sets TRITON_INTERPRET=1, which is read
when the kernels' @triton.jit decorators run.
"""
from __future__ import annotations

import os

import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"


def interpreter_numpy_shim() -> None:
    """Triton 3.6's interpreter turns a scalar into an index with int(1-element array), which numpy ≥ 2.4
    refuses; give it the element instead (affects only TRITON_INTERPRET runs; call after importing triton)."""
    if ON_CUDA:
        return
    from triton.runtime import interpreter as ti

    if getattr(ti, "_pagedllm_index_shim", False):
        return
    original = ti._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patched
    ti._pagedllm_index_shim = True


def interpreter_bf16_dot_shim() -> None:
    """Triton's interpreter keeps bfloat16 tensors as their uint16 bits and ``tl.dot`` multiplies those bits;
    widen bfloat16 operands to float32 (exact) first. Affects only TRITON_INTERPRET runs; call after importing
    triton."""
    if ON_CUDA:
        return
    import triton.language as tl
    from triton.runtime import interpreter as ti

    builder = ti.InterpreterBuilder
    if getattr(builder, "_pagedllm_bf16_dot_shim", False):
        return
    original = builder.create_dot

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (self.cast_impl(x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = patched
    builder._pagedllm_bf16_dot_shim = True


def row_invariant_interpreter_dot(monkeypatch) -> None:
    """For the tests of batch-invariant kernels under Triton's interpreter: its ``tl.dot`` is one ``np.matmul``,
    whose rows can depend on the row count (OpenBLAS's Haswell/Zen kernels and numpy's float16 loops handle the
    rows past a multiple of their blocking apart: a tile's 64th row had other bits than the same row alone on an
    AVX2-only Zen 3), so the interpreter would stand in for a kernel with row-dependent bits that the GPU does not
    have. Each row is multiplied on its own instead, with the same operations at every row count. Scoped to the
    test through `monkeypatch`; nothing changes on CUDA."""
    if ON_CUDA:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = a.data, b.data
        if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or \
           (b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()):
            a_data = ti._convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
            b_data = ti._convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
        rows = [np.matmul(a_data[..., i:i + 1, :], b_data, dtype=d.data.dtype) for i in range(a_data.shape[-2])]
        return ti.TensorHandle(np.concatenate(rows, axis=-2) + d.data, d.dtype.scalar)

    monkeypatch.setattr(ti.InterpreterBuilder, "create_dot", create_dot)
