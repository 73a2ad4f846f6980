"""Mamba-2 state-space mixer (SSD) over a flat batch, reading and writing per-sequence state slots.

The math follows transformers' torch path (``modeling_mamba2.py`` and the hybrids that copy it): in_proj → [z | xBC |
dt]; a causal depthwise conv over xBC then SiLU; the selective scan with dt = softplus(dt + dt_bias), A = -exp(A_log)
and the D skip; a gated RMSNorm (y · silu(z), normalised per group of ``norm_group_size`` channels); out_proj.
Prefill chunks run the chunked SSD form (the Mamba-2 paper's ``ssd_minimal_discrete`` with an initial state), decode
rows one recurrent step for the whole batch. As transformers (and mamba_ssm's step), dt is clamped to
``time_step_limit`` on the chunked path only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.linear import ReplicatedLinear
from pagedllm.model.layers.mamba_state import (
    MambaLayerCache,
    MambaStateMetadata,
    MambaStateShape,
)

DEFAULT_CHUNK_SIZE = 128


@dataclass(frozen=True)
class Mamba2Dims:
    """One Mamba-2 layer's geometry and options, as a HF config gives them."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    conv_bias: bool = True
    proj_bias: bool = False
    eps: float = 1e-5
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    norm_group_size: int | None = None  # channels per gated-norm group; None: intermediate // n_groups
    activation: str = "silu"

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.d_state

    def state_shape(self, num_layers: int) -> MambaStateShape:
        """The per-slot state of `num_layers` such layers."""
        return MambaStateShape(num_layers=num_layers, conv_dim=self.conv_dim, conv_width=self.d_conv - 1,
                               num_heads=self.num_heads, head_dim=self.head_dim, state_size=self.d_state)


def time_step_limit(value: Any) -> tuple[float, float]:
    """A config's ``time_step_limit`` as (low, high); None or missing: no clamp, (0, inf)."""
    if value is None:
        return 0.0, math.inf
    low, high = (float(v) for v in value)
    if not low <= high:
        raise ValueError(f"time_step_limit must be (low, high) with low <= high, got {value!r}")
    return low, high


def validate_dims(dims: Mamba2Dims, tp: TensorParallelGroup) -> None:
    """Raise ValueError for a geometry this mixer cannot run."""
    if tp.size != 1:
        raise ValueError(f"Mamba-2 layers support tensor_parallel_size 1 only, got {tp.size}")
    for name in ("hidden_size", "num_heads", "head_dim", "n_groups", "d_state"):
        if getattr(dims, name) < 1:
            raise ValueError(f"Mamba-2 {name} must be positive, got {getattr(dims, name)}")
    if dims.d_conv < 2:
        raise ValueError(f"Mamba-2 d_conv (conv kernel width) must be at least 2, got {dims.d_conv}")
    if dims.num_heads % dims.n_groups:
        raise ValueError(f"Mamba-2 num_heads ({dims.num_heads}) must be a multiple of n_groups ({dims.n_groups})")
    group = dims.norm_group_size or dims.intermediate // dims.n_groups
    if dims.intermediate % group:
        raise ValueError(f"gated-norm group size {group} must divide the intermediate size {dims.intermediate}")
    if dims.activation not in ("silu", "swish"):
        raise ValueError(f"Mamba-2 conv activation must be 'silu', got {dims.activation!r}")


def _segsum(x: torch.Tensor) -> torch.Tensor:
    """[..., l] → [..., l, l]: out[..., i, j] = x[j+1] + … + x[i] for j <= i, -inf above the diagonal."""
    length = x.shape[-1]
    x = x[..., None].expand(*x.shape, length)
    below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=-1)
    out = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=0)
    return out.masked_fill(~keep, -math.inf)


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   initial_state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's selective scan in the chunked SSD form (float32 throughout).

    x [L, h, p], dt [L, h] (already softplus'd and clamped), a [h] (negative), b / c [L, h, n] (groups repeated to
    heads), initial_state [h, p, n]. Returns (y [L, h, p] without the D skip, final state [h, p, n])."""
    length = x.shape[0]
    pad = (-length) % chunk_size
    xd = x * dt[..., None]
    ad = a * dt  # [L, h]
    if pad:
        # zero dt on the padding: decay 1 and no input, so the final state is the last real token's
        xd, ad, b, c = (F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad)) for t in (xd, ad, b, c))
    n_chunks = (length + pad) // chunk_size
    xd = xd.view(n_chunks, chunk_size, *xd.shape[1:])  # [c, l, h, p]
    b = b.reshape(n_chunks, chunk_size, *b.shape[1:])  # [c, l, h, n]
    c = c.reshape(n_chunks, chunk_size, *c.shape[1:])
    ad = ad.view(n_chunks, chunk_size, -1).permute(2, 0, 1)  # [h, c, l]
    a_cum = torch.cumsum(ad, dim=-1)

    # within each chunk: a causal, decay-weighted "attention" of C over B
    decay = torch.exp(_segsum(ad))  # [h, c, l, s]
    scores = torch.einsum("clhn,cshn->hcls", c, b) * decay
    y = torch.einsum("hcls,cshp->clhp", scores, xd)

    # each chunk's contribution to the state at its end, then the recurrence across chunk boundaries
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [h, c, l]
    chunk_states = torch.einsum("clhn,hcl,clhp->chpn", b, to_end, xd)
    states = torch.cat([initial_state[None], chunk_states], dim=0)  # [c+1, h, p, n]
    across = torch.exp(_segsum(F.pad(a_cum[..., -1], (1, 0))))  # [h, c+1, c+1]
    states = torch.einsum("hzy,yhpn->zhpn", across, states)
    starts, final = states[:-1], states[-1]

    # the state each chunk starts from, read out by C with the decay since the chunk began
    y = y + torch.einsum("clhn,chpn,hcl->clhp", c, starts, torch.exp(a_cum))
    return y.reshape(n_chunks * chunk_size, *y.shape[2:])[:length], final


class Mamba2Mixer(nn.Module):
    """A Mamba-2 mixer with HF checkpoint names: ``in_proj``, ``conv1d.weight`` [conv_dim, 1, d_conv],
    ``conv1d.bias``, ``dt_bias``, ``A_log``, ``D``, ``norm.weight``, ``out_proj``.

    ``forward(hidden [T, hidden], cache, meta)`` advances every sequence of the step from its slot's state (zeros
    where ``has_initial_state`` is False) and leaves the state after its last token in the slot."""

    def __init__(self, dims: Mamba2Dims, tp: TensorParallelGroup, dtype: torch.dtype,
                 chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        super().__init__()
        validate_dims(dims, tp)
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.dims = dims
        self.chunk_size = chunk_size
        inter, conv_dim, heads = dims.intermediate, dims.conv_dim, dims.num_heads
        self.in_proj = ReplicatedLinear(dims.hidden_size, inter + conv_dim + heads, dims.proj_bias, dtype)
        self.conv1d = _DepthwiseConv(conv_dim, dims.d_conv, dims.conv_bias, dtype)
        self.dt_bias = nn.Parameter(torch.ones(heads, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(heads, dtype=dtype), requires_grad=False)
        self.D = nn.Parameter(torch.ones(heads, dtype=dtype), requires_grad=False)
        self.norm = _GatedNorm(inter, dims.norm_group_size or inter // dims.n_groups, dims.eps, dtype)
        self.out_proj = ReplicatedLinear(inter, dims.hidden_size, dims.proj_bias, dtype)

    def forward(self, hidden: torch.Tensor, cache: MambaLayerCache, meta: Any) -> torch.Tensor:
        """hidden [T, hidden_size] (T = the step's query tokens, decodes first) → [T, hidden_size]."""
        state_meta: MambaStateMetadata | None = getattr(meta, "mamba", None)
        if state_meta is None:
            raise ValueError("a Mamba-2 layer needs meta.mamba (MambaStateMetadata) with the step's state slots")
        d = self.dims
        proj = self.in_proj(hidden)
        z, xbc, dt = proj.split([d.intermediate, d.conv_dim, d.num_heads], dim=-1)
        a = -torch.exp(self.A_log.float())
        y = torch.empty(hidden.shape[0], d.intermediate, dtype=torch.float32, device=hidden.device)
        nd = meta.num_decodes
        if nd:
            y[:nd] = self._decode(xbc[:nd], dt[:nd], a, cache, state_meta, nd)
        query_lens = meta.query_lens_cpu
        offset = sum(query_lens[:nd])
        for i in range(nd, len(query_lens)):
            end = offset + query_lens[i]
            if end > offset:
                y[offset:end] = self._prefill(xbc[offset:end], dt[offset:end], a, cache, state_meta, i)
            offset = end
        if offset != hidden.shape[0]:
            raise ValueError(f"the step's query lengths sum to {offset}, but hidden has {hidden.shape[0]} rows")
        return self.out_proj(self.norm(y, z).to(hidden.dtype))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """[T, n_groups·d_state] → [T, heads, d_state] (each group's B or C shared by its heads), float32."""
        d = self.dims
        t = t.float().reshape(t.shape[0], d.n_groups, 1, d.d_state)
        return t.expand(-1, -1, d.num_heads // d.n_groups, -1).reshape(t.shape[0], d.num_heads, d.d_state)

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.dims
        x, b, c = xbc.split([d.intermediate, d.n_groups * d.d_state, d.n_groups * d.d_state], dim=-1)
        return x.reshape(x.shape[0], d.num_heads, d.head_dim), self._heads(b), self._heads(c)

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, cache: MambaLayerCache,
                 state_meta: MambaStateMetadata, seq: int) -> torch.Tensor:
        """Sequence `seq`'s chunk [L] → y [L, intermediate] float32; its slot ends at the chunk's last token."""
        d = self.dims
        slot = state_meta.state_indices_cpu[seq]
        width = d.d_conv - 1
        if state_meta.has_initial_state[seq]:
            conv_prev = cache.conv_state[slot].float()
            ssm_prev = cache.ssm_state[slot].float()
        else:
            conv_prev = xbc.new_zeros(d.conv_dim, width, dtype=torch.float32)
            ssm_prev = torch.zeros(d.num_heads, d.head_dim, d.d_state, dtype=torch.float32, device=xbc.device)
        window = torch.cat([conv_prev, xbc.float().t()], dim=1)  # [conv_dim, width + L]
        cache.conv_state[slot] = window[:, -width:].to(cache.conv_state.dtype)
        conv = F.conv1d(window[None], self.conv1d.weight.float(), self._conv_bias(), groups=d.conv_dim)[0]
        x, b, c = self._split_xbc(F.silu(conv).t())
        x = x.float()
        step = self._time_step(dt)
        low, high = d.time_step_limit
        if low > 0 or high < math.inf:
            step = step.clamp(low, high)
        y, final = ssd_chunk_scan(x, step, a, b, c, ssm_prev, self.chunk_size)
        cache.ssm_state[slot] = final.to(cache.ssm_state.dtype)
        y = y + x * self.D.float()[:, None]
        return y.reshape(y.shape[0], d.intermediate)

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, cache: MambaLayerCache,
                state_meta: MambaStateMetadata, nd: int) -> torch.Tensor:
        """One token for each of the first `nd` sequences, all at once → y [nd, intermediate] float32."""
        d = self.dims
        slots = state_meta.state_indices[:nd]
        conv_prev = cache.conv_state.index_select(0, slots).float()  # [nd, conv_dim, width]
        ssm_prev = cache.ssm_state.index_select(0, slots).float()  # [nd, h, p, n]
        fresh = [i for i in range(nd) if not state_meta.has_initial_state[i]]
        if fresh:
            keep = torch.ones(nd, dtype=torch.float32, device=xbc.device)
            keep[fresh] = 0.0
            conv_prev = conv_prev * keep[:, None, None]
            ssm_prev = ssm_prev * keep[:, None, None, None]
        window = torch.cat([conv_prev, xbc.float()[:, :, None]], dim=2)  # [nd, conv_dim, d_conv]
        cache.conv_state.index_copy_(0, slots, window[:, :, 1:].to(cache.conv_state.dtype))
        conv = (window * self.conv1d.weight.float()[:, 0]).sum(-1)
        bias = self._conv_bias()
        if bias is not None:
            conv = conv + bias
        x, b, c = self._split_xbc(F.silu(conv))
        x = x.float()
        step = self._time_step(dt)  # [nd, h]
        decay = torch.exp(step * a)  # [nd, h]
        state = ssm_prev * decay[:, :, None, None] + (step[:, :, None] * x)[..., None] * b[:, :, None, :]
        cache.ssm_state.index_copy_(0, slots, state.to(cache.ssm_state.dtype))
        y = torch.einsum("bhpn,bhn->bhp", state, c) + x * self.D.float()[:, None]
        return y.reshape(nd, d.intermediate)

    def _time_step(self, dt: torch.Tensor) -> torch.Tensor:
        return F.softplus(dt.float() + self.dt_bias.float())

    def _conv_bias(self) -> torch.Tensor | None:
        return None if self.conv1d.bias is None else self.conv1d.bias.float()


class _DepthwiseConv(nn.Module):
    """Holds the causal depthwise conv's ``weight`` [channels, 1, width] and ``bias`` (the mixer applies them)."""

    def __init__(self, channels: int, width: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, width, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(channels, dtype=dtype), requires_grad=False) if bias else None


class _GatedNorm(nn.Module):
    """RMSNorm of y · silu(z) over groups of `group_size` channels, then × weight (float32 inside)."""

    def __init__(self, size: int, group_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.group_size = group_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = y.float() * F.silu(z.float())
        groups = y.view(*y.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * groups.view(y.shape)
