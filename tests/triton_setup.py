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
