"""Compiles every Triton kernel of pagedllm for sm_90 (Hopper), and all but the FP8 ones for sm_80 (Ampere), on a
machine without a GPU: the kernels' own Python wrappers run on CPU tensors (so each launch has the constexprs,
specialisations and dtypes a GPU step would give it) inside ``triton_compile_only.compile_only``, which launches
nothing, and Triton's NVIDIA backend builds each launch with its bundled ptxas. Run by tests/test_kernel_compile.py
in a process without TRITON_INTERPRET; prints one line per compiled kernel variant ("sm_NN name cubin_bytes
shared_memory_bytes"), and fails on the first kernel that does not build."""
from __future__ import annotations

import dataclasses
import sys

import torch

from pagedllm.kernels.triton_compile_only import compile_only, hooks_present, ptxas_usage


def _attention(cache_dtype: torch.dtype) -> None:
    from pagedllm.kernels import triton_attention, triton_cache_ops
    from pagedllm.kernels.triton_unified_attention import unified_attention

    bf16 = torch.bfloat16
    kc = torch.zeros(12, 16, 2, 128, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    k_new = torch.zeros(5, 2, 128, dtype=bf16)
    triton_cache_ops.reshape_and_cache(k_new, k_new, kc, vc, torch.arange(5), 0.5, 0.5)
    triton_cache_ops.copy_blocks([kc], [vc], torch.tensor([[0, 1]]))
    triton_cache_ops.swap_blocks([kc, vc], [vc, kc], torch.tensor([[0, 1]]))
    tables = torch.zeros(3, 4, dtype=torch.int32)
    lens = torch.tensor([10, 40, 60], dtype=torch.int32)
    dec_q = torch.zeros(3, 8, 128, dtype=bf16)
    for reduce in ("fused", "separate"):
        triton_attention.paged_decode_attention(dec_q, kc, vc, tables, lens, 0.1, 60, num_splits=2, reduce=reduce)
    triton_attention.paged_decode_attention(dec_q, kc, vc, tables, lens, 0.1, 60, num_splits=1)
    q = torch.zeros(20, 8, 128, dtype=bf16)
    starts = torch.tensor([0, 1, 8, 20], dtype=torch.int32)
    triton_attention.paged_prefill_attention(q, kc, vc, tables, lens, starts, 0.1, 1, 2, 12, torch.zeros_like(q))
    unified_attention(q, kc, vc, tables, lens, starts, 0.1, torch.zeros_like(q))
    gqa3 = torch.zeros(20, 6, 128, dtype=bf16)  # three query heads per KV head: padded to four rows
    unified_attention(gqa3, kc, vc, tables, lens, starts, 0.1, torch.zeros_like(gqa3))
    # Sliding windows (Mistral, Gemma 2/3) and logit soft caps (Gemma 2), alone and together: constexpr variants of
    # every attention kernel (the window's size is a runtime argument, so one window stands for all).
    for window, cap in ((4096, None), (None, 50.0), (1024, 50.0)):
        kw = dict(sliding_window=window, logits_soft_cap=cap)
        for reduce in ("fused", "separate"):
            triton_attention.paged_decode_attention(dec_q, kc, vc, tables, lens, 0.1, 60, num_splits=2, reduce=reduce,
                                                    **kw)
        triton_attention.paged_decode_attention(dec_q, kc, vc, tables, lens, 0.1, 60, num_splits=1, **kw)
        triton_attention.paged_prefill_attention(q, kc, vc, tables, lens, starts, 0.1, 1, 2, 12, torch.zeros_like(q),
                                                 **kw)
        unified_attention(q, kc, vc, tables, lens, starts, 0.1, torch.zeros_like(q), **kw)
    # Attention sinks (GPT-OSS, HAS_SINKS), alone and with a window (its sliding layers): in the single-split decode's
    # normalisation, both merges of the splits, the prefill kernel and the unified kernel (GQA padding rows too).
    sinks = torch.zeros(8, dtype=torch.float32)
    for window in (None, 128):
        kw = dict(sliding_window=window, sinks=sinks)
        for reduce in ("fused", "separate"):
            triton_attention.paged_decode_attention(dec_q, kc, vc, tables, lens, 0.1, 60, num_splits=2, reduce=reduce,
                                                    **kw)
        triton_attention.paged_decode_attention(dec_q, kc, vc, tables, lens, 0.1, 60, num_splits=1, **kw)
        triton_attention.paged_prefill_attention(q, kc, vc, tables, lens, starts, 0.1, 1, 2, 12, torch.zeros_like(q),
                                                 **kw)
        unified_attention(q, kc, vc, tables, lens, starts, 0.1, torch.zeros_like(q), **kw)
    unified_attention(gqa3, kc, vc, tables, lens, starts, 0.1, torch.zeros_like(gqa3), sinks=torch.zeros(6))


def _mla() -> None:
    """DeepSeek's MLA: the latent decode kernel (one split; several, with its merge) over one 576-wide latent pool of
    one KV head for 16 query heads, and the generic prefill and unified kernels at that width (their wide-head launch)."""
    from pagedllm.kernels import triton_attention
    from pagedllm.kernels.triton_mla_decode import mla_decode_attention
    from pagedllm.kernels.triton_unified_attention import unified_attention

    bf16 = torch.bfloat16
    pool = torch.zeros(12, 16, 1, 576, dtype=bf16)
    tables = torch.zeros(3, 4, dtype=torch.int32)
    lens = torch.tensor([10, 40, 60], dtype=torch.int32)
    dec_q = torch.zeros(3, 16, 576, dtype=bf16)
    for splits in (1, 3):
        mla_decode_attention(dec_q, pool, tables, lens, 0.1, 60, 512, out=torch.zeros_like(dec_q), num_splits=splits)
    q = torch.zeros(20, 16, 576, dtype=bf16)
    starts = torch.tensor([0, 1, 8, 20], dtype=torch.int32)
    triton_attention.paged_prefill_attention(q, pool, pool, tables, lens, starts, 0.1, 1, 2, 12, torch.zeros_like(q))
    unified_attention(q, pool, pool, tables, lens, starts, 0.1, torch.zeros_like(q))


def _sampling_and_layers(fp8: bool) -> None:
    from pagedllm.kernels import (triton_bitmask, triton_fp8_quant, triton_fused_ops, triton_greedy,
                                  triton_invariant_matmul, triton_sample)

    bf16 = torch.bfloat16
    logits = torch.zeros(4, 1000, dtype=bf16)
    mask = torch.zeros(4, 32, dtype=torch.int32)
    triton_greedy.greedy_sample_with_logprob(logits)
    triton_sample.sample_with_logprob(logits, torch.zeros(4, 2, dtype=torch.float64))
    triton_sample.sample_with_logprob(logits, torch.zeros(4, 2, dtype=torch.float64), mask)
    triton_bitmask.apply_token_bitmask_triton(logits, mask, None)
    x = torch.zeros(8, 256, dtype=bf16)
    w = torch.ones(256, dtype=bf16)
    triton_fused_ops.rms_norm(x, w, 1e-5)
    triton_fused_ops.fused_add_rms_norm(x, torch.zeros_like(x), w, 1e-5)
    triton_fused_ops.silu_and_mul(x)
    triton_fused_ops.gemma_rms_norm(x, w, 1e-6)
    triton_fused_ops.fused_add_gemma_rms_norm(x, torch.zeros_like(x), w, 1e-6)
    triton_fused_ops.gelu_tanh_and_mul(x)
    qk = torch.zeros(8, 3 * 128, dtype=bf16)
    cos = torch.zeros(64, 64, dtype=torch.float32)
    triton_fused_ops.rotary_embedding(torch.arange(8), qk[:, :256], qk[:, 256:], cos, cos, 64)
    # Partial rotary (Phi-4-mini: RoPE on the first 3/4 of each head).
    triton_fused_ops.rotary_embedding(torch.arange(8), qk[:, :256], qk[:, 256:], cos[:, :48], cos[:, :48], 64,
                                      rotary_dim=48)
    for dtype in (bf16, torch.float32):  # the batch-invariant GEMM: tensor-core and IEEE float32 dots
        triton_invariant_matmul.invariant_linear(x.to(dtype), torch.zeros(96, 256, dtype=dtype))
    if fp8:
        triton_fp8_quant.quantize_activation_rows(x)


def _ngram() -> None:
    from pagedllm.kernels.triton_ngram import accept_append, propose_rows

    n, k, bucket, width = 2, 4, 16, 4
    z = torch.zeros(bucket, dtype=torch.long)
    drafts = torch.zeros((n, k), dtype=torch.long)
    propose_rows(torch.zeros((3, 64), dtype=torch.long), torch.ones(3, dtype=torch.long), torch.tensor([0, 2]),
                 torch.zeros((n, width), dtype=torch.int32), torch.full((n,), 64), k, 1, 3, 16, 64, drafts,
                 torch.zeros(n, dtype=torch.long), z, z.clone(), z.clone(), torch.zeros(bucket, dtype=torch.int32),
                 torch.zeros((bucket, width), dtype=torch.int32), bucket)
    accept_append(torch.zeros((n, k + 1), dtype=torch.long), torch.zeros((n, k + 1)), drafts,
                  torch.zeros(n, dtype=torch.long), torch.tensor([0, 2]), torch.zeros((3, 64), dtype=torch.long),
                  torch.ones(3, dtype=torch.long), torch.full((3,), 9), torch.zeros((n, k + 1), dtype=torch.long))


def _moe() -> None:
    """The fused MoE's alignment program and grouped GEMMs: every tile height of `block_m_for` with its default tile,
    the 256-wide tile, and float32 (tests' and float32 models' IEEE dots), over float and MXFP4 experts."""
    from pagedllm.kernels import triton_fused_moe as moe
    from pagedllm.model.mxfp4 import Mxfp4Weight

    bf16, experts, top_k = torch.bfloat16, 8, 2
    for t in (4, 600):  # few pairs, and enough for 128-row tiles
        ids = (torch.arange(t * top_k) % experts).view(t, top_k)
        weights = torch.full((t, top_k), 0.5)
        for dtype in (bf16, torch.float32):
            x = torch.zeros(t, 256, dtype=dtype)
            w13, w2 = torch.zeros(experts, 256, 256, dtype=dtype), torch.zeros(experts, 256, 128, dtype=dtype)
            configs = [(m, moe.gemm_config(m, dtype)) for m in (16, 32, 64, 128)]
            if dtype == bf16:
                configs.append((128, moe.MoeGemmConfig(block_n=256, block_k=64, num_warps=8, num_stages=3)))
            for block_m, cfg in configs:
                moe.fused_experts(x, w13, w2, weights, ids, block_m, (cfg, cfg))
                # GPT-OSS's MXFP4 experts (W_MXFP4: bytes and scales decoded in the tile), with its biases
                mx13 = Mxfp4Weight(torch.zeros(experts, 256, 128, dtype=torch.uint8),
                                   torch.zeros(experts, 256, 8, dtype=torch.uint8))
                mx2 = Mxfp4Weight(torch.zeros(experts, 256, 64, dtype=torch.uint8),
                                  torch.zeros(experts, 256, 4, dtype=torch.uint8))
                mx_cfgs = [moe.gemm_config(block_m, dtype, True, num_pairs) for num_pairs in (top_k, t * top_k)]
                if dtype == bf16:  # and Triton's own decode (tl.dot_scaled)
                    mx_cfgs += [dataclasses.replace(c, mxfp4_scaled_dot=True) for c in mx_cfgs]
                for mx_cfg in mx_cfgs:
                    moe.fused_experts(x, mx13, mx2, weights, ids, block_m, (mx_cfg, mx_cfg), activation="swigluoai",
                                      w13_bias=torch.zeros(experts, 256, dtype=dtype),
                                      w2_bias=torch.zeros(experts, 256, dtype=dtype))


def _mamba() -> None:
    """Mamba-2 decode: the conv and selective-state updates in place (bf16 conv state, float32 SSM state)."""
    from pagedllm.kernels.triton_mamba import conv_state_update, ssm_state_update

    heads, head_dim, groups, d_state = 8, 64, 2, 128
    conv_dim = heads * head_dim + 2 * groups * d_state
    proj = torch.zeros(4, 2 * heads * head_dim + 2 * groups * d_state + heads, dtype=torch.bfloat16)
    xbc, dt = proj[:, heads * head_dim: heads * head_dim + conv_dim], proj[:, -heads:]
    slots = torch.arange(4)
    for bias in (torch.zeros(conv_dim, dtype=torch.bfloat16), None):
        conv = conv_state_update(xbc, torch.zeros(6, conv_dim, 3, dtype=torch.bfloat16),
                                 torch.zeros(conv_dim, 1, 4, dtype=torch.bfloat16), bias, slots)
    params = torch.zeros(heads, dtype=torch.bfloat16)
    ssm_state_update(conv, dt, params, params, params, torch.zeros(6, heads, head_dim, d_state), slots, groups)
    # Mamba-1's selective scan (bf16 projections, float32 state), with and without snapshots
    from pagedllm.kernels.triton_mamba import selective_scan

    channels, d_state = 256, 16
    x = torch.zeros(8, channels)
    proj = torch.zeros(8, 2 * channels, dtype=torch.bfloat16)
    bc = torch.zeros(8, 8 + 2 * d_state, dtype=torch.bfloat16)
    for lens, snaps in (([2, 6], [(1, 3, 4)]), ([1] * 8, [])):
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
        selective_scan(x, proj[:, :channels], torch.zeros(channels, d_state), bc[:, 8:8 + d_state], bc[:, 8 + d_state:],
                       torch.zeros(channels, dtype=torch.bfloat16), proj[:, channels:],
                       torch.zeros(9, channels, 1, d_state), torch.arange(len(lens)), qsl, lens, snaps)
    # the gated norm (a bf16 gate from the in-projection's split, bf16 out)
    from pagedllm.kernels.triton_mamba import gated_rms_norm

    gated_rms_norm(torch.zeros(4, 512), torch.zeros(4, 600, dtype=torch.bfloat16)[:, 88:],
                   torch.zeros(512, dtype=torch.bfloat16), 512, 1e-5, torch.bfloat16)
    # the prefill conv (bf16 inputs and state, a bias) and its saved-input updates
    from pagedllm.model.layers.mamba2 import causal_conv_prefill

    xbc = torch.zeros(9, 2 * conv_dim, dtype=torch.bfloat16)[:, :conv_dim]
    causal_conv_prefill(xbc, torch.zeros(6, conv_dim, 3, dtype=torch.bfloat16),
                        torch.zeros(conv_dim, 1, 4, dtype=torch.bfloat16), torch.zeros(conv_dim, dtype=torch.bfloat16),
                        torch.tensor([0, 1]), [5, 4], [(0, 2)], torch.tensor([2]), kernels=True)
    # the chunked Mamba-2 scan's kernels (prefill chunks): block states, the carry, the outputs
    from pagedllm.model.layers.mamba2 import ssd_varlen_scan

    heads, head_dim, groups, d_state, lens = 8, 64, 1, 128, [200, 7]
    total = sum(lens)
    ssd_varlen_scan(torch.zeros(total, heads, head_dim), torch.zeros(total, heads), torch.zeros(heads),
                    torch.zeros(total, groups, d_state), torch.zeros(total, groups, d_state),
                    torch.zeros(len(lens), heads, head_dim, d_state), lens, 128, kernels=True)


# Exit status when this Triton lacks the runtime hooks the check stands on (a driver that can be swapped, launches
# that can be compile-only): the test skips, naming the version, rather than failing on Triton's internals.
UNSUPPORTED_TRITON = 3


def _fp8_v_operand() -> None:
    """The unified kernel on an FP8 pool (sm_90), with and without ``fp8_upcast``: one line each, "upcast=B
    shared_byte_loads=N ldmatrix_trans=M registers=R spill_stores=S", the first two counted in its PTX (how V's
    transposed dot operand is read), the others from ptxas."""
    from pagedllm.kernels import kv_layout
    from pagedllm.kernels.triton_unified_attention import unified_attention

    n = 8
    kc = kv_layout.to_layout(torch.zeros(16, 16, 8, 128, dtype=torch.float8_e4m3fn), kv_layout.HEAD_MAJOR)
    q = torch.zeros(n, 32, 128, dtype=torch.bfloat16)
    with compile_only(90) as compiled:
        for upcast in (True, False):
            unified_attention(q, kc, kc, torch.zeros(n, 128, dtype=torch.int32),
                              torch.full((n,), 500, dtype=torch.int32), torch.arange(n + 1, dtype=torch.int32), 0.1,
                              q.clone(), fp8_upcast=upcast)
            ptx, use = compiled[-1].ptx, ptxas_usage(compiled[-1])
            print(f"upcast={upcast} shared_byte_loads={ptx.count('ld.shared.b8') + ptx.count('ld.shared.u8')} "
                  f"ldmatrix_trans={ptx.count('.trans.shared')} registers={use['registers']} "
                  f"spill_stores={use['spill_stores']}")


def main() -> None:
    if not hooks_present():
        import triton

        print(f"Triton {triton.__version__}: no swappable driver or compile-only launch", file=sys.stderr)
        raise SystemExit(UNSUPPORTED_TRITON)
    if sys.argv[1:] == ["--fp8-v-operand"]:
        _fp8_v_operand()
        return
    for arch, caches in ((90, (torch.bfloat16, torch.float8_e4m3fn)), (80, (torch.bfloat16,))):
        with compile_only(arch) as compiled:
            for cache in caches:
                _attention(cache)
            _mla()
            _sampling_and_layers(fp8=arch >= 89)
            _ngram()
            _moe()
            _mamba()
        for launch in compiled:
            print(f"sm_{launch.arch}", launch.name, len(launch.kernel.asm["cubin"]), launch.kernel.metadata.shared)


if __name__ == "__main__":
    main()
