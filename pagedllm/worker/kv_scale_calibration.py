"""Calibrated per-layer FP8 KV scales at start-up (vLLM's ``calculate_kv_scales``).

One forward pass of the model over a fixed calibration prompt records, per attention layer, the largest
|k| (after RoPE: what the cache stores) and |v|; the scales are amax / ``kv_quant.K_SCALE_CONSTANT`` and
amax / ``kv_quant.V_SCALE_CONSTANT``. The prompt is a short English text shipped in the package
(``data/kv_calibration.txt``, original prose written for this purpose; not the accuracy benchmark's
evaluation text), tokenized with the model's tokenizer, or deterministic random token ids where there is
none (``skip_tokenizer_init``, dummy weights).

During the pass the layers attend through ``_AmaxRecorder`` instead of the engine's backend: plain causal
attention of the one sequence in torch, no cache (the way the piecewise-graph capture stands in for the
backend), so the pass runs on any device and dtype, before the pool's kernels or CUDA graphs are touched.
It must run before graphs are captured: the scales are baked into the captured launches.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from torch import nn

from pagedllm.kernels import kv_quant
from pagedllm.kernels.metadata import AttentionMetadata

logger = logging.getLogger("pagedllm")

#: Token ids drawn when there is no tokenizer (about the length of the text's tokens).
NUM_RANDOM_TOKENS = 384


def calibration_text() -> str:
    """The calibration text shipped with the package (~300 words)."""
    return resources.files("pagedllm.worker").joinpath("data/kv_calibration.txt").read_text(encoding="utf-8")


def calibration_token_ids(tokenizer: Any | None, vocab_size: int, max_len: int, seed: int = 0) -> list[int]:
    """The calibration prompt: the text's tokens, or NUM_RANDOM_TOKENS random ids in [0, vocab_size) from
    `seed` without a tokenizer; at most `max_len` tokens."""
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}.")
    if tokenizer is not None:
        ids = list(tokenizer.encode(calibration_text()))
    else:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab_size, (NUM_RANDOM_TOKENS,), generator=g).tolist()
    return ids[:max_len]


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                     sliding_window: int | None = None, logits_soft_cap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one sequence, query [T, Hq, D], key/value [T, Hk, D] (query head h reads KV head
    h // (Hq / Hk)) → [T, Hq, D] in the query's dtype; computed in float32. `sliding_window`, `logits_soft_cap`,
    `sinks`: as in AttentionBackend.forward."""
    t, hq, _ = query.shape
    group = hq // key.shape[1]
    q = query.float().transpose(0, 1)  # [Hq, T, D]
    k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)
    s = torch.matmul(q, k.transpose(1, 2)) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    future = torch.ones(t, t, dtype=torch.bool, device=query.device).triu(1)
    if sliding_window is not None:
        future |= torch.ones(t, t, dtype=torch.bool, device=query.device).tril(-sliding_window)
    s = s.masked_fill(future, float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1)
    else:  # each head's sink logit joins the denominator and weighs no value
        p = torch.softmax(torch.cat([s, sinks.float().view(hq, 1, 1).expand(hq, t, 1)], dim=-1), dim=-1)[..., :t]
    return torch.matmul(p, v).transpose(0, 1).contiguous().to(query.dtype)


class _AmaxRecorder:
    """The attention backend during calibration: records each layer's amax |k|, |v| (a layer is found by
    its cache placeholder, by identity) and returns plain causal attention of the one sequence."""

    name = "kv-scale-calibration"

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches
        self.k_amax: list[torch.Tensor | None] = [None] * len(kv_caches)
        self.v_amax: list[torch.Tensor | None] = [None] * len(kv_caches)

    def forward(self, query, key, value, kv_cache, meta, scale, out=None, sliding_window=None, logits_soft_cap=None,
                sinks=None):
        layer = next((i for i, c in enumerate(self.kv_caches) if c is kv_cache), None)
        if layer is None:
            raise RuntimeError("KV scale calibration: a layer attended through a cache it was not given.")
        k, v = key.detach().abs().amax().float(), value.detach().abs().amax().float()
        prev_k, prev_v = self.k_amax[layer], self.v_amax[layer]  # a layer called twice keeps the larger
        self.k_amax[layer] = k if prev_k is None else torch.maximum(prev_k, k)
        self.v_amax[layer] = v if prev_v is None else torch.maximum(prev_v, v)
        result = causal_attention(query, key, value, scale, sliding_window, logits_soft_cap, sinks)
        if out is not None:
            out.copy_(result)
            return out
        return result


@dataclass(frozen=True)
class KVCalibration:
    """Per-layer amax |k| and |v| of one calibration pass, and what it took."""

    k_amax: tuple[float, ...]
    v_amax: tuple[float, ...]
    num_tokens: int
    seconds: float

    def scales(self, k_constant: float = kv_quant.K_SCALE_CONSTANT,
               v_constant: float = kv_quant.V_SCALE_CONSTANT) -> tuple[tuple[float, float], ...]:
        """(k_scale, v_scale) per layer: amax / constant (1.0 for a layer whose amax is 0 or not finite)."""
        return tuple((kv_quant.scale_from_amax(k, k_constant), kv_quant.scale_from_amax(v, v_constant))
                     for k, v in zip(self.k_amax, self.v_amax))


@torch.inference_mode()
def calibrate_kv_amax(model: nn.Module, token_ids: list[int], num_layers: int,
                      device: torch.device | str) -> KVCalibration:
    """Run `model` (a pagedllm model: ``forward(input_ids, positions, kv_caches, meta)``) once over
    `token_ids` as one prefill and return each of its `num_layers` attention layers' amax |k|, |v|."""
    if not token_ids:
        raise ValueError("KV scale calibration needs at least one token.")
    t0 = time.perf_counter()
    device = torch.device(device)
    n = len(token_ids)
    placeholders = [(torch.empty(0, device=device), torch.empty(0, device=device)) for _ in range(num_layers)]
    recorder = _AmaxRecorder(placeholders)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(1, 0, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens_cpu=[n], query_lens_cpu=[n], num_decodes=0, max_seq_len=n, max_query_len=n, backend=recorder,
    )
    input_ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    positions = torch.arange(n, dtype=torch.int64, device=device)
    model(input_ids, positions, placeholders, meta)
    missing = [i for i, a in enumerate(recorder.k_amax) if a is None]
    if missing:
        raise RuntimeError(f"KV scale calibration: layers {missing} of {num_layers} never attended.")
    k_amax = torch.stack(recorder.k_amax).tolist()  # one device sync for all layers
    v_amax = torch.stack(recorder.v_amax).tolist()
    return KVCalibration(tuple(k_amax), tuple(v_amax), n, time.perf_counter() - t0)


def log_calibration(cal: KVCalibration, dtype: torch.dtype, total_s: float | None = None) -> None:
    """The start-up line: the scales' range over layers and the calibration time (`total_s`: with the
    prompt's preparation, e.g. loading the tokenizer; the forward pass alone otherwise)."""
    scales = cal.scales()
    ks, vs = [k for k, _ in scales], [v for _, v in scales]
    logger.info("FP8 KV scales calibrated (%s, %d layers, %d tokens) in %.2f s (forward pass %.2f s): k_scale "
                "%.4g..%.4g, v_scale %.4g..%.4g (amax |k| %.4g..%.4g / %g, amax |v| %.4g..%.4g / %g)", dtype,
                len(scales), cal.num_tokens, cal.seconds if total_s is None else total_s, cal.seconds, min(ks),
                max(ks), min(vs), max(vs), min(cal.k_amax), max(cal.k_amax), kv_quant.K_SCALE_CONSTANT,
                min(cal.v_amax), max(cal.v_amax), kv_quant.V_SCALE_CONSTANT)
