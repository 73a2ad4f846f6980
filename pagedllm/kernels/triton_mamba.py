"""Mamba-2 decode on the GPU: one token per sequence, the state read and written in place in its slot.

Two kernels per layer and step: the causal depthwise conv's update (its last ``d_conv - 1`` inputs shift by one, the
new input joins them, SiLU) and the selective-state update (``h = exp(dt·A)·h + dt·x ⊗ B``, ``y = h·C + D·x``, with
dt = softplus(dt + dt_bias)). Each reads a sequence's state once and writes it back once, where gathering the slots
into a batch and scattering them back (the torch path, ``model/layers/mamba2.py``) moves the state three times; and the
slots come from a device tensor, so a captured CUDA graph replays them for any slots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_state_update_kernel(x_ptr, state_ptr, weight_ptr, bias_ptr, slots_ptr, out_ptr, channels,
                              stride_xb, stride_ss, stride_sc, stride_sk, stride_wc, stride_ob,
                              WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = c < channels
    slot = tl.load(slots_ptr + row).to(tl.int64)
    x = tl.load(x_ptr + row * stride_xb + c, mask=mask, other=0.0).to(tl.float32)
    acc = tl.load(weight_ptr + c * stride_wc + WIDTH, mask=mask, other=0.0).to(tl.float32) * x
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=mask, other=0.0).to(tl.float32)
    base = state_ptr + slot * stride_ss + c * stride_sc
    prev = tl.load(base, mask=mask, other=0.0)
    for k in tl.static_range(WIDTH):
        acc += tl.load(weight_ptr + c * stride_wc + k, mask=mask, other=0.0).to(tl.float32) * prev.to(tl.float32)
        if k + 1 < WIDTH:
            nxt = tl.load(base + (k + 1) * stride_sk, mask=mask, other=0.0)
            tl.store(base + k * stride_sk, nxt, mask=mask)
            prev = nxt
    tl.store(base + (WIDTH - 1) * stride_sk, x.to(state_ptr.dtype.element_ty), mask=mask)
    out = acc / (1.0 + tl.exp(-acc))  # SiLU
    tl.store(out_ptr + row * stride_ob + c, out, mask=mask)


def conv_state_update(xbc: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      slots: torch.Tensor) -> torch.Tensor:
    """One conv step for each row: xbc [B, C] (this token's conv input), conv_state [slots, C, W] updated in place at
    `slots` [B], weight [C, 1, W + 1] → SiLU(conv) [B, C] float32."""
    batch, channels = xbc.shape
    width = conv_state.shape[2]
    if weight.shape[-1] != width + 1:
        raise ValueError(f"conv weight width {weight.shape[-1]} does not match the state's {width} + 1")
    out = torch.empty(batch, channels, dtype=torch.float32, device=xbc.device)
    if batch == 0:
        return out
    w = weight.reshape(channels, width + 1)
    block = 256
    _conv_state_update_kernel[(batch, triton.cdiv(channels, block))](
        xbc, conv_state, w, bias if bias is not None else w, slots, out, channels,
        xbc.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), w.stride(0), out.stride(0),
        WIDTH=width, HAS_BIAS=bias is not None, BLOCK_C=block)
    return out


@triton.jit(do_not_specialize=["rows"])
def _gated_rms_norm_kernel(y_ptr, z_ptr, w_ptr, out_ptr, rows, group_size, eps, stride_yt, stride_zt, stride_ot,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < group_size
    y = tl.load(y_ptr + row * stride_yt + col, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * stride_zt + col, mask=mask, other=0.0).to(tl.float32)
    v = y * (z / (1.0 + tl.exp(-z)))
    v = v * (1.0 / tl.sqrt(tl.sum(v * v, axis=0) / group_size + eps))
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_ot + col, (v * w).to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """The Mamba-2 mixer's gated norm in one launch: RMSNorm of y · silu(z) over groups of `group_size` channels, ×
    weight, computed in float32 → [T, size] `out_dtype`. y, z [T, size] with contiguous rows."""
    rows, size = y.shape
    if z.shape != y.shape or weight.numel() != size or size % group_size or y.stride(1) != 1 or z.stride(1) != 1:
        raise ValueError(f"gated_rms_norm: y {tuple(y.shape)}, z {tuple(z.shape)}, weight {tuple(weight.shape)}, "
                         f"groups of {group_size} (rows contiguous) do not match")
    out = torch.empty(rows, size, dtype=out_dtype, device=y.device)
    if rows:
        _gated_rms_norm_kernel[(rows, size // group_size)](
            y, z, weight, out, rows, group_size, eps, y.stride(0), z.stride(0), out.stride(0),
            BLOCK=triton.next_power_of_2(group_size), num_warps=8 if group_size >= 2048 else 4)
    return out


CONV_PREFILL_TOKENS = 16  # tokens per program of the prefill conv
CONV_PREFILL_CHANNELS = 128  # channels per program


@triton.jit(do_not_specialize=["tokens"])
def _conv_prefill_kernel(x_ptr, state_ptr, weight_ptr, bias_ptr, token_seq_ptr, token_off_ptr, slots_ptr, out_ptr,
                         tokens, channels, stride_xt, stride_ss, stride_sc, stride_sk, stride_wc, stride_ot,
                         WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = t < tokens
    c_ok = c < channels
    seq = tl.load(token_seq_ptr + t, mask=t_ok, other=0)
    off = tl.load(token_off_ptr + t, mask=t_ok, other=0)
    slot = tl.load(slots_ptr + seq, mask=t_ok, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(WIDTH + 1):
        # tap k reads the input WIDTH - k tokens back: this chunk's, or before its start the slot's saved inputs
        back = off - WIDTH + k
        in_chunk = back >= 0
        mask = t_ok[:, None] & c_ok[None, :]
        xv = tl.load(x_ptr + (t - WIDTH + k).to(tl.int64)[:, None] * stride_xt + c[None, :],
                     mask=mask & in_chunk[:, None], other=0.0).to(tl.float32)
        sv = tl.load(state_ptr + slot[:, None] * stride_ss + c[None, :] * stride_sc
                     + (WIDTH + back)[:, None] * stride_sk, mask=mask & (~in_chunk)[:, None], other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + c * stride_wc + k, mask=c_ok, other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    out = acc / (1.0 + tl.exp(-acc))  # SiLU
    tl.store(out_ptr + t.to(tl.int64)[:, None] * stride_ot + c[None, :], out, mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def _conv_prefill_state_kernel(x_ptr, state_ptr, src_slot_ptr, dst_slot_ptr, start_ptr, end_ptr, channels,
                               stride_xt, stride_ss, stride_sc, stride_sk, WIDTH: tl.constexpr,
                               BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < channels
    src = tl.load(src_slot_ptr + i).to(tl.int64)
    dst = tl.load(dst_slot_ptr + i).to(tl.int64)
    start = tl.load(start_ptr + i).to(tl.int64)  # the chunk's first token
    end = tl.load(end_ptr + i)  # the offset the saved inputs end at
    # the WIDTH inputs before offset `end`: the chunk's, or for a short one the source slot's saved ones (all read
    # before any is written: the source may be the destination)
    k = tl.arange(0, BLOCK_W)
    back = end - WIDTH + k
    in_chunk = back >= 0
    mask = c_ok[:, None] & (k < WIDTH)[None, :]
    xv = tl.load(x_ptr + (start + back)[None, :] * stride_xt + c[:, None], mask=mask & in_chunk[None, :], other=0.0)
    sv = tl.load(state_ptr + src * stride_ss + c[:, None] * stride_sc + (WIDTH + back)[None, :] * stride_sk,
                 mask=mask & (~in_chunk)[None, :], other=0.0)
    saved = tl.where(in_chunk[None, :], xv.to(state_ptr.dtype.element_ty), sv)
    tl.store(state_ptr + dst * stride_ss + c[:, None] * stride_sc + k[None, :] * stride_sk, saved, mask=mask)


def conv_prefill(xbc: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 slots: torch.Tensor, token_seq: torch.Tensor, token_off: torch.Tensor, chunk_start: torch.Tensor,
                 chunk_len: torch.Tensor, cut_seq: torch.Tensor | None = None, cut_off: torch.Tensor | None = None,
                 cut_slots: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU(causal depthwise conv) of packed prefill chunks: xbc [T, C] (rows contiguous), token t of sequence
    token_seq[t] at offset token_off[t] of its chunk (int32), each chunk after the WIDTH inputs saved in its slot
    (`slots` [S] of conv_state [slots, C, WIDTH]) → [T, C] float32. Then each slot holds its chunk's last WIDTH inputs
    (chunk_start / chunk_len [S] int32), and each cut's slot those before offset cut_off of chunk cut_seq (prefix
    caching's snapshots; written first, from the chunks' saved inputs as they were)."""
    tokens, channels = xbc.shape
    width = conv_state.shape[2]
    if weight.shape[-1] != width + 1 or weight.numel() != channels * (width + 1):
        raise ValueError(f"conv weight {tuple(weight.shape)} does not match {channels} channels and the state's "
                         f"{width} + 1 taps")
    if xbc.stride(1) != 1:
        raise ValueError("conv_prefill takes xbc with contiguous rows")
    out = torch.empty(tokens, channels, dtype=torch.float32, device=xbc.device)
    if tokens == 0:
        return out
    w = weight.reshape(channels, width + 1)
    strides = (conv_state.stride(0), conv_state.stride(1), conv_state.stride(2))
    _conv_prefill_kernel[(triton.cdiv(tokens, CONV_PREFILL_TOKENS), triton.cdiv(channels, CONV_PREFILL_CHANNELS))](
        xbc, conv_state, w, bias if bias is not None else w, token_seq, token_off, slots, out, tokens, channels,
        xbc.stride(0), *strides, w.stride(0), out.stride(0), WIDTH=width, HAS_BIAS=bias is not None,
        BLOCK_T=CONV_PREFILL_TOKENS, BLOCK_C=CONV_PREFILL_CHANNELS)
    updates = [] if cut_seq is None or cut_seq.numel() == 0 else [
        (slots.index_select(0, cut_seq.long()), cut_slots, chunk_start.index_select(0, cut_seq.long()), cut_off)]
    updates.append((slots, slots, chunk_start, chunk_len))
    for src, dst, start, end in updates:
        _conv_prefill_state_kernel[(src.numel(), triton.cdiv(channels, CONV_PREFILL_CHANNELS))](
            xbc, conv_state, src, dst, start, end, channels, xbc.stride(0), *strides, WIDTH=width,
            BLOCK_W=triton.next_power_of_2(width), BLOCK_C=CONV_PREFILL_CHANNELS)
    return out


@triton.jit
def _ssm_state_update_kernel(xbc_ptr, dt_ptr, dt_bias_ptr, a_log_ptr, d_ptr, state_ptr, slots_ptr, y_ptr,
                             intermediate, head_dim, d_state, heads_per_group, n_groups,
                             stride_xb, stride_db, stride_ss, stride_sh, stride_sp, stride_yb,
                             BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask = p < head_dim
    n_mask = n < d_state
    slot = tl.load(slots_ptr + row).to(tl.int64)
    dt = tl.load(dt_ptr + row * stride_db + head).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
    dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))  # softplus, as torch's (threshold 20)
    decay = tl.exp(-tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * dt)
    group = head // heads_per_group
    xrow = xbc_ptr + row * stride_xb
    x = tl.load(xrow + head * head_dim + p, mask=p_mask, other=0.0)
    b = tl.load(xrow + intermediate + group * d_state + n, mask=n_mask, other=0.0)
    c = tl.load(xrow + intermediate + (n_groups + group) * d_state + n, mask=n_mask, other=0.0)
    s_ptr = state_ptr + slot * stride_ss + head * stride_sh + p[:, None] * stride_sp + n[None, :]
    s_mask = p_mask[:, None] & n_mask[None, :]
    state = tl.load(s_ptr, mask=s_mask, other=0.0).to(tl.float32)
    state = state * decay + (dt * x)[:, None] * b[None, :]
    tl.store(s_ptr, state.to(state_ptr.dtype.element_ty), mask=s_mask)
    y = tl.sum(state * c[None, :], axis=1) + tl.load(d_ptr + head).to(tl.float32) * x
    tl.store(y_ptr + row * stride_yb + head * head_dim + p, y, mask=p_mask)


def ssm_state_update(xbc: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor,
                     d: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor, n_groups: int) -> torch.Tensor:
    """One selective-scan step for each row. xbc [B, intermediate + 2·n_groups·d_state] float32 (the conv's output:
    x, then B, then C), dt [B, heads] (before softplus), ssm_state [slots, heads, head_dim, d_state] updated in place at
    `slots` [B] → y [B, intermediate] float32 (with the D skip, before the gated norm)."""
    batch = xbc.shape[0]
    _, heads, head_dim, d_state = ssm_state.shape
    intermediate = heads * head_dim
    if xbc.shape[1] != intermediate + 2 * n_groups * d_state or xbc.stride(1) != 1 or ssm_state.stride(3) != 1:
        raise ValueError(f"xbc {tuple(xbc.shape)} does not hold x, B and C for {heads} heads of {head_dim} and "
                         f"{n_groups} groups of state {d_state} (contiguous rows and state needed)")
    y = torch.empty(batch, intermediate, dtype=torch.float32, device=xbc.device)
    if batch == 0:
        return y
    block_p = min(triton.next_power_of_2(head_dim), 16)
    _ssm_state_update_kernel[(batch, heads, triton.cdiv(head_dim, block_p))](
        xbc, dt, dt_bias, a_log, d, ssm_state, slots, y, intermediate, head_dim, d_state, heads // n_groups,
        n_groups, xbc.stride(0), dt.stride(0), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        y.stride(0), BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(d_state))
    return y


SCAN_BLOCK_D = 16  # channels per program of the selective scan


@triton.jit
def _selective_scan_kernel(x_ptr, dt_ptr, a_log_ptr, b_ptr, c_ptr, d_ptr, z_ptr, state_ptr, slots_ptr,
                           qsl_ptr, snap_ptr, y_ptr, channels, d_state,
                           stride_xt, stride_dtt, stride_bt, stride_ct, stride_zt, stride_ss, stride_sc, stride_yt,
                           HAS_SNAP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    c_mask = ch < channels
    n_mask = n < d_state
    mask = c_mask[:, None] & n_mask[None, :]
    start = tl.load(qsl_ptr + seq)
    end = tl.load(qsl_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    a = -tl.exp(tl.load(a_log_ptr + ch[:, None] * d_state + n[None, :], mask=mask, other=0.0).to(tl.float32))
    offsets = ch[:, None] * stride_sc + n[None, :]
    state = tl.load(state_ptr + slot * stride_ss + offsets, mask=mask, other=0.0).to(tl.float32)
    skip = tl.load(d_ptr + ch, mask=c_mask, other=0.0).to(tl.float32)
    for t in range(start, end):
        x = tl.load(x_ptr + t * stride_xt + ch, mask=c_mask, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * stride_dtt + ch, mask=c_mask, other=0.0).to(tl.float32)
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(dt)))  # softplus, as torch's (threshold 20)
        b = tl.load(b_ptr + t * stride_bt + n, mask=n_mask, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + t * stride_ct + n, mask=n_mask, other=0.0).to(tl.float32)
        state = state * tl.exp(dt[:, None] * a) + (dt * x)[:, None] * b[None, :]
        z = tl.load(z_ptr + t * stride_zt + ch, mask=c_mask, other=0.0).to(tl.float32)
        y = (tl.sum(state * c[None, :], axis=1) + skip * x) * (z / (1.0 + tl.exp(-z)))
        tl.store(y_ptr + t * stride_yt + ch, y, mask=c_mask)
        if HAS_SNAP:
            snap = tl.load(snap_ptr + t).to(tl.int64)
            if snap >= 0:
                tl.store(state_ptr + snap * stride_ss + offsets, state.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(state_ptr + slot * stride_ss + offsets, state.to(state_ptr.dtype.element_ty), mask=mask)


def selective_scan(x: torch.Tensor, dt: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor,
                   c: torch.Tensor, d: torch.Tensor, z: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor,
                   query_start_loc: torch.Tensor, lens: list[int],
                   snapshots: list[tuple[int, int, int]] = ()) -> torch.Tensor:
    """Mamba-1's selective scan of packed sequences (prefill chunks and decode rows alike), each block of channels'
    state in registers while it walks its sequence's tokens. x [T, D] float32 (the conv's output), dt [T, D] (dt_proj's
    output, before softplus), a_log [D, N], b / c [T, N], d [D], z [T, D] (the gate); sequence i (tokens
    query_start_loc[i]..[i+1]) continues from slot slots[i] of ssm_state [slots, D, 1, N], left at its last token.
    `snapshots` (sequence, offset, slot): that slot also gets the state after the sequence's first `offset` tokens.
    Returns y = (h·C + D·x) · silu(z) [T, D] float32."""
    tokens, channels = x.shape
    d_state = a_log.shape[1]
    if ssm_state.shape[1:] != (channels, 1, d_state) or ssm_state.stride(3) != 1:
        raise ValueError(f"ssm_state {tuple(ssm_state.shape)} is not [slots, {channels}, 1, {d_state}] (contiguous)")
    y = torch.empty(tokens, channels, dtype=torch.float32, device=x.device)
    num_seqs = len(lens)
    if tokens == 0:
        return y
    snap = y  # unused without snapshots
    if snapshots:
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        at = [-1] * tokens
        for seq, offset, slot in snapshots:
            at[starts[seq] + offset - 1] = slot
        snap = torch.tensor(at, dtype=torch.int32).to(x.device, non_blocking=True)
    # narrow channel blocks: a long prompt's tokens are walked by many programs side by side; one block size for every
    # batch, so the engine's warm-up steps compile every variant a request can meet (with and without snapshots)
    _selective_scan_kernel[(num_seqs, triton.cdiv(channels, SCAN_BLOCK_D))](
        x, dt, a_log, b, c, d, z, ssm_state, slots, query_start_loc, snap, y, channels, d_state,
        x.stride(0), dt.stride(0), b.stride(0), c.stride(0), z.stride(0), ssm_state.stride(0), ssm_state.stride(1),
        y.stride(0), HAS_SNAP=bool(snapshots), BLOCK_D=SCAN_BLOCK_D, BLOCK_N=triton.next_power_of_2(d_state))
    return y


# The chunked Mamba-2 scan (SSD) of a step's prefill chunks in three launches per layer, reading the packed tokens in
# place through the block layout's row map (model/layers/mamba2.py's ScanLayout: each block's rows, padding rows past
# the token count), so no padded copies of x, dt, B or C are made: the blocks' states and within-block cumulative
# sums (ssd_chunk_states), the carry across each sequence's blocks (ssd_carry_states), every token's output
# (ssd_chunk_outputs). Dots run in three TF32 passes (``tf32x3``: float32's precision on tensor cores); tiles of 16
# or 32 rows and these warp counts compiled for sm_90 without spilling registers, larger ones spilled.
SSD_ROWS = 16  # output rows (and input rows per inner step) of one program of ssd_chunk_outputs
SSD_STATE_ROWS = 32  # rows per inner step of ssd_chunk_states
SSD_PRECISION = "tf32x3"


@triton.jit(do_not_specialize=["num_blocks", "length", "total"])
def _ssd_chunk_state_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, index_ptr, acum_ptr, state_ptr, decay_ptr, num_blocks,
                            length, total, heads, per_group, head_dim, d_state, stride_xt, stride_dtt, stride_bt,
                            PRECISION: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    blk = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // per_group
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok = p < head_dim
    n_ok = n < d_state
    a_h = tl.load(a_ptr + h).to(tl.float32)
    acum_base = acum_ptr + (h * num_blocks + blk) * length
    # first pass: the within-block cumulative sums of A·dt (padding rows add 0), and the block's total
    run = tl.sum(tl.zeros((BLOCK_L,), dtype=tl.float32), axis=0)
    for l0 in range(0, length, BLOCK_L):
        lane = l0 + tl.arange(0, BLOCK_L)
        row = tl.load(index_ptr + blk * length + lane, mask=lane < length, other=total)
        adt = a_h * tl.load(dt_ptr + row * stride_dtt + h, mask=row < total, other=0.0)
        tl.store(acum_base + lane, tl.cumsum(adt, axis=0) + run, mask=lane < length)
        run += tl.sum(adt, axis=0)
    tl.store(decay_ptr + blk * heads + h, tl.exp(run))
    # second pass: the block's state from zeros, sum over l of exp(total - acum[l]) dt[l] x[l] ⊗ B[l]
    # (the sums recomputed rather than read back: other threads of this program stored them)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    done = tl.sum(tl.zeros((BLOCK_L,), dtype=tl.float32), axis=0)
    for l0 in range(0, length, BLOCK_L):
        lane = l0 + tl.arange(0, BLOCK_L)
        row = tl.load(index_ptr + blk * length + lane, mask=lane < length, other=total)
        ok = row < total
        dt = tl.load(dt_ptr + row * stride_dtt + h, mask=ok, other=0.0)
        cum = tl.cumsum(a_h * dt, axis=0) + done
        done += tl.sum(a_h * dt, axis=0)
        weight = tl.exp(run - cum) * dt
        x = tl.load(x_ptr + row[:, None] * stride_xt + h * head_dim + p[None, :], mask=ok[:, None] & p_ok[None, :],
                    other=0.0)
        b = tl.load(b_ptr + row[:, None] * stride_bt + g * d_state + n[None, :], mask=ok[:, None] & n_ok[None, :],
                    other=0.0)
        acc += tl.dot(tl.trans(x * weight[:, None]), b, input_precision=PRECISION)
    tl.store(state_ptr + ((blk * heads + h) * head_dim + p[:, None]) * d_state + n[None, :], acc,
             mask=p_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_blocks", "length", "total"])
def _ssd_chunk_output_kernel(x_ptr, dt_ptr, b_ptr, c_ptr, d_ptr, index_ptr, acum_ptr, start_ptr, y_ptr, num_blocks,
                             length, total, heads, per_group, head_dim, d_state, stride_xt, stride_dtt, stride_bt,
                             stride_ct, stride_yt, HAS_D: tl.constexpr, PRECISION: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    tile = tl.program_id(0)
    blk = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    g = h // per_group
    lanes = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    p = tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok = p < head_dim
    n_ok = n < d_state
    rows = tl.load(index_ptr + blk * length + lanes, mask=lanes < length, other=total)
    row_ok = rows < total
    acum_base = acum_ptr + (h * num_blocks + blk) * length
    acum_l = tl.load(acum_base + lanes, mask=lanes < length, other=0.0)
    c_rows = tl.load(c_ptr + rows[:, None] * stride_ct + g * d_state + n[None, :],
                     mask=row_ok[:, None] & n_ok[None, :], other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    # within the block: y[l] += sum over s <= l of (C[l]·B[s]) exp(acum[l] - acum[s]) dt[s] x[s]
    for s0 in range(0, tile * BLOCK_M + BLOCK_M, BLOCK_M):
        col_lanes = s0 + tl.arange(0, BLOCK_M)
        cols = tl.load(index_ptr + blk * length + col_lanes, mask=col_lanes < length, other=total)
        col_ok = cols < total
        b_cols = tl.load(b_ptr + cols[:, None] * stride_bt + g * d_state + n[None, :],
                         mask=col_ok[:, None] & n_ok[None, :], other=0.0)
        scores = tl.dot(c_rows, tl.trans(b_cols), input_precision=PRECISION)
        acum_s = tl.load(acum_base + col_lanes, mask=col_lanes < length, other=0.0)
        causal = (col_lanes[None, :] <= lanes[:, None]) & col_ok[None, :]
        scores = scores * tl.exp(tl.where(causal, acum_l[:, None] - acum_s[None, :], float("-inf")))
        dt = tl.load(dt_ptr + cols * stride_dtt + h, mask=col_ok, other=0.0)
        x = tl.load(x_ptr + cols[:, None] * stride_xt + h * head_dim + p[None, :],
                    mask=col_ok[:, None] & p_ok[None, :], other=0.0)
        acc += tl.dot(scores, x * dt[:, None], input_precision=PRECISION)
    # from the state the block starts from: y[l] += exp(acum[l]) C[l]·start
    start = tl.load(start_ptr + ((blk * heads + h) * head_dim + p[:, None]) * d_state + n[None, :],
                    mask=p_ok[:, None] & n_ok[None, :], other=0.0)
    acc += tl.dot(c_rows, tl.trans(start), input_precision=PRECISION) * tl.exp(acum_l)[:, None]
    if HAS_D:  # the skip: + D·x
        acc += tl.load(d_ptr + h).to(tl.float32) * tl.load(
            x_ptr + rows[:, None] * stride_xt + h * head_dim + p[None, :], mask=row_ok[:, None] & p_ok[None, :],
            other=0.0)
    tl.store(y_ptr + rows[:, None] * stride_yt + h * head_dim + p[None, :], acc, mask=row_ok[:, None] & p_ok[None, :])


def _check_scan_inputs(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> None:
    total, heads, head_dim = x.shape
    if x.dtype != torch.float32 or dt.dtype != torch.float32 or b.dtype != torch.float32:
        raise ValueError(f"the chunked scan's kernels take float32 x, dt, B / C, got {x.dtype}, {dt.dtype}, {b.dtype}")
    if x.stride(2) != 1 or x.stride(1) != head_dim or dt.shape != (total, heads) or dt.stride(1) != 1 \
            or b.shape[0] != total or b.stride(2) != 1 or b.stride(1) != b.shape[2] or heads % b.shape[1]:
        raise ValueError(f"the chunked scan's kernels take x [T, h, p], dt [T, h], B / C [T, g, n] with contiguous "
                         f"rows (heads a multiple of groups), got {tuple(x.shape)}, {tuple(dt.shape)}, "
                         f"{tuple(b.shape)}")
    if index.dtype != torch.long or index.dim() != 1:
        raise ValueError("the block layout's row map must be a 1-D int64 tensor")


def ssd_chunk_states(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: torch.Tensor,
                     length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, h, p], dt [T, h] (softplus'd), a [h] (negative), b [T, g, n], float32 with contiguous rows; `index`
    [blocks · length] int64: each block row's token (T for padding) → (a_cum [h, blocks, length] the within-block
    cumulative sums of A·dt, the blocks' states from zeros [blocks, h, p, n], their decays exp(sum of A·dt) [blocks,
    h]), float32."""
    _check_scan_inputs(x, dt, b, index)
    total, heads, head_dim = x.shape
    groups, d_state = b.shape[1], b.shape[2]
    num_blocks = index.numel() // length
    a_cum = torch.empty(heads, num_blocks, length, dtype=torch.float32, device=x.device)
    states = torch.empty(num_blocks, heads, head_dim, d_state, dtype=torch.float32, device=x.device)
    decay = torch.empty(num_blocks, heads, dtype=torch.float32, device=x.device)
    if num_blocks:
        _ssd_chunk_state_kernel[(num_blocks, heads)](
            x, dt, a.float().contiguous(), b, index, a_cum, states, decay, num_blocks, length, total, heads,
            heads // groups, head_dim, d_state, x.stride(0), dt.stride(0), b.stride(0), PRECISION=SSD_PRECISION,
            BLOCK_L=SSD_STATE_ROWS, BLOCK_P=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_N=max(16, triton.next_power_of_2(d_state)), num_warps=8)
    return a_cum, states, decay


def ssd_chunk_outputs(x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor, index: torch.Tensor,
                      a_cum: torch.Tensor, starts: torch.Tensor, d: torch.Tensor | None = None) -> torch.Tensor:
    """Every token's output of the chunked scan → y [T, h, p] float32: within its block, and from the state its block
    starts from (`starts` [blocks, h, p, n]), plus D·x where `d` [h] is given; inputs as ssd_chunk_states takes them,
    c as b."""
    _check_scan_inputs(x, dt, c, index)
    total, heads, head_dim = x.shape
    groups, d_state = b.shape[1], b.shape[2]
    num_blocks, length = a_cum.shape[1], a_cum.shape[2]
    if b.shape != c.shape or b.stride() != c.stride() or starts.shape != (num_blocks, heads, head_dim, d_state) \
            or not (starts.is_contiguous() and a_cum.is_contiguous()):
        raise ValueError(f"ssd_chunk_outputs: B {tuple(b.shape)}, C {tuple(c.shape)}, starts {tuple(starts.shape)} "
                         f"do not match (contiguous a_cum and starts needed)")
    y = torch.empty(total, heads, head_dim, dtype=torch.float32, device=x.device)
    if num_blocks:
        _ssd_chunk_output_kernel[(triton.cdiv(length, SSD_ROWS), num_blocks, heads)](
            x, dt, b, c, d if d is not None else x, index, a_cum, starts, y, num_blocks, length, total, heads,
            heads // groups, head_dim, d_state, x.stride(0), dt.stride(0), b.stride(0), c.stride(0), y.stride(0),
            HAS_D=d is not None, PRECISION=SSD_PRECISION,
            BLOCK_M=SSD_ROWS, BLOCK_P=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_N=max(16, triton.next_power_of_2(d_state)), num_warps=4)
    return y


SSD_CARRY_BLOCK = 1024  # state elements (of head_dim × d_state) per program of the carry across blocks


@triton.jit(do_not_specialize=["num_seqs"])
def _ssd_carry_kernel(init_ptr, block_state_ptr, block_decay_ptr, first_ptr, count_ptr, start_ptr, final_ptr,
                      num_seqs, heads, state_size, BLOCK: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = e < state_size
    first = tl.load(first_ptr + seq).to(tl.int64)
    count = tl.load(count_ptr + seq)
    state = tl.load(init_ptr + (seq.to(tl.int64) * heads + h) * state_size + e, mask=mask, other=0.0)
    for j in range(count):
        blk = first + j
        offset = (blk * heads + h) * state_size + e
        tl.store(start_ptr + offset, state, mask=mask)
        decay = tl.load(block_decay_ptr + blk * heads + h)
        state = state * decay + tl.load(block_state_ptr + offset, mask=mask, other=0.0)
    tl.store(final_ptr + (seq.to(tl.int64) * heads + h) * state_size + e, state, mask=mask)


def ssd_carry_states(initial_states: torch.Tensor, block_states: torch.Tensor, block_decay: torch.Tensor,
                     first_block: torch.Tensor, num_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan's carry across blocks in one launch: sequence i's blocks first_block[i] .. + num_blocks[i]
    (int32 device tensors) each start from the state before them, state ← state · block_decay + block_state.
    initial_states [S, h, p, n], block_states [c, h, p, n], block_decay [c, h], float32 contiguous → (each block's
    start [c, h, p, n], each sequence's final state [S, h, p, n])."""
    num_seqs, heads = initial_states.shape[:2]
    state_size = initial_states[0, 0].numel()
    for name, t in (("initial_states", initial_states), ("block_states", block_states), ("block_decay", block_decay)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"ssd_carry_states: {name} must be a contiguous float32 tensor, got {t.dtype}")
    if block_states.shape[1:] != initial_states.shape[1:] or block_decay.shape != block_states.shape[:2]:
        raise ValueError(f"ssd_carry_states: block_states {tuple(block_states.shape)} / block_decay "
                         f"{tuple(block_decay.shape)} do not match initial_states {tuple(initial_states.shape)}")
    starts = torch.empty_like(block_states)
    final = torch.empty_like(initial_states)
    if num_seqs == 0:
        return starts, final
    _ssd_carry_kernel[(num_seqs, heads, triton.cdiv(state_size, SSD_CARRY_BLOCK))](
        initial_states, block_states, block_decay, first_block, num_blocks, starts, final, num_seqs, heads,
        state_size, BLOCK=SSD_CARRY_BLOCK)
    return starts, final
