"""Fused MoE experts on CUDA: each projection is one Triton grouped GEMM over the (token, expert) pairs sorted
by expert.

`align_pairs` sorts the T·k pairs of a step by expert and pads each expert's run to a multiple of BLOCK_M, so
every BLOCK_M-row tile of the sorted list belongs to one expert; padding slots hold the sentinel T·k and are
neither read nor written. Everything is computed with tensor ops of sizes fixed by T (no host sync), so CUDA
graphs capture a step with MoE layers. The GEMM (`_moe_gemm_kernel`) reads its tile's rows of A through the pair ids
(`pair // k`: the token's row of x for the first projection; the pair's own row for the second), the expert's
weight [N, K] transposed, and writes each pair's output row; the second projection multiplies by the pair's
routing weight before the rows of one token are summed. vLLM's fused_moe follows the same plan.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.model.layers.fused_moe import expert_activation
from pagedllm.model.mxfp4 import MXFP4_BLOCK, Mxfp4Weight


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Tile rows by the mean rows per expert (BENCHMARKS.md §67: graph-replayed sweeps on an H200 over
    Qwen3-30B-A3B's, Mixtral-8x7B's and a small shape): 16 while experts get a few rows each (decode), up to 128."""
    rows = num_pairs / num_experts
    return 16 if rows < 12 else 32 if rows < 32 else 64 if rows < 96 else 128


# `align_pairs` runs as one Triton program (one launch instead of ~15 small torch kernels) while it takes at most this
# many chunks of pairs (4096 // E_pow2 pairs each, one after another); beyond, torch's sort and scans, which spread
# over the GPU, are faster (Qwen3-30B-A3B's 128 experts on an H200: 16 chunks faster, 64 slower; BENCHMARKS §67).
ALIGN_KERNEL_MAX_CHUNKS = 16


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                use_kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids [S] int32, each tile's expert [S // block_m] int32; num_experts marks an unused tile),
    S = T·k + E·(block_m - 1) rounded up to block_m: the worst case of the per-expert padding. Within an expert's
    run the pairs keep their order. `use_kernel`: the one-program Triton version (default: up to
    ALIGN_KERNEL_MAX_CHUNKS chunks)."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    dev = flat.device
    slots = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    e_pow2 = triton.next_power_of_2(num_experts)
    chunk = max(16, 4096 // e_pow2)
    if use_kernel if use_kernel is not None else -(-num_pairs // chunk) <= ALIGN_KERNEL_MAX_CHUNKS:
        sorted_ids = torch.empty(slots, dtype=torch.int32, device=dev)
        tile_expert = torch.empty(slots // block_m, dtype=torch.int32, device=dev)
        _align_kernel[(1,)](flat.contiguous(), sorted_ids, tile_expert, num_pairs, num_experts, slots, slots // block_m,
                            BLOCK_M=block_m, E_POW2=e_pow2, CHUNK=chunk, num_warps=4)
        return sorted_ids, tile_expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(num_pairs, device=dev) - count_start[experts]
    dest = padded_end[experts] - padded[experts] + rank
    sorted_ids = torch.full((slots,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    tile_starts = torch.arange(0, slots, block_m, device=dev)
    tile_expert = torch.searchsorted(padded_end, tile_starts, right=True).to(torch.int32)
    return sorted_ids, tile_expert


# (The token-dependent counts are not specialised: a step of any size reuses the binaries of the warm start.)
@triton.jit(do_not_specialize=["num_pairs", "num_slots", "num_tiles"])
def _align_kernel(ids_ptr, sorted_ids_ptr, tile_expert_ptr, num_pairs, num_experts, num_slots, num_tiles,
                  BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
    """`align_pairs` in one program: per-expert counts, padded run starts, the sentinel fill, each tile's expert, then
    each pair's slot (its expert's run start + its rank among that expert's pairs, counted chunk by chunk)."""
    experts = tl.arange(0, E_POW2)
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=E_POW2).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    run_start = padded_end - padded
    for start in range(0, num_slots, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + num_pairs, mask=offs < num_slots)
    for start in range(0, num_tiles, CHUNK):
        tiles = start + tl.arange(0, CHUNK)
        ended = (padded_end[None, :] <= (tiles * BLOCK_M)[:, None]) & (experts[None, :] < num_experts)
        tl.store(tile_expert_ptr + tiles, tl.sum(ended.to(tl.int32), axis=1), mask=tiles < num_tiles)
    tl.debug_barrier()  # the sentinels land before any pair id overwrites one
    placed = tl.zeros((E_POW2,), dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        valid = offs < num_pairs
        e = tl.load(ids_ptr + offs, mask=valid, other=E_POW2).to(tl.int32)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
        base = tl.sum(onehot * (run_start + placed)[None, :], axis=1)
        tl.store(sorted_ids_ptr + base + rank, offs, mask=valid)
        placed += tl.sum(onehot, axis=0)


@triton.jit
def _e2m1_times_scale(codes, scale):
    """FP4 (E2M1) codes [0, 16) → float32 values times `scale`. The code's three magnitude bits go to an fp16's
    exponent and mantissa tops ((code & 7) << 9, its sign to bit 15): 2^(e - 15)·(1 + m/2), or m·2^-15 for e = 0
    (an fp16 subnormal, exact); `scale` carries the missing 2^14 (kernels pass 2^(s - 113) for E8M0 exponent s)."""
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * scale


@triton.jit
def _dot(a, w, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, w, acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, sorted_ids_ptr, tile_expert_ptr, weights_ptr, scales_ptr, N, K, num_pairs,
              top_k, num_experts, stride_am, stride_we, stride_wn, stride_wk, stride_cm, stride_se, stride_sn,
              ROW_PER_PAIR: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr, W_MXFP4: tl.constexpr,
              SCALED_DOT: tl.constexpr, A_FORMAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """`W_MXFP4`: w_ptr holds MXFP4 bytes [E, N, K / 2] (two codes a byte, the low nibble first), scales_ptr their E8M0
    exponents [E, N, K / 32] (BLOCK_K a multiple of 32). With `SCALED_DOT` (16-bit activations) a K tile's bytes and
    exponents go to `tl.dot_scaled` as they are and Triton's own upcast decodes them; otherwise they are decoded here
    into the tile's even and odd columns, which multiply A's even and odd columns."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert < num_experts:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ids_ptr + offs_m)
        valid = pair < num_pairs
        if ROW_PER_PAIR:
            row = pair
        else:
            row = pair // top_k
        row = tl.where(valid, row, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_j = tl.arange(0, BLOCK_K // 2)
        a_ptrs = a_ptr + row[:, None] * stride_am + offs_k[None, :]
        if W_MXFP4:
            w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_j[:, None]
            # one exponent per 32 K columns: loaded once per group, then repeated over the group's 16 bytes
            offs_g = tl.arange(0, BLOCK_K // 32)
            if SCALED_DOT:  # tl.dot_scaled takes the exponents as [N, K / 32]
                s_ptrs = scales_ptr + expert.to(tl.int64) * stride_se + offs_n[:, None] * stride_sn + offs_g[None, :]
            else:
                s_ptrs = scales_ptr + expert.to(tl.int64) * stride_se + offs_n[None, :] * stride_sn + offs_g[:, None]
        else:
            w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            if W_MXFP4:
                byte_ok = (offs_j[:, None] < (K - k0) // 2) & (offs_n[None, :] < N)
                q = tl.load(w_ptrs, mask=byte_ok, other=0)
                if SCALED_DOT:
                    group_ok = (offs_g[None, :] * 16 < (K - k0) // 2) & (offs_n[:, None] < N)
                    s = tl.load(s_ptrs, mask=group_ok, other=127)
                    acc = tl.dot_scaled(a, None, A_FORMAT, q, s, "e2m1", acc)
                else:
                    group_ok = (offs_g[:, None] * 16 < (K - k0) // 2) & (offs_n[None, :] < N)
                    s = tl.load(s_ptrs, mask=group_ok, other=0).to(tl.int32)
                    scale = ((s + 14) << 23).to(tl.float32, bitcast=True)  # 2^(s - 113): _e2m1_times_scale's 2^14
                    scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (BLOCK_K // 32, 16, BLOCK_N)),
                                       (BLOCK_K // 2, BLOCK_N))
                    q = q.to(tl.int32)
                    w_even = _e2m1_times_scale(q & 15, scale).to(a.dtype)
                    w_odd = _e2m1_times_scale(q >> 4, scale).to(a.dtype)
                    a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
                    acc = _dot(a_even, w_even, acc, IEEE)
                    acc = _dot(a_odd, w_odd, acc, IEEE)
                w_ptrs += BLOCK_K // 2
                s_ptrs += BLOCK_K // 32
            else:
                w = tl.load(w_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
                acc = _dot(a, w, acc, IEEE)
                w_ptrs += BLOCK_K * stride_wk
            a_ptrs += BLOCK_K
        if MUL_WEIGHT:
            acc = acc * tl.load(weights_ptr + pair, mask=valid, other=0.0)[:, None]
        c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


@dataclass(frozen=True)
class MoeGemmConfig:
    """Tile shape and launch options of one grouped GEMM (BLOCK_M is the alignment's, `block_m_for`)."""

    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # MXFP4 weights with 16-bit activations: Triton's tl.dot_scaled decodes the tiles, else this kernel's bit decode
    mxfp4_scaled_dot: bool = False


def gemm_config(block_m: int, dtype: torch.dtype, mxfp4: bool = False, num_pairs: int | None = None) -> MoeGemmConfig:
    """The tile shape that did best with `block_m` rows in the sweeps of `block_m_for` (bf16; with 128 rows a 256-wide
    tile where shared memory holds it: Mixtral's layer at 4 096 tokens 6.76 -> 5.86 ms; float32, used by tests and
    float32 models, takes narrower K tiles to fit shared memory). MXFP4 experts (`mxfp4`) have their own, from the
    sweeps of BENCHMARKS.md §88.1 on gpt-oss-20b's layer (H100): with a handful of pairs (`num_pairs`) long K tiles,
    at 128 rows narrower N and Triton's own decode (`tl.dot_scaled`)."""
    if dtype == torch.float32:
        return MoeGemmConfig(block_n=64, block_k=32, num_warps=4, num_stages=2)
    if mxfp4:
        return _mxfp4_gemm_config(block_m, num_pairs)
    if block_m == 16:
        return MoeGemmConfig(block_n=64, block_k=128, num_warps=4, num_stages=3)
    if block_m == 32:
        return MoeGemmConfig(block_n=128, block_k=128, num_warps=4, num_stages=3)
    if block_m == 64:
        return MoeGemmConfig(block_n=128, block_k=64, num_warps=4, num_stages=3)
    if _shared_memory_bytes() >= (128 + 256) * 64 * 3 * 2:  # the wide tile's three stages of A and B (147 KB)
        return MoeGemmConfig(block_n=256, block_k=64, num_warps=8, num_stages=3)
    return MoeGemmConfig(block_n=128, block_k=64, num_warps=8, num_stages=3)


# With this few (row, expert) pairs a step is latency-bound: halving the K loop's trips pays (§88.1: one token's
# layer 0.150 -> 0.129 ms); with 64 tokens' 256 pairs the 128-deep tile is faster again.
MXFP4_FEW_PAIRS = 8


def _mxfp4_gemm_config(block_m: int, num_pairs: int | None) -> MoeGemmConfig:
    if block_m == 16:
        deep = num_pairs is not None and num_pairs <= MXFP4_FEW_PAIRS
        return MoeGemmConfig(block_n=64, block_k=256 if deep else 128, num_warps=4, num_stages=3)
    if block_m == 32:
        return MoeGemmConfig(block_n=128, block_k=128, num_warps=4, num_stages=3)
    if block_m == 64:
        return MoeGemmConfig(block_n=128, block_k=64, num_warps=4, num_stages=3)
    # 128-row tiles (prompts): Triton's upcast is 3-7 % faster there than the bit decode; at fewer rows it is slower
    return MoeGemmConfig(block_n=128, block_k=64, num_warps=4, num_stages=3, mxfp4_scaled_dot=True)


def _scaled_dot_format(dtype: torch.dtype) -> str:
    """tl.dot_scaled's name for a 16-bit activation dtype ("" for the others, which this kernel decodes for)."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "")


@functools.cache
def _shared_memory_bytes() -> int:
    """Shared memory one block may opt into on the current GPU (0 where unknown)."""
    if not torch.cuda.is_available():
        return 0
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "shared_memory_per_block_optin", 0))


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor | Mxfp4Weight, out: torch.Tensor, sorted_ids: torch.Tensor,
                  tile_expert: torch.Tensor, weights: torch.Tensor, top_k: int, row_per_pair: bool,
                  mul_weight: bool, block_m: int, config: MoeGemmConfig | None = None) -> None:
    num_experts, n, k = w.shape
    cfg = config or gemm_config(block_m, a.dtype, isinstance(w, Mxfp4Weight), out.shape[0])
    grid = (tile_expert.numel(), triton.cdiv(n, cfg.block_n))
    if isinstance(w, Mxfp4Weight):
        if k % MXFP4_BLOCK or cfg.block_k % MXFP4_BLOCK:
            raise ValueError(f"MXFP4 experts need K ({k}) and the K tile ({cfg.block_k}) in multiples of {MXFP4_BLOCK}")
        packed, scales = w.blocks, w.scales
        strides = (packed.stride(0), packed.stride(1), 1, out.stride(0), scales.stride(0), scales.stride(1))
    else:
        packed = scales = w
        strides = (w.stride(0), w.stride(1), w.stride(2), out.stride(0), 0, 0)
    scaled_dot = isinstance(w, Mxfp4Weight) and cfg.mxfp4_scaled_dot and _scaled_dot_format(a.dtype) != ""
    _moe_gemm_kernel[grid](a, packed, out, sorted_ids, tile_expert, weights, scales, n, k, out.shape[0], top_k,
                    num_experts, a.stride(0), *strides,
                    ROW_PER_PAIR=row_per_pair, MUL_WEIGHT=mul_weight, IEEE=a.dtype == torch.float32,
                    W_MXFP4=isinstance(w, Mxfp4Weight), SCALED_DOT=scaled_dot,
                    A_FORMAT=_scaled_dot_format(a.dtype), BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def fused_experts(x: torch.Tensor, w13: torch.Tensor | Mxfp4Weight, w2: torch.Tensor | Mxfp4Weight,
                  topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, block_m: int | None = None,
                  configs: tuple[MoeGemmConfig, MoeGemmConfig] | None = None,
                  activation: str = "silu", w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Σ over each row's k experts of weight · w2_e(silu(gate_e x) · up_e x): x [T, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights / topk_ids [T, k] → [T, H] in x's dtype (accumulated in float32). `activation` "relu2": non-gated
    experts, w2_e(relu(up_e x)²) with w13 [E, I, H] (Nemotron-H's); "swigluoai": GPT-OSS's (layers/fused_moe.py).
    `w13_bias` [E, 2I] / `w2_bias` [E, H]: each expert's biases, added to its pairs' rows (gathered by expert id).
    Either projection may be held as MXFP4 (`Mxfp4Weight`, GPT-OSS's checkpoints), decoded in the GEMM's tiles."""
    t, h = x.shape
    top_k = topk_ids.shape[1]
    num_pairs = t * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    block_m = block_m or block_m_for(num_pairs, w13.shape[0])
    cfg13, cfg2 = configs or (None, None)
    sorted_ids, tile_expert = align_pairs(topk_ids, w13.shape[0], block_m)
    weights = topk_weights.reshape(-1).float().contiguous()
    gate_up = torch.empty((num_pairs, w13.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, sorted_ids, tile_expert, weights, top_k, False, False, block_m, cfg13)
    pair_experts = topk_ids.reshape(-1)  # the rows are in pair order
    if w13_bias is not None:
        gate_up += w13_bias.index_select(0, pair_experts)
    act = expert_activation(gate_up, activation)
    down = torch.empty((num_pairs, h), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, down, sorted_ids, tile_expert, weights, top_k, True, True, block_m, cfg2)
    if w2_bias is not None:  # the kernel weighted each pair's row: its bias too
        down += (weights[:, None] * w2_bias.index_select(0, pair_experts).float()).to(down.dtype)
    return down.view(t, top_k, h).sum(dim=1)


# Every tile height block_m_for picks: a warm start builds each (a step of any size then reuses them).
BLOCK_M_CHOICES = (16, 32, 64, 128)


@torch.inference_mode()
def warm_up_fused_moe(model: torch.nn.Module) -> list[str]:
    """Build every fused-MoE binary a step can reach, at engine start: for each distinct expert layer (shapes, dtype,
    activation, biases), the one-program alignment and both grouped GEMMs at every BLOCK_M_CHOICES tile height, on a
    few tokens (the token counts are not specialised). Eager steps (a hybrid model's, or any longer than the largest
    captured bucket) pick their tile height by their size: without this, the first such step built the variant
    (BENCHMARKS.md §84.1: 323 ms in a Jamba step). Returns what ran, for the warm-start log."""
    from pagedllm.model.layers.fused_moe import FusedMoE

    done, seen = [], set()
    for m in model.modules():
        if not isinstance(m, FusedMoE):
            continue
        w13, w2 = m.mxfp4_weights() or (m.w13_weight, m.w2_weight)
        if w13.shape[0] == 0:  # (GGUF experts: CPU only)
            continue
        mxfp4 = isinstance(w13, Mxfp4Weight)
        key = (tuple(w13.shape), tuple(w2.shape), m.w13_weight.dtype, m.activation, m.w13_bias is not None, mxfp4)
        if key in seen:
            continue
        seen.add(key)
        x = torch.zeros((4, m.hidden_size), dtype=m.w13_weight.dtype, device=m.w13_weight.device)
        ids = (torch.arange(4 * m.top_k, device=x.device) % m.num_experts).view(4, m.top_k)
        weights = torch.full((4, m.top_k), 1.0 / m.top_k, device=x.device)
        for block_m in BLOCK_M_CHOICES:
            fused_experts(x, w13, w2, weights, ids, block_m=block_m, activation=m.activation,
                          w13_bias=m.w13_bias, w2_bias=m.w2_bias)
        if mxfp4:  # one token's pairs: the deep K tile of `MXFP4_FEW_PAIRS`
            fused_experts(x[:1], w13, w2, weights[:1], ids[:1], block_m=16, activation=m.activation,
                          w13_bias=m.w13_bias, w2_bias=m.w2_bias)
        done.append(f"fused MoE {m.num_experts}x{w13.shape[1]}x{m.hidden_size}{' MXFP4' if mxfp4 else ''} tiles "
                    f"{BLOCK_M_CHOICES}")
    return done
