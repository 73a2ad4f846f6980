"""Mamba (Mamba-1) selective state-space mixer over a flat batch, reading and writing per-sequence state slots.

The math follows transformers' ``modeling_mamba.py`` (and FalconMamba's and Jamba's copies): in_proj → [x | z]; a
causal depthwise conv over x then SiLU; x_proj → [dt | B | C] (FalconMamba normalises the three by RMS without weights,
Jamba with its ``dt_layernorm`` / ``b_layernorm`` / ``c_layernorm``); dt = softplus(dt_proj(dt)); per channel c and
state s: h = exp(dt·A[c, s])·h + dt·x·B[s], y = h·C + D·x; y · silu(z); out_proj.

Unlike Mamba-2, A is a matrix (a decay per channel and state), so there is no chunked matrix form worth its memory:
the scan runs token by token. On a GPU one Triton kernel (kernels/triton_mamba.py ``selective_scan``) does it for
every sequence of the step, prefill chunks and decode rows alike, with each block of channels' state in registers;
on the CPU a C kernel (kernels/cpu/cpu_ops.c ``mamba1_scan_f32``) does the same per (sequence, channel), and a torch
loop over token positions (every sequence at once) serves where it cannot run (a bfloat16 state). The state slot holds the conv's last
``d_conv - 1`` inputs and the SSM state [intermediate, 1, d_state] (MambaStateShape with head_dim 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.device_utils import async_tensor_h2d
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.linear import ReplicatedLinear
from pagedllm.model.layers.mamba2 import _DepthwiseConv, causal_conv_prefill, conv_layout
from pagedllm.model.layers.mamba_state import MambaLayerCache, MambaStateMetadata, MambaStateShape, clear_state_slots

#: The inner norms of dt, B and C after x_proj: none (Mamba), RMS without weights (FalconMamba), RMSNorm (Jamba).
INNER_NORMS = (None, "weightless", "weighted")


@dataclass(frozen=True)
class Mamba1Dims:
    """One Mamba-1 layer's geometry and options, as a HF config gives them."""

    hidden_size: int
    intermediate: int
    d_state: int
    d_conv: int
    dt_rank: int
    conv_bias: bool = True
    proj_bias: bool = False
    eps: float = 1e-5  # the block's RMSNorm
    inner_norm: str | None = None
    inner_eps: float = 1e-6
    activation: str = "silu"

    def state_shape(self, num_layers: int) -> MambaStateShape:
        """The per-slot state of `num_layers` such layers (a channel is a 'head' of one)."""
        return MambaStateShape(num_layers=num_layers, conv_dim=self.intermediate, conv_width=self.d_conv - 1,
                               num_heads=self.intermediate, head_dim=1, state_size=self.d_state)


def validate_mamba1_dims(dims: Mamba1Dims, tp: TensorParallelGroup) -> None:
    """Raise ValueError for a geometry this mixer cannot run."""
    if tp.size != 1:
        raise ValueError(f"Mamba layers support tensor_parallel_size 1 only, got {tp.size}")
    for name in ("hidden_size", "intermediate", "d_state", "dt_rank"):
        if getattr(dims, name) < 1:
            raise ValueError(f"Mamba {name} must be positive, got {getattr(dims, name)}")
    if dims.d_conv < 2:
        raise ValueError(f"Mamba d_conv (conv kernel width) must be at least 2, got {dims.d_conv}")
    if dims.inner_norm not in INNER_NORMS:
        raise ValueError(f"Mamba inner_norm must be one of {INNER_NORMS}, got {dims.inner_norm!r}")
    if dims.activation not in ("silu", "swish"):
        raise ValueError(f"Mamba conv activation must be 'silu', got {dims.activation!r}")


def _rms(t: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    out = t.float() * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight.float()


def selective_scan_torch(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                         ssm_state: torch.Tensor, slots: list[int], lens: list[int],
                         snapshots: list[tuple[int, int, int]] = ()) -> torch.Tensor:
    """The selective scan of packed sequences, token position by token position (all sequences at once), float32.

    x / dt [T, D] (dt after softplus), a [D, N] (negative), b / c [T, N]; sequence i (`lens[i]` tokens) continues
    from slot `slots[i]` of `ssm_state` [slots, D, 1, N], which it leaves at its last token. `snapshots` (sequence,
    offset, slot): that slot also gets the sequence's state after its first `offset` tokens. Returns y = h·C [T, D]
    (without the D skip and the gate)."""
    dev = x.device
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    slot_t = async_tensor_h2d(slots, torch.long, dev)
    state = ssm_state.index_select(0, slot_t).float()[:, :, 0]  # [S, D, N]
    y = torch.empty_like(x)
    at: dict[int, list[tuple[int, int]]] = {}
    for seq, offset, slot in snapshots:
        at.setdefault(offset, []).append((seq, slot))
    for j in range(max(lens, default=0)):
        live = [i for i, n in enumerate(lens) if n > j]
        every = len(live) == len(lens)
        rows = async_tensor_h2d([starts[i] + j for i in live], torch.long, dev)
        step = dt.index_select(0, rows)
        cur = state if every else state.index_select(0, async_tensor_h2d(live, torch.long, dev))
        cur = cur * torch.exp(step[:, :, None] * a) + (step * x.index_select(0, rows))[:, :, None] \
            * b.index_select(0, rows)[:, None, :]
        y.index_copy_(0, rows, torch.einsum("sdn,sn->sd", cur, c.index_select(0, rows)))
        if every:
            state = cur
        else:
            state = state.index_copy(0, async_tensor_h2d(live, torch.long, dev), cur)
        for seq, slot in at.get(j + 1, ()):
            ssm_state[slot, :, 0] = state[seq].to(ssm_state.dtype)
    ssm_state.index_copy_(0, slot_t, state[:, :, None].to(ssm_state.dtype))
    return y


class Mamba1Mixer(nn.Module):
    """A Mamba-1 mixer with HF checkpoint names: ``in_proj``, ``conv1d.weight`` [D, 1, d_conv], ``conv1d.bias``,
    ``x_proj``, ``dt_proj`` (with bias), ``A_log`` [D, N], ``D``, ``out_proj``, and Jamba's ``dt_layernorm``,
    ``b_layernorm``, ``c_layernorm``.

    ``forward(hidden [T, hidden], cache, meta)`` advances every sequence of the step from its slot's state (zeros where
    its chunk starts at position 0) and leaves the state after its last token in the slot."""

    def __init__(self, dims: Mamba1Dims, tp: TensorParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        validate_mamba1_dims(dims, tp)
        self.dims = dims
        inter, n = dims.intermediate, dims.d_state
        self.in_proj = ReplicatedLinear(dims.hidden_size, 2 * inter, dims.proj_bias, dtype)
        self.conv1d = _DepthwiseConv(inter, dims.d_conv, dims.conv_bias, dtype)
        self.x_proj = ReplicatedLinear(inter, dims.dt_rank + 2 * n, False, dtype)
        self.dt_proj = ReplicatedLinear(dims.dt_rank, inter, True, dtype)
        self.A_log = nn.Parameter(torch.zeros(inter, n, dtype=dtype), requires_grad=False)
        self.D = nn.Parameter(torch.ones(inter, dtype=dtype), requires_grad=False)
        self.out_proj = ReplicatedLinear(inter, dims.hidden_size, dims.proj_bias, dtype)
        if dims.inner_norm == "weighted":
            self.dt_layernorm = _NormWeight(dims.dt_rank, dtype)
            self.b_layernorm = _NormWeight(n, dtype)
            self.c_layernorm = _NormWeight(n, dtype)

    def forward(self, hidden: torch.Tensor, cache: MambaLayerCache, meta: Any) -> torch.Tensor:
        """hidden [T, hidden_size] (T = the step's query tokens, decodes first) → [T, hidden_size]."""
        state_meta: MambaStateMetadata | None = getattr(meta, "mamba", None)
        if state_meta is None:
            raise ValueError("a Mamba layer needs meta.mamba (MambaStateMetadata) with the step's state slots")
        d = self.dims
        x, z = self.in_proj(hidden).split([d.intermediate, d.intermediate], dim=-1)
        lens = list(meta.query_lens_cpu)
        if sum(lens) != hidden.shape[0]:
            raise ValueError(f"the step's query lengths sum to {sum(lens)}, but hidden has {hidden.shape[0]} rows")
        clear_state_slots([cache], state_meta.fresh_slots(0, len(lens)))
        xc = self._conv(x, cache, state_meta, meta.num_decodes, lens)
        dt, b, c = self.x_proj(xc.to(hidden.dtype)).split([d.dt_rank, d.d_state, d.d_state], dim=-1)
        if d.inner_norm == "weightless":
            dt, b, c = (_rms(t, d.inner_eps) for t in (dt, b, c))
        elif d.inner_norm == "weighted":
            dt, b, c = (_rms(t, d.inner_eps, norm.weight) for t, norm in
                        ((dt, self.dt_layernorm), (b, self.b_layernorm), (c, self.c_layernorm)))
        dt = self.dt_proj(dt.to(hidden.dtype))  # with its bias (transformers adds it in float32: equal in float32)
        snapshots = [(row, offset, slot) for row, offset, slot in state_meta.cuts]
        if hidden.is_cuda:
            from pagedllm.kernels.triton_mamba import selective_scan

            y = selective_scan(xc, dt, self.A_log, b, c, self.D, z, cache.ssm_state, state_meta.state_indices,
                               meta.query_start_loc, lens, snapshots)
        else:
            args = (xc, F.softplus(dt.float()), -torch.exp(self.A_log.float()), b.float(), c.float(), cache.ssm_state,
                    state_meta.state_indices_cpu, lens, snapshots)
            native = _native_cpu(cache.ssm_state)
            y = native.mamba1_scan(*args) if native is not None else selective_scan_torch(*args)
            y = (y + xc * self.D.float()) * F.silu(z.float())
        return self.out_proj(y.to(hidden.dtype))

    def _conv(self, x: torch.Tensor, cache: MambaLayerCache, state_meta: MambaStateMetadata, nd: int,
              lens: list[int]) -> torch.Tensor:
        """SiLU(causal conv) [T, D] float32: decode rows one step each, prefill chunks packed; the slots keep each
        sequence's last d_conv - 1 inputs (and a snapshot slot those before its offset)."""
        bias = None if self.conv1d.bias is None else self.conv1d.bias.float()
        out = torch.empty(x.shape[0], self.dims.intermediate, dtype=torch.float32, device=x.device)
        if nd:
            slots = state_meta.state_indices[:nd]
            if x.is_cuda:
                from pagedllm.kernels.triton_mamba import conv_state_update

                out[:nd] = conv_state_update(x[:nd], cache.conv_state, self.conv1d.weight, self.conv1d.bias, slots)
            else:
                window = torch.cat([cache.conv_state.index_select(0, slots).float(), x[:nd].float()[:, :, None]], 2)
                cache.conv_state.index_copy_(0, slots, window[:, :, 1:].to(cache.conv_state.dtype))
                conv = (window * self.conv1d.weight.float()[:, 0]).sum(-1)
                out[:nd] = F.silu(conv if bias is None else conv + bias)
        if nd < len(lens):
            first = nd
            slot_t = state_meta.state_indices[first:]
            cuts = [(row - first, offset) for row, offset, _ in state_meta.cuts if row >= first]
            width = cache.conv_state.shape[2]
            cut_slots, layout = state_meta.per_step(("mamba1 conv", first, width), lambda: (
                async_tensor_h2d([slot for row, _, slot in state_meta.cuts if row >= first], torch.long, x.device)
                if cuts else None, conv_layout(lens[first:], width, cuts, x.device)))
            out[nd:] = causal_conv_prefill(x[nd:], cache.conv_state, self.conv1d.weight, bias, slot_t, lens[first:],
                                           cuts, cut_slots, layout)
        return out


def _native_cpu(ssm_state: torch.Tensor) -> Any:
    """The CPU's native kernels where they can run this scan (a float32 state of at most 256 per channel), else None
    (the torch loop)."""
    if ssm_state.dtype != torch.float32 or ssm_state.shape[-1] > 256:
        return None
    from pagedllm.kernels.cpu_kernels import load_cpu_kernels

    return load_cpu_kernels()


class _NormWeight(nn.Module):
    """Holds an inner RMSNorm's ``weight`` (the mixer applies it)."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)
