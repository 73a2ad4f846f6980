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
  layers (``attention_variants``) is a variant of every launch above.

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


def attention_variants(model: nn.Module) -> list[tuple[int | None, float | None]]:
    """The (sliding_window, logits_soft_cap) pairs of `model`'s attention layers, one per kernel variant (window on
    or off × cap on or off), in layer order: a layer's values stand for every layer of its variant, since the
    kernels take them as runtime arguments."""
    from pagedllm.model.layers.attention import Attention

    variants: dict[tuple[bool, bool], tuple[int | None, float | None]] = {}
    for m in model.modules():
        if isinstance(m, Attention):
            variants.setdefault((m.sliding_window is not None, m.logits_soft_cap is not None),
                                (m.sliding_window, m.logits_soft_cap))
    return list(variants.values()) or list(PLAIN_ATTENTION)


def _variant_label(window: int | None, cap: float | None) -> str:
    return (f" window={window}" if window is not None else "") + (f" cap={cap:g}" if cap is not None else "")


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
                      variants: Sequence[tuple[int | None, float | None]] = PLAIN_ATTENTION) -> list[str]:
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
    for window, cap in variants:
        label = _variant_label(window, cap)
        for n in batches:
            for splits in WARMUP_SPLITS:
                meta = warmup_metas(n, 0, table_width, decode_len, device, backend)
                triton_attention.paged_decode_attention(
                    query[:n], key_cache, value_cache, meta.block_tables, meta.seq_lens, scale, decode_len,
                    out=out[:n], num_splits=splits, workspace=workspace, sliding_window=window, logits_soft_cap=cap)
                done.append(f"decode splits={splits}" + (f" batch={n}" if n != 2 else "") + label)
        for nd in WARMUP_NUM_DECODES:
            meta = warmup_metas(nd, 5, table_width, decode_len, device, backend)
            t = nd + 5
            backend.forward(query[:t], key[:t], value[:t], kv_cache, meta, scale, out=out[:t], sliding_window=window,
                            logits_soft_cap=cap)
            done.append(f"mixed decodes={nd}" + label)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out.zero_()
    return done


def log_warm_up(what: list[str], seconds: float) -> None:
    logger.info("Warm start: ran %d attention variants and warm-up steps (%s) in %.2f s", len(what), ", ".join(what), seconds)

