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

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.device_utils import async_tensor_h2d
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.model.layers.linear import ReplicatedLinear
from pagedllm.model.layers.mamba_state import (
    MambaLayerCache,
    MambaStateMetadata,
    MambaStateShape,
    clear_state_slots,
)

# Tokens per block of the chunked scan. Its within-block terms cost ~block tokens of work per token, the carry across
# blocks a few small ops per block: on a GPU those launches dominate (long blocks), on a CPU the work does (short ones;
# 32 against 128: the prefill of 32 prompts of 16-128 tokens 2.32 -> 1.80 s on the 83M Bamba of BENCHMARKS §81).
GPU_CHUNK_SIZE = 128
CPU_CHUNK_SIZE = 32


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


@dataclass
class ScanLayout:
    """How ssd_varlen_scan packs a step's chunks into blocks (the same for every layer of the step: built once)."""

    length: int  # tokens per block
    blocks: list[int]  # blocks per sequence
    index: torch.Tensor  # [blocks · length] each block row's token in the packed input (padding: the token count)
    tokens: torch.Tensor  # [T] the block rows that hold tokens, in token order
    cut_blocks: torch.Tensor | None  # the blocks a cut starts, in sequence then offset order
    first_block: torch.Tensor  # [S] int32, each sequence's first block (for the carry kernel)
    block_counts: torch.Tensor  # [S] int32


def scan_layout(lens: list[int], chunk_size: int, cuts: list[list[int]] | None, device: torch.device) -> ScanLayout:
    """ssd_varlen_scan's packing of chunks of `lens` tokens (and `cuts`, as it takes them) into `chunk_size` blocks."""
    total, length = sum(lens), chunk_size
    # Each cut starts a new block (the block before it padded: a padding row has dt = 0, so it leaves the state as
    # it is), so the state a cut wants is the one its block starts from.
    segments = [np.diff([0, *(cuts[i] if cuts else ()), n]) for i, n in enumerate(lens)]
    blocks = [int(sum(-(-m // length) for m in seg)) for seg in segments]
    rows = np.full(sum(blocks) * length, total, dtype=np.int64)
    cut_blocks: list[int] = []
    at = offset = 0
    for seg in segments:
        for j, m in enumerate(seg):
            if j:
                cut_blocks.append(at // length)
            rows[at: at + m] = np.arange(offset, offset + m)
            at += -(-m // length) * length
            offset += m
    return ScanLayout(length, blocks, async_tensor_h2d(rows, torch.long, device),
                      # the blocks hold the tokens in order, so the non-padding rows are the output (found here: indexing
                      # by a device mask would wait for the device)
                      async_tensor_h2d(np.flatnonzero(rows < total), torch.long, device),
                      async_tensor_h2d(cut_blocks, torch.long, device) if cut_blocks else None,
                      async_tensor_h2d(np.cumsum([0] + blocks[:-1]), torch.int32, device),
                      async_tensor_h2d(blocks, torch.int32, device))


def ssd_varlen_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                    initial_states: torch.Tensor, lens: list[int], chunk_size: int,
                    cuts: list[list[int]] | None = None, layout: ScanLayout | None = None,
                    kernels: bool | None = None,
                    d: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The selective scan of several sequences packed one after another, in the chunked SSD form (the Mamba-2 paper's
    ``ssd_minimal_discrete`` with initial states; float32 throughout).

    x [T, h, p], dt [T, h] (already softplus'd and clamped), a [h] (negative), b / c [T, g, n] (one per group of
    h / g heads), initial_states [S, h, p, n], `lens` the S sequences' token counts (summing to T); `cuts` (optional):
    per sequence, ascending offsets 0 < q < its length after whose first q tokens the state is wanted as well.
    Returns (y [T, h, p], with the skip D·x where `d` [h] is given, final states [S, h, p, n], the states at the cuts [K, h, p, n] in
    sequence then offset order, or None without cuts). `layout`: scan_layout(lens, chunk_size, cuts), if already
    built. `kernels`: the Triton kernels (the default on a GPU) or the torch form (the default on a CPU)."""
    layout = layout or scan_layout(lens, chunk_size, cuts, x.device)
    use_kernels = x.is_cuda if kernels is None else kernels
    if use_kernels:
        from pagedllm.kernels.triton_mamba import ssd_carry_states, ssd_chunk_outputs, ssd_chunk_states

        a_cum, block_states, block_decay = ssd_chunk_states(x, dt, a, b, layout.index, layout.length)
        starts, states = ssd_carry_states(initial_states.contiguous(), block_states, block_decay, layout.first_block,
                                          layout.block_counts)
        out = ssd_chunk_outputs(x, dt, b, c, layout.index, a_cum, starts, d)
    else:
        out, states, starts = _ssd_scan_torch(x, dt, a, b, c, initial_states, layout)
        if d is not None:
            out = out + x * d.float()[:, None]
    cut_states = starts.index_select(0, layout.cut_blocks) if layout.cut_blocks is not None else None
    return out, states, cut_states


def _ssd_scan_torch(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                    initial_states: torch.Tensor, layout: ScanLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ssd_varlen_scan in torch ops on padded blocks → (y, final states, each block's start)."""
    total, heads, head_dim = x.shape
    groups, d_state = b.shape[1], b.shape[2]
    per_group = heads // groups
    length, nb, index = layout.length, sum(layout.blocks), layout.index
    pad = lambda t: torch.cat([t, t.new_zeros(1, *t.shape[1:])])  # noqa: E731
    xd = pad(x * dt[..., None])[index].view(nb, length, groups, per_group, head_dim)  # [c, l, g, k, p]
    bb = pad(b)[index].view(nb, length, groups, d_state)  # [c, l, g, n]
    cc = pad(c)[index].view(nb, length, groups, d_state)
    a_cum = torch.cumsum(pad(a * dt)[index].view(nb, length, heads).permute(2, 0, 1), dim=-1)  # [h, c, l]; padding: 0

    to_end = torch.exp(a_cum[..., -1:] - a_cum).permute(1, 2, 0).reshape(nb, length, groups, per_group, 1)
    block_states = torch.einsum("clgn,clgkp->cgkpn", bb, xd * to_end).reshape(nb, heads, head_dim, d_state)
    block_decay = torch.exp(a_cum[..., -1]).transpose(0, 1)  # [c, h]
    starts, states = _carry_states(initial_states, block_states, block_decay, layout)
    y = _block_outputs_torch(xd, bb, cc, a_cum, starts)
    return y.reshape(nb * length, heads, head_dim).index_select(0, layout.tokens), states, starts


def _block_outputs_torch(xd: torch.Tensor, bb: torch.Tensor, cc: torch.Tensor, a_cum: torch.Tensor,
                         starts: torch.Tensor) -> torch.Tensor:
    """Every block's outputs [c, l, g, k, p]: within the block y[l] = sum over s <= l of (C[l]·B[s]) exp(a_cum[l] -
    a_cum[s]) xd[s] (C·B once per group), plus exp(a_cum[l]) C[l]·start from the state the block starts from.
    (kernels/triton_mamba.py's ssd_chunk_outputs is the same sums in one launch, for GPUs.)"""
    nb, length, groups, per_group, head_dim = xd.shape
    causal = torch.ones(length, length, dtype=torch.bool, device=xd.device).tril()
    decay = (a_cum[..., :, None] - a_cum[..., None, :]).masked_fill_(~causal, -math.inf).exp_()  # [h, c, l, s]
    scores = decay.view(groups, per_group, nb, length, length).mul_(
        torch.einsum("clgn,csgn->gcls", cc, bb)[:, None])
    y = torch.einsum("gkcls,csgkp->clgkp", scores, xd)
    from_start = torch.exp(a_cum).permute(1, 2, 0).reshape(nb, length, groups, per_group, 1)
    y += torch.einsum("clgn,cgkpn->clgkp", cc, starts.view(nb, groups, per_group, head_dim, -1)) * from_start
    return y


def _carry_states(initial_states: torch.Tensor, block_states: torch.Tensor, block_decay: torch.Tensor,
                  layout: ScanLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The state each block starts from [c, h, p, n], and each sequence's state after its last block [S, h, p, n]:
    state ← state · block_decay + block_state along each sequence's blocks, in turn, on views (no gathers; on a GPU
    kernels/triton_mamba.py's ssd_carry_states does it in one launch)."""
    states = initial_states.clone()
    starts = torch.empty_like(block_states)  # every block's start is written below
    first = 0
    for i, count in enumerate(layout.blocks):
        state = states[i]
        for j in range(first, first + count):
            starts[j] = state
            state = torch.addcmul(block_states[j], state, block_decay[j][:, None, None])
        states[i] = state
        first += count
    return starts, states


@dataclass
class ConvLayout:
    """Where causal_conv_prefill puts each chunk's saved inputs and tokens (the same for every layer of the step)."""

    token_row: torch.Tensor  # [T] each token's row in ext (each sequence's saved inputs, then its chunk's inputs)
    prev_rows: torch.Tensor  # [S · width] the saved inputs' rows
    last_rows: torch.Tensor  # [S, width] each sequence's last `width` rows
    cut_rows: torch.Tensor | None  # [K, width] the `width` rows before each cut
    # for the GPU kernel (int32): each token's sequence and offset, each chunk's first token and length, the cuts'
    token_seq: torch.Tensor
    token_off: torch.Tensor
    chunk_start: torch.Tensor
    chunk_len: torch.Tensor
    cut_seq: torch.Tensor | None
    cut_off: torch.Tensor | None


def conv_layout(lens: list[int], width: int, cuts: list[tuple[int, int]], device: torch.device) -> ConvLayout:
    """causal_conv_prefill's rows for chunks of `lens` tokens, a conv of `width` + 1 taps, and (sequence, offset)
    `cuts`."""
    ext_start = np.cumsum([0] + [width + m for m in lens[:-1]])
    token_row = np.concatenate([np.arange(m) + e + width for e, m in zip(ext_start, lens)])
    prev_rows = (ext_start[:, None] + np.arange(width)).reshape(-1)
    last_rows = (ext_start + np.asarray(lens))[:, None] + np.arange(width)
    # the inputs before offset q sit q rows after the sequence's start in ext (its saved inputs first)
    cut_rows = np.asarray([ext_start[i] + q for i, q in cuts])[:, None] + np.arange(width) if cuts else None
    starts = np.cumsum([0] + lens[:-1])
    token_seq = np.repeat(np.arange(len(lens)), lens)
    i32 = lambda a: async_tensor_h2d(np.asarray(a, dtype=np.int32), torch.int32, device)  # noqa: E731
    return ConvLayout(*(async_tensor_h2d(r, torch.long, device) for r in (token_row, prev_rows, last_rows)),
                      async_tensor_h2d(cut_rows, torch.long, device) if cuts else None,
                      i32(token_seq), i32(np.arange(sum(lens)) - starts[token_seq]), i32(starts), i32(lens),
                      i32([i for i, _ in cuts]) if cuts else None, i32([q for _, q in cuts]) if cuts else None)


def causal_conv_prefill(xbc: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                        bias: torch.Tensor | None, slot_t: torch.Tensor, lens: list[int],
                        cuts: list[tuple[int, int]] = (), cut_slots: torch.Tensor | None = None,
                        layout: ConvLayout | None = None, kernels: bool | None = None) -> torch.Tensor:
    """SiLU(causal depthwise conv) of every chunk of packed `xbc` [T, C] (`lens` tokens each) → [T, C] float32, each
    chunk after its slot's saved inputs (`conv_state` [slots, C, d_conv - 1]); the slots `slot_t` then hold each chunk's
    last d_conv - 1 inputs. `cuts` (sequence, offset): slot `cut_slots[j]` gets the d_conv - 1 inputs before that
    offset of that chunk (prefix caching's snapshots). `layout`: conv_layout(lens, d_conv - 1, cuts), if built.
    `kernels`: kernels/triton_mamba.py's conv_prefill (the default on a GPU) or torch ops (the default on a CPU)."""
    channels = xbc.shape[1]
    width = conv_state.shape[2]
    n = len(lens)
    layout = layout or conv_layout(lens, width, cuts, xbc.device)
    if (xbc.is_cuda if kernels is None else kernels) and xbc.stride(1) == 1:
        from pagedllm.kernels.triton_mamba import conv_prefill

        return conv_prefill(xbc, conv_state, conv_weight, bias, slot_t, layout.token_seq, layout.token_off,
                            layout.chunk_start, layout.chunk_len, layout.cut_seq, layout.cut_off, cut_slots)
    token_row = layout.token_row
    prev = conv_state.index_select(0, slot_t).float().transpose(1, 2)  # [n, width, C]
    ext = xbc.new_zeros(xbc.shape[0] + n * width, channels, dtype=torch.float32)
    ext[token_row] = xbc.float()
    ext[layout.prev_rows] = prev.reshape(-1, channels)
    weight = conv_weight.float()[:, 0]  # [C, d_conv]
    out = ext[token_row - width] * weight[:, 0]
    for k in range(1, width + 1):
        out += ext[token_row - width + k] * weight[:, k]
    if bias is not None:
        out += bias
    conv_state.index_copy_(0, slot_t, ext[layout.last_rows].transpose(1, 2).to(conv_state.dtype))
    if layout.cut_rows is not None:
        conv_state.index_copy_(0, cut_slots, ext[layout.cut_rows].transpose(1, 2).to(conv_state.dtype))
    return F.silu(out)


def _block_size(lens: list[int], device: torch.device) -> int:
    """The scan's block for this step: the device's, or less where every chunk is shorter (a block per sequence at
    least, so many short chunks would otherwise be mostly padding: 900 prompts of 9 tokens in 128-token blocks took
    33 GiB of temporaries on an H100)."""
    base = GPU_CHUNK_SIZE if device.type == "cuda" else CPU_CHUNK_SIZE
    longest = max(lens, default=1)
    return min(base, max(16, 1 << (longest - 1).bit_length()))


@dataclass
class PrefillPlan:
    """What every Mamba-2 layer of a step needs about its prefill chunks (sequences `first`..): their slots, the
    state snapshots inside them (prefix caching), and the conv's and scan's layouts. Built by the step's first layer."""

    slots: torch.Tensor  # [S] each chunk's slot
    conv_cuts: list[tuple[int, int]]  # (sequence, offset) per snapshot, in order
    scan_cuts: list[list[int]] | None  # per sequence its offsets, or None without snapshots
    cut_slots: torch.Tensor | None  # each snapshot's slot, in that order
    conv: ConvLayout
    scan: ScanLayout

    @classmethod
    def build(cls, state_meta: MambaStateMetadata, first: int, lens: list[int], conv_width: int, chunk_size: int,
              device: torch.device) -> PrefillPlan:
        n = len(lens)
        wanted = sorted((row - first, offset, slot) for row, offset, slot in state_meta.cuts if first <= row < first + n)
        conv_cuts = [(i, q) for i, q, _ in wanted]
        scan_cuts = [[q for i, q, _ in wanted if i == seq] for seq in range(n)] if wanted else None
        return cls(async_tensor_h2d(state_meta.state_indices_cpu[first: first + n], torch.long, device), conv_cuts,
                   scan_cuts, async_tensor_h2d([slot for _, _, slot in wanted], torch.long, device) if wanted else None,
                   conv_layout(lens, conv_width, conv_cuts, device), scan_layout(lens, chunk_size, scan_cuts, device))


class Mamba2Mixer(nn.Module):
    """A Mamba-2 mixer with HF checkpoint names: ``in_proj``, ``conv1d.weight`` [conv_dim, 1, d_conv],
    ``conv1d.bias``, ``dt_bias``, ``A_log``, ``D``, ``norm.weight``, ``out_proj``.

    ``forward(hidden [T, hidden], cache, meta)`` advances every sequence of the step from its slot's state (zeros
    where ``has_initial_state`` is False) and leaves the state after its last token in the slot."""

    def __init__(self, dims: Mamba2Dims, tp: TensorParallelGroup, dtype: torch.dtype,
                 chunk_size: int | None = None) -> None:
        super().__init__()
        validate_dims(dims, tp)
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be positive (None: by device), got {chunk_size}")
        self.dims = dims
        self.chunk_size = chunk_size
        # prefill chunks through the Triton kernels (True), torch ops (False) or by device (None: kernels on a GPU)
        self.prefill_kernels: bool | None = None
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
        if offset + sum(query_lens[nd:]) != hidden.shape[0]:
            raise ValueError(f"the step's query lengths sum to {sum(query_lens)}, but hidden has {hidden.shape[0]} "
                             "rows")
        if offset < hidden.shape[0]:
            y[offset:] = self._prefill_batch(xbc[offset:], dt[offset:], a, cache, state_meta, nd, query_lens[nd:])
        return self.out_proj(self.norm(y, z, hidden.dtype, self.prefill_kernels))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """[T, n_groups, d_state] → [T, heads, d_state] (each group's B or C shared by its heads)."""
        d = self.dims
        return t[:, :, None].expand(-1, -1, d.num_heads // d.n_groups, -1).reshape(t.shape[0], d.num_heads, d.d_state)

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, conv_dim] → x [T, heads, head_dim], B and C [T, n_groups, d_state] float32."""
        d = self.dims
        x, b, c = xbc.split([d.intermediate, d.n_groups * d.d_state, d.n_groups * d.d_state], dim=-1)
        return (x.reshape(x.shape[0], d.num_heads, d.head_dim), b.float().reshape(b.shape[0], d.n_groups, d.d_state),
                c.float().reshape(c.shape[0], d.n_groups, d.d_state))

    def _prefill_batch(self, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, cache: MambaLayerCache,
                       state_meta: MambaStateMetadata, first: int, lens: list[int]) -> torch.Tensor:
        """Every prefill chunk of the step at once (sequences `first`.. of the batch, `lens` tokens each, packed in
        `xbc` / `dt`) → y [sum(lens), intermediate] float32; each slot ends at its chunk's last token.

        The conv reads each chunk after its sequence's saved inputs; the scan splits every chunk into blocks of
        `chunk_size` tokens (the last padded with dt = 0: decay 1, no input), runs the within-block terms of all
        blocks of all sequences together, and carries the state across each sequence's blocks (on a GPU: Triton
        kernels, see ssd_varlen_scan)."""
        d = self.dims
        dev = xbc.device
        fresh = state_meta.fresh_slots(first, first + len(lens))
        if fresh:
            clear_state_slots([cache], fresh)
        chunk_size = self.chunk_size or _block_size(lens, dev)
        plan = state_meta.per_step(("mamba2 prefill", first, d.d_conv - 1, chunk_size),
                                   lambda: PrefillPlan.build(state_meta, first, lens, d.d_conv - 1, chunk_size, dev))
        x, b, c = self._split_xbc(causal_conv_prefill(xbc, cache.conv_state, self.conv1d.weight, self._conv_bias(),
                                                      plan.slots, lens, plan.conv_cuts, plan.cut_slots, plan.conv,
                                                      self.prefill_kernels))
        step = self._time_step(dt)
        low, high = d.time_step_limit
        if low > 0 or high < math.inf:
            step = step.clamp(low, high)
        y, final, at_cuts = ssd_varlen_scan(x.float(), step, a, b, c,
                                            cache.ssm_state.index_select(0, plan.slots).float(), lens, chunk_size,
                                            plan.scan_cuts, plan.scan, self.prefill_kernels, self.D)
        cache.ssm_state.index_copy_(0, plan.slots, final.to(cache.ssm_state.dtype))
        if at_cuts is not None:
            cache.ssm_state.index_copy_(0, plan.cut_slots, at_cuts.to(cache.ssm_state.dtype))
        return y.reshape(y.shape[0], d.intermediate)

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, cache: MambaLayerCache,
                state_meta: MambaStateMetadata, nd: int) -> torch.Tensor:
        """One token for each of the first `nd` sequences, all at once → y [nd, intermediate] float32."""
        d = self.dims
        slots = state_meta.state_indices[:nd]
        if xbc.is_cuda:
            return self._decode_in_place(xbc, dt, cache, state_meta, nd)
        native = self._native_cpu(xbc, cache)
        if native is not None:  # the C kernels update the slots in place (a third of the gather/scatter's traffic)
            clear_state_slots([cache], state_meta.fresh_slots(0, nd))
            return native.mamba_decode(xbc, dt, self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log,
                                       self.D, cache.conv_state, cache.ssm_state, slots, d.n_groups)
        conv_prev = cache.conv_state.index_select(0, slots).float()  # [nd, conv_dim, width]
        ssm_prev = cache.ssm_state.index_select(0, slots).float()  # [nd, h, p, n]
        fresh = [i for i in state_meta.fresh_rows if i < nd]
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
        x, b, c = x.float(), self._heads(b), self._heads(c)
        step = self._time_step(dt)  # [nd, h]
        decay = torch.exp(step * a)  # [nd, h]
        state = ssm_prev * decay[:, :, None, None] + (step[:, :, None] * x)[..., None] * b[:, :, None, :]
        cache.ssm_state.index_copy_(0, slots, state.to(cache.ssm_state.dtype))
        y = torch.einsum("bhpn,bhn->bhp", state, c) + x * self.D.float()[:, None]
        return y.reshape(nd, d.intermediate)

    def _decode_in_place(self, xbc: torch.Tensor, dt: torch.Tensor, cache: MambaLayerCache,
                         state_meta: MambaStateMetadata, nd: int) -> torch.Tensor:
        """`_decode` on the GPU: the Triton kernels update each slot in place (kernels/triton_mamba.py). A row that
        starts from zeros has its slot cleared first (a captured graph's rows all continue: the graph runner clears
        the slots of fresh ones before it replays)."""
        from pagedllm.kernels.triton_mamba import conv_state_update, ssm_state_update

        slots = state_meta.state_indices[:nd]
        clear_state_slots([cache], state_meta.fresh_slots(0, nd))
        conv = conv_state_update(xbc, cache.conv_state, self.conv1d.weight, self.conv1d.bias, slots)
        return ssm_state_update(conv, dt, self.dt_bias, self.A_log, self.D, cache.ssm_state, slots,
                                self.dims.n_groups)

    @staticmethod
    def _native_cpu(xbc: torch.Tensor, cache: MambaLayerCache) -> Any:
        """The CPU's native kernels where they can run this layer's decode (float32 throughout), else None."""
        if xbc.dtype != torch.float32 or cache.ssm_state.dtype != torch.float32 \
                or cache.conv_state.dtype != torch.float32:
            return None
        from pagedllm.kernels.cpu_kernels import load_cpu_kernels

        return load_cpu_kernels()

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

    def forward(self, y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype | None = None,
                kernel: bool | None = None) -> torch.Tensor:
        """→ [T, size] in `out_dtype` (default float32); `kernel`: kernels/triton_mamba.py's gated_rms_norm (the
        default on a GPU) or torch ops."""
        out_dtype = out_dtype or torch.float32
        if (y.is_cuda if kernel is None else kernel) and y.dim() == 2 and y.stride(1) == 1 and z.stride(1) == 1:
            from pagedllm.kernels.triton_mamba import gated_rms_norm

            return gated_rms_norm(y, z, self.weight, self.group_size, self.eps, out_dtype)
        y = y.float() * F.silu(z.float())
        groups = y.view(*y.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * groups.view(y.shape)).to(out_dtype)
