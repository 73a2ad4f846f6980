"""Compile, at engine start, every Triton attention variant that eager attention calls can reach.

Triton compiles a kernel once per combination of constexpr values and integer-argument
specialisations (an int equal to 1, or divisible by 16, gets its own binary). The non-attention
kernels are compiled by the graph captures (every bucket runs once eagerly before capture); what
varies from step to step is the attention call that runs between the pieces (and in eager steps):

- decode: the split count picks ``WRITE_PARTIAL``, ``SPLIT_CHUNK`` (next power of two, at most 32)
  and the ``num_splits`` specialisation (1 / multiple of 16 / other). The block-table width is fixed
  (every table is padded to ``max_model_len / block_size`` columns under graphs), so ``TABLE_ROW`` is
  one value;
- prefill: ``first_seq`` (the number of decodes before the chunks) is 0 or a multiple of 16, 1, or other;
- both, per layer: a sliding window and a logit soft cap are constexpr flags (SLIDING, SOFT_CAP; the window's
  size and the cap are runtime values, not specialised), so each (window on, cap on) combination of the model's
  layers (``attention_variants``) is a variant of every launch above;
- MLA layers (``Attention.latent_dim``): their decodes take ``triton_mla_decode`` (single split, or split with its
  merge kernel; the split count is not specialised), warmed instead of the generic decode (piecewise-graph replays
  hand the latent_dim on too);
- layers with attention sinks (GPT-OSS, ``Attention.sinks``): HAS_SINKS is one more constexpr flag of every decode,
  merge and prefill launch, so such layers are a variant of their own, run with a float32 sinks tensor (zeros).

``warm_up_attention`` runs each such variant once on tiny inputs (no KV write: slots are -1).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from pagedllm.kernels.metadata import AttentionMetadata

logger = logging.getLogger("pagedllm")

# Split counts covering every SPLIT_CHUNK (1..32) × num_splits specialisation (1 / %16 / other).
WARMUP_SPLITS = (1, 2, 3, 5, 9, 16, 17, 32)
# Decodes before the prefill chunks: first_seq 0 (%16), 1, 3 (other).
WARMUP_NUM_DECODES = (0, 1, 3)
# (sliding_window, logits_soft_cap) of a model whose layers have neither.
PLAIN_ATTENTION = ((None, None),)
# MLA decode split counts: one split (no partials) and several (partials + merge).
MLA_WARMUP_SPLITS = (1, 3)
# A variant: (sliding_window, logits_soft_cap), or (sliding_window, logits_soft_cap, latent_dim) for MLA layers, or
# (sliding_window, logits_soft_cap, None, True) for layers with attention sinks (no MLA layer has them).
AttentionVariant = (tuple[int | None, float | None] | tuple[int | None, float | None, int]
                    | tuple[int | None, float | None, int | None, bool])


def _unpack(variant: AttentionVariant) -> tuple[int | None, float | None, int | None, bool]:
    """(sliding_window, logits_soft_cap, latent_dim or None, whether the layers have sinks)."""
    window, cap, *rest = variant
    return window, cap, rest[0] if rest else None, bool(rest[1]) if len(rest) > 1 else False


def attention_variants(model: nn.Module) -> list[AttentionVariant]:
    """The (sliding_window, logits_soft_cap) pairs of `model`'s attention layers, one per kernel variant (window on
    or off × cap on or off), in layer order: a layer's values stand for every layer of its variant, since the
    kernels take them as runtime arguments. An MLA layer's (``latent_dim`` set) is a triple ending in its latent_dim
    (a constexpr of the MLA decode: one variant per value); a layer with attention sinks (``Attention.sinks``) is
    (window, cap, None, True), the sinks being a constexpr flag of every attention kernel (their values are not)."""
    from pagedllm.model.layers.attention import Attention

    variants: dict[tuple[bool, bool, int | None, bool], AttentionVariant] = {}
    for m in model.modules():
        if isinstance(m, Attention):
            latent, sinks = m.latent_dim, m.sinks is not None
            extra = (latent, True) if sinks else (latent,) if latent is not None else ()
            variants.setdefault((m.sliding_window is not None, m.logits_soft_cap is not None, latent, sinks),
                                (m.sliding_window, m.logits_soft_cap) + extra)
    return list(variants.values()) or list(PLAIN_ATTENTION)


def _variant_label(window: int | None, cap: float | None, latent: int | None = None, sinks: bool = False) -> str:
    return ((f" window={window}" if window is not None else "") + (f" cap={cap:g}" if cap is not None else "")
            + (f" latent={latent}" if latent is not None else "") + (" sinks" if sinks else ""))


def warmup_metas(num_decodes: int, prefill_len: int, table_width: int, decode_len: int, device,
                 backend) -> AttentionMetadata:
    """A step of `num_decodes` one-token decodes over `decode_len` tokens of context, then one prefill
    chunk of `prefill_len` tokens; every table points at block 0, no slot is written."""
    n = num_decodes + (1 if prefill_len else 0)
    qlens = [1] * num_decodes + ([prefill_len] if prefill_len else [])
    cu = [0]
    for q in qlens:
        cu.append(cu[-1] + q)
    t = cu[-1]
    seq_lens = [decode_len] * num_decodes + ([prefill_len] if prefill_len else [])
    i32 = dict(dtype=torch.int32, device=device)
    return AttentionMetadata(
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros((n, table_width), **i32),
        seq_lens=torch.tensor(seq_lens, **i32),
        query_start_loc=torch.tensor(cu, **i32),
        seq_lens_cpu=seq_lens, query_lens_cpu=qlens, num_decodes=num_decodes,
        max_seq_len=max(seq_lens), max_query_len=max(qlens), backend=backend,
    )


def qkv_like_steps(rows: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of `rows` tokens laid out as the steps hand them to attention (strided views of one qkv buffer), for
    warming up the kernels with the strides they will see."""
    hq, hk, d = num_heads, num_kv_heads, head_dim
    qkv = torch.zeros((rows, (hq + 2 * hk) * d), dtype=dtype, device=device)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return q.view(rows, hq, d), k.view(rows, hk, d), v.view(rows, hk, d)


@torch.inference_mode()
def warm_up_attention(backend, kv_cache, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      out: torch.Tensor, table_width: int, scale: float,
                      variants: Sequence[AttentionVariant] = PLAIN_ATTENTION) -> list[str]:
    """Run every decode / prefill attention variant once through `backend` on rows of the given buffers
    (laid out as the steps' q, k, v and output: the same strides), for each (sliding_window, logits_soft_cap) of
    `variants` (``attention_variants`` of the model), with a sinks tensor (zeros, float32 [Hq]) for a variant with
    sinks; returns what was compiled, for the log."""
    from pagedllm.kernels import triton_attention

    device = query.device
    done = []
    key_cache, value_cache = kv_cache
    decode_len = table_width * key_cache.shape[1]
    workspace = backend.workspaces.get(device)
    if workspace is None:
        workspace = backend.workspaces[device] = triton_attention.DecodeWorkspace.allocate(device)
    batches = [2]
    if key_cache.element_size() == 1:  # an FP8 pool launches differently from a program per SM on
        wide = -(-triton_attention.num_sms(device.index or 0) // key_cache.shape[2])
        if wide <= query.shape[0]:
            batches.append(max(wide, 3))
    for variant in variants:
        window, cap, latent, has_sinks = _unpack(variant)
        label = _variant_label(window, cap, latent, has_sinks)
        # Only HAS_SINKS and the pointer's dtype and alignment pick the binary: zeros stand for every layer's sinks
        # (float32 [Hq] parameters of their own).
        sinks = torch.zeros(query.shape[1], dtype=torch.float32, device=device) if has_sinks else None
        for n in batches if latent is None else ():
            for splits in WARMUP_SPLITS:
                meta = warmup_metas(n, 0, table_width, decode_len, device, backend)
                triton_attention.paged_decode_attention(
                    query[:n], key_cache, value_cache, meta.block_tables, meta.seq_lens, scale, decode_len,
                    out=out[:n], num_splits=splits, workspace=workspace, sliding_window=window, logits_soft_cap=cap,
                    sinks=sinks)
                done.append(f"decode splits={splits}" + (f" batch={n}" if n != 2 else "") + label)
        if latent is not None:
            done += _warm_up_mla_decode(key_cache, query, out, table_width, decode_len, scale, latent, workspace,
                                        backend)
        for nd in WARMUP_NUM_DECODES:
            meta = warmup_metas(nd, 5, table_width, decode_len, device, backend)
            t = nd + 5
            extra = {} if latent is None else {"latent_dim": latent}
            if sinks is not None:
                extra["sinks"] = sinks
            backend.forward(query[:t], key[:t], value[:t], kv_cache, meta, scale, out=out[:t], sliding_window=window,
                            logits_soft_cap=cap, **extra)
            done.append(f"mixed decodes={nd}" + label)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out.zero_()
    return done


def _warm_up_mla_decode(pool: torch.Tensor, query: torch.Tensor, out: torch.Tensor, table_width: int,
                        decode_len: int, scale: float, latent_dim: int, workspace, backend) -> list[str]:
    """Run the MLA decode once per MLA_WARMUP_SPLITS over the latent `pool`; returns what was compiled."""
    from pagedllm.kernels.triton_mla_decode import mla_decode_attention

    done = []
    for splits in MLA_WARMUP_SPLITS:
        meta = warmup_metas(2, 0, table_width, decode_len, query.device, backend)
        mla_decode_attention(query[:2], pool, meta.block_tables, meta.seq_lens, scale, decode_len, latent_dim,
                             out=out[:2], num_splits=splits, workspace=workspace)
        done.append(f"mla decode splits={splits} latent={latent_dim}")
    return done


def log_warm_up(what: list[str], seconds: float) -> None:
    logger.info("Warm start: ran %d attention variants and warm-up steps (%s) in %.2f s", len(what), ", ".join(what), seconds)

