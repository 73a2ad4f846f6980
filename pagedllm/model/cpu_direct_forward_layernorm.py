"""The LayerNorm families' decoder stack (models/gpt_neox.py's LayerNormCausalLM: GPT-NeoX / Pythia, Phi-1.5 / Phi-2,
StableLM, StarCoder2) on the CPU, called directly: the CPU direct forward of model/cpu_direct_forward.py for their
layers.

What the module path runs per layer (LayerNormDecoderLayer.forward) and the step here runs too, op for op:

* the LayerNorms (with bias; ``layers/norm.py``'s LayerNorm) and the non-gated MLPs' activation (GeluMLP.act: exact
  erf GELU, or tanh-approximated for gelu_new / gelu_pytorch_tanh) are torch ops on the CPU (no native kernel): the
  step calls the same ops (``F.layer_norm`` with the module's weight, bias and eps; the MLP's own ``act``) on the same
  inputs, so their bits are the module path's. StableLM's gated SiLU MLP (LlamaMLP) takes the C silu·mul, as there;
* the attention (PartialRotaryAttention: partial RoPE, biases, StarCoder2's window, GQA) is every family's
  (DirectForward's ``attend``); Phi's shared and StableLM's per-head q/k LayerNorms are the modules' own ``forward``
  (torch ops) on q's and k's head rows, copied back into the qkv rows (exact) before RoPE;
* the residual: sequential (StableLM, StarCoder2, GPT-NeoX without use_parallel_residual) h += attn(ln1(h)), then
  h += mlp(ln2(h)); parallel (GPT-NeoX, Phi, StableLM's use_parallel_residual) h += attn(ln1(h)), then += mlp(x), x
  being ln1(h) itself where the layer has no post_attention_layernorm (Phi, StableLM), ln2 of the layer's input
  otherwise (GPT-NeoX). The module path's ``h + a`` then ``+ m`` are the step's in-place adds on the residual rows, in
  the same order.

The step's saving over the module path is the Python around the calls (module dispatch, the wrappers' checks), as for
the Llama family; the torch ops themselves (two LayerNorms, the activation, two adds per layer) cost what they cost
there.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model.cpu_direct_forward import (
    DirectForward,
    StepCalls,
    _AttentionLayer,
    _Buffers,
)

#: A LayerNorm as F.layer_norm takes it: (weight, bias or None, eps).
_LayerNormArgs = tuple[torch.Tensor, "torch.Tensor | None", float]


@dataclass(frozen=True, kw_only=True)
class _LayerNormLayer(_AttentionLayer):
    """A LayerNormDecoderLayer: its norms' tensors (read live by F.layer_norm), its residual layout, its MLP's
    activation and its q/k norm modules."""

    ln1: _LayerNormArgs  # input_layernorm
    ln2: _LayerNormArgs | None  # post_attention_layernorm (None: a parallel block whose MLP reads ln1's output)
    parallel: bool  # attention and MLP both read the layer's input (else the MLP reads it after the attention's add)
    act: Callable[[torch.Tensor], torch.Tensor] | None  # GeluMLP's activation (None: StableLM's SiLU·mul, in C)
    q_norm: nn.Module | None = None  # Phi's / StableLM's q and k LayerNorms over each head's rows (None: none)
    k_norm: nn.Module | None = None


def _layer_norm_args(norm: nn.Module, width: int) -> _LayerNormArgs:
    """The arguments LayerNorm.forward hands F.layer_norm, checked once."""
    from pagedllm.model.layers.norm import LayerNorm

    if type(norm) is not LayerNorm or norm.hidden_size != width or norm.weight is None:
        raise ValueError(f"a {type(norm).__name__} where an affine LayerNorm over {width} is expected")
    for t in (norm.weight, norm.bias):
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu" or t.shape != (width,)):
            raise ValueError(f"LayerNorm weights must be float32 [{width}] CPU tensors")
    return norm.weight, norm.bias, float(norm.eps)


class LayerNormDirectForward(DirectForward):
    """The LayerNorm families' step (see module doc)."""

    def _read_family(self, model: nn.Module) -> None:
        from pagedllm.model.models.gpt_neox import LayerNormDecoderModel

        inner = model.model
        if type(inner).forward is not LayerNormDecoderModel.forward:
            raise ValueError(f"{type(inner).__name__} overrides LayerNormDecoderModel's forward")
        kinds = {hasattr(layer.mlp, "gate_up_proj") for layer in inner.layers}
        if len(kinds) != 1:
            raise ValueError("gated and non-gated MLPs in one model")
        self.gated = kinds.pop()  # StableLM's LlamaMLP (SiLU·mul, the C kernel); else GeluMLP (a torch activation)
        self.final_norm = _layer_norm_args(inner.norm, self.hidden)

    def _layer(self, layer: nn.Module) -> _LayerNormLayer:
        from pagedllm.model.models.gpt_neox import GeluMLP, LayerNormDecoderLayer
        from pagedllm.model.models.llama import LlamaMLP, RotaryAttention

        sa, mlp = layer.self_attn, layer.mlp
        if type(layer).forward is not LayerNormDecoderLayer.forward or type(sa).forward is not RotaryAttention.forward:
            raise ValueError(f"{type(layer).__name__} / {type(sa).__name__}: not the forward this step runs")
        if self.gated:
            if type(mlp).forward is not LlamaMLP.forward:
                raise ValueError(f"{type(mlp).__name__}: not LlamaMLP's forward")
            up, down, act = mlp.gate_up_proj, mlp.down_proj, None
        else:
            if type(mlp).forward is not GeluMLP.forward:
                raise ValueError(f"{type(mlp).__name__}: not GeluMLP's forward")
            up, down, act = mlp.fc1, mlp.fc2, mlp.act
        if (sa.q_norm is None) != (sa.k_norm is None):
            raise ValueError("a q norm without a k norm (or the reverse)")
        ln2 = layer.post_attention_layernorm
        return _LayerNormLayer(**self._attention_fields(layer, up, down),
                               ln1=_layer_norm_args(layer.input_layernorm, self.hidden),
                               ln2=None if ln2 is None else _layer_norm_args(ln2, self.hidden),
                               parallel=bool(layer.parallel_residual), act=act, q_norm=sa.q_norm, k_norm=sa.k_norm)

    def _run_layers(self, residual: torch.Tensor, b: _Buffers, calls: StepCalls) -> torch.Tensor:
        run_linear, attend = calls
        t = residual.shape[0]
        layer_norm, shape = F.layer_norm, (self.hidden,)
        silu, act_out = self._silu, b.act
        split, d, up_w = [self.q_size, self.kv_size, self.kv_size], self.head_dim, self.up_width
        inter = up_w // 2
        for i, layer in enumerate(self.layers):
            normed = layer_norm(residual, shape, *layer.ln1)  # LayerNorm.forward's call (a fresh tensor)
            mlp_in = normed
            if layer.parallel and layer.ln2 is not None:  # GPT-NeoX: the MLP's own norm of the layer's input
                mlp_in = layer_norm(residual, shape, *layer.ln2)
            qkv_out = run_linear(layer.qkv, normed, b.qkv)
            if layer.q_norm is not None:  # RotaryAttention.forward's norms of each head's rows, copied back in place
                q, k, _ = qkv_out.split(split, dim=-1)
                q.copy_(layer.q_norm.forward(q.reshape(-1, d)).view(t, -1))
                k.copy_(layer.k_norm.forward(k.reshape(-1, d)).view(t, -1))
            attend(i, layer, qkv_out.data_ptr())
            o_out = run_linear(layer.o, b.attn, b.o)  # held: a dense linear's result is a fresh tensor
            residual.add_(o_out)  # h + attn (parallel: then + mlp, from the inputs read above)
            if not layer.parallel:  # h += attn; the MLP reads ln2(h)
                mlp_in = layer_norm(residual, shape, *layer.ln2)
            up_out = run_linear(layer.up, mlp_in, b.up)
            if layer.act is None:  # StableLM's SiLU·mul (silu_and_mul's C kernel)
                silu(act_out.data_ptr(), up_out.data_ptr(), up_w, t, inter)
                down_in = act_out
            else:
                down_in = layer.act(up_out)
            residual.add_(run_linear(layer.down, down_in, b.down))
        return layer_norm(residual, shape, *self.final_norm)
