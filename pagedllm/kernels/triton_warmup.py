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
  hand the latent_dim on too).

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
# A variant: (sliding_window, logits_soft_cap), or (sliding_window, logits_soft_cap, latent_dim) for MLA layers.
AttentionVariant = tuple[int | None, float | None] | tuple[int | None, float | None, int]


def _unpack(variant: AttentionVariant) -> tuple[int | None, float | None, int | None]:
    window, cap, *latent = variant
    return window, cap, latent[0] if latent else None


def attention_variants(model: nn.Module) -> list[AttentionVariant]:
    """The (sliding_window, logits_soft_cap) pairs of `model`'s attention layers, one per kernel variant (window on
    or off × cap on or off), in layer order: a layer's values stand for every layer of its variant, since the
    kernels take them as runtime arguments. An MLA layer's (``latent_dim`` set) is a triple ending in its latent_dim
    (a constexpr of the MLA decode: one variant per value)."""
    from pagedllm.model.layers.attention import Attention

    variants: dict[tuple[bool, bool, int | None], AttentionVariant] = {}
    for m in model.modules():
        if isinstance(m, Attention):
            latent = m.latent_dim
            variants.setdefault((m.sliding_window is not None, m.logits_soft_cap is not None, latent),
                                (m.sliding_window, m.logits_soft_cap) + ((latent,) if latent is not None else ()))
    return list(variants.values()) or list(PLAIN_ATTENTION)


def _variant_label(window: int | None, cap: float | None, latent: int | None = None) -> str:
    return ((f" window={window}" if window is not None else "") + (f" cap={cap:g}" if cap is not None else "")
            + (f" latent={latent}" if latent is not None else ""))


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


@torch.inference_mode()
def warm_up_attention(backend, kv_cache, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      out: torch.Tensor, table_width: int, scale: float,
                      variants: Sequence[AttentionVariant] = PLAIN_ATTENTION) -> list[str]:
    """Run every decode / prefill attention variant once through `backend` on rows of the given buffers
    (laid out as the steps' q, k, v and output: the same strides), for each (sliding_window, logits_soft_cap) of
    `variants` (``attention_variants`` of the model); returns what was compiled, for the log."""
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
        window, cap, latent = _unpack(variant)
        label = _variant_label(window, cap, latent)
        for n in batches if latent is None else ():
            for splits in WARMUP_SPLITS:
                meta = warmup_metas(n, 0, table_width, decode_len, device, backend)
                triton_attention.paged_decode_attention(
                    query[:n], key_cache, value_cache, meta.block_tables, meta.seq_lens, scale, decode_len,
                    out=out[:n], num_splits=splits, workspace=workspace, sliding_window=window, logits_soft_cap=cap)
                done.append(f"decode splits={splits}" + (f" batch={n}" if n != 2 else "") + label)
        if latent is not None:
            done += _warm_up_mla_decode(key_cache, query, out, table_width, decode_len, scale, latent, workspace,
                                        backend)
        for nd in WARMUP_NUM_DECODES:
            meta = warmup_metas(nd, 5, table_width, decode_len, device, backend)
            t = nd + 5
            mla = {} if latent is None else {"latent_dim": latent}
            backend.forward(query[:t], key[:t], value[:t], kv_cache, meta, scale, out=out[:t], sliding_window=window,
                            logits_soft_cap=cap, **mla)
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

