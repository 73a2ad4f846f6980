"""Logits processing ops of the sampler (vLLM semantics), each on a ``[rows, vocab]`` batch: ``allowed_token_ids``
and ``logit_bias``, the repetition / frequency / presence penalties, top-k / top-p / min-p, and the structured
outputs' token bitmask. Each returns a new tensor except ``apply_token_bitmask_`` (in place)."""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from pagedllm.device_utils import async_tensor_h2d

NEG_INF = float("-inf")


def _flat_index(seqs: list[list[int]], vocab: int) -> np.ndarray:
    """Row-major linear indices ``row * vocab + token`` of every token in ``seqs``.

    Built with numpy (no per-token Python work); ids outside ``[0, vocab)`` are dropped.
    """
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    toks = np.fromiter(chain.from_iterable(seqs), dtype=np.int64, count=int(lens.sum()))
    rows = np.repeat(np.arange(len(seqs), dtype=np.int64), lens)
    ok = (toks >= 0) & (toks < vocab)
    return rows[ok] * vocab + toks[ok]


def col(values: list[float], device: torch.device) -> torch.Tensor:
    """Per-row float32 column ``[B, 1]``."""
    return async_tensor_h2d(values, torch.float32, device).unsqueeze(1)


def apply_logit_adjustments(x: torch.Tensor, allow_only: list[int], allow_rows: list[int], allow_toks: list[int],
                            bias_rows: list[int], bias_toks: list[int], bias_vals: list[float]) -> torch.Tensor:
    """A copy of `x` whose rows `allow_only` keep only their (allow_rows, allow_toks) entries (the rest -inf), then
    with `bias_vals` added at (bias_rows, bias_toks): ``allowed_token_ids`` and ``logit_bias``."""
    device = x.device
    if allow_only:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[async_tensor_h2d(allow_rows, torch.long, device), async_tensor_h2d(allow_toks, torch.long, device)] = True
        restricted = torch.zeros(x.shape[0], 1, dtype=torch.bool, device=device)
        restricted[async_tensor_h2d(allow_only, torch.long, device)] = True
        x = torch.where(restricted & ~keep, NEG_INF, x)
    else:
        x = x.clone()
    if bias_rows:
        x.index_put_((async_tensor_h2d(bias_rows, torch.long, device), async_tensor_h2d(bias_toks, torch.long, device)),
                     async_tensor_h2d(bias_vals, torch.float32, device), accumulate=True)
    return x


def apply_penalties(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    output_ids: list[list[int]],
    presence: list[float],
    frequency: list[float],
    repetition: list[float],
) -> torch.Tensor:
    """vLLM penalties on ``logits`` ``[B, V]`` (returns a new tensor).

    repetition: tokens in prompt or output -> ``logit / r`` if ``logit > 0`` else
    ``logit * r``; frequency: ``- f * count_in_output``; presence:
    ``- p * (count_in_output > 0)``.  Token ids outside ``[0, V)`` are ignored.
    On a CPU only the tokens each row saw are touched (penalties_on_seen_tokens);
    elsewhere the whole ``[B, V]`` is (penalties_dense): the same bits.
    """
    if logits.device.type == "cpu":
        return penalties_on_seen_tokens(logits, prompt_ids, output_ids, presence, frequency, repetition)
    return penalties_dense(logits, prompt_ids, output_ids, presence, frequency, repetition)


def penalties_dense(logits: torch.Tensor, prompt_ids: list[list[int]], output_ids: list[list[int]],
                    presence: list[float], frequency: list[float], repetition: list[float]) -> torch.Tensor:
    """apply_penalties over the whole [B, V] (a few launches on a GPU, whatever the rows saw)."""
    num_rows, vocab = logits.shape
    device = logits.device
    out_lin = torch.from_numpy(_flat_index(output_ids, vocab)).to(device, non_blocking=True)
    counts = torch.zeros(num_rows * vocab, dtype=torch.float32, device=device)
    counts.scatter_add_(0, out_lin, torch.ones(out_lin.shape, dtype=torch.float32, device=device))
    counts = counts.view(num_rows, vocab)
    seen_out = counts > 0

    if any(r != 1.0 for r in repetition):
        prompt_lin = torch.from_numpy(_flat_index(prompt_ids, vocab)).to(device, non_blocking=True)
        seen = torch.zeros(num_rows * vocab, dtype=torch.bool, device=device)
        seen[prompt_lin] = True
        seen = seen.view(num_rows, vocab) | seen_out
        rep = col(repetition, device)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    if any(f != 0.0 for f in frequency):
        logits = logits - col(frequency, device) * counts
    if any(p != 0.0 for p in presence):
        logits = logits - col(presence, device) * seen_out.to(logits.dtype)
    return logits


def penalties_on_seen_tokens(logits: torch.Tensor, prompt_ids: list[list[int]], output_ids: list[list[int]],
                             presence: list[float], frequency: list[float], repetition: list[float]) -> torch.Tensor:
    """apply_penalties touching only the tokens each row has seen (its output's, and its prompt's under a
    repetition penalty): a copy of the logits, one gather and one scatter. The same float operations per token as
    penalties_dense, which on a CPU made ~6 passes over [B, V] (6-20 ms at 64 × 49 152; BENCHMARKS.md §76.7)."""
    vocab = logits.shape[1]
    out_lin, out_counts = np.unique(_flat_index(output_ids, vocab), return_counts=True)
    use_rep = any(r != 1.0 for r in repetition)
    lin = np.union1d(out_lin, _flat_index(prompt_ids, vocab)) if use_rep else out_lin
    out = logits.clone(memory_format=torch.contiguous_format)
    if not len(lin):
        return out
    counts = np.zeros(len(lin), dtype=np.float32)
    counts[np.searchsorted(lin, out_lin)] = out_counts
    rows_np = lin // vocab
    rows, toks, c = torch.from_numpy(rows_np), torch.from_numpy(lin % vocab), torch.from_numpy(counts)
    v = logits[rows, toks]
    if use_rep:
        rep = torch.tensor(repetition, dtype=torch.float32)[rows]
        v = torch.where(v > 0, v / rep, v * rep)
    if any(f != 0.0 for f in frequency):
        v = v - torch.tensor(frequency, dtype=torch.float32)[rows] * c
    if any(p != 0.0 for p in presence):
        v = v - torch.tensor(presence, dtype=torch.float32)[rows] * (c > 0).to(torch.float32)
    out[rows, toks] = v
    return out


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: list[int] | None, top_p: list[float] | None
) -> torch.Tensor:
    """Mask (``-inf``) tokens outside top-k and/or the top-p nucleus.

    ``top_k[i] <= 0`` or ``>= V`` disables top-k for row i; ties at the k-th value
    are kept. top-p keeps the smallest set of tokens whose cumulative probability
    is >= ``top_p[i]`` (always at least one token). Returns a new tensor.
    """
    native = _native_top_k_top_p(logits)
    if native is not None:  # a CPU: no sort of the vocabulary (~60x faster at 64 rows of 49 152)
        rows = logits.shape[0]
        return native.top_k_top_p(logits, top_k if top_k is not None else [0] * rows,
                                  top_p if top_p is not None else [1.0] * rows)
    return top_k_top_p_by_sort(logits, top_k, top_p)


def top_k_top_p_by_sort(logits: torch.Tensor, top_k: list[int] | None, top_p: list[float] | None) -> torch.Tensor:
    """apply_top_k_top_p in torch ops: a partial top-k alone, else a sort of each row (any device)."""
    vocab = logits.shape[1]
    device = logits.device
    if top_k is not None and top_p is None:
        # top-k alone: a partial top-k is much cheaper than a full sort.
        ks = [x if 0 < x < vocab else 0 for x in top_k]
        max_k = max(ks)
        if max_k == 0:
            return logits
        k_t = async_tensor_h2d(ks, torch.long, device).unsqueeze(1)
        top_v = logits.topk(max_k, dim=-1).values
        kth = top_v.gather(1, (k_t - 1).clamp_(min=0))
        kth = kth.masked_fill(k_t == 0, NEG_INF)
        return logits.masked_fill(logits < kth, NEG_INF)
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = async_tensor_h2d([vocab if (x <= 0 or x > vocab) else x for x in top_k], torch.long, device)
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, NEG_INF)
    if top_p is not None:
        probs_sorted = sorted_logits.softmax(dim=-1)
        cum = probs_sorted.cumsum(dim=-1)
        drop = cum <= 1.0 - col(top_p, device)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits.masked_fill_(drop, NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


def _native_top_k_top_p(logits: torch.Tensor):
    """The native CPU kernels where they take these logits (float32 CPU rows, contiguous), else None."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        return None
    from pagedllm.kernels.cpu_kernels import load_cpu_kernels

    return load_cpu_kernels()


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask tokens whose prob is below ``min_p * max_prob`` (returns a new tensor)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * col(min_p, logits.device)
    return logits.masked_fill(probs < threshold, NEG_INF)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Structured outputs: in place, for each ``r`` in ``rows`` set ``logits[r, t]`` to -inf wherever bit
    ``t`` of the packed int32 row ``bitmask[r]`` is 0 (xgrammar/llguidance layout: bit ``t % 32`` of word
    ``t // 32``). ``bitmask`` (on the host) has a row per logits row (at least); rows not listed are neither
    read nor touched, so unconstrained rows cost nothing.

    On a GPU: one Triton kernel masks the rows (no host sync). A pinned host bitmask (the manager's) is read
    by the kernel in place (pinned memory is mapped into the device's address space under unified addressing),
    which saves the step thread a copy launch; any other is copied first. The row list is copied without
    blocking. On CPU: the native kernel (kernels/cpu/cpu_ops.c; ~14x
    faster than xgrammar's CPU kernel here), else xgrammar's. Masked tokens get probability 0 downstream.
    """
    if not rows:
        return
    batch = logits.shape[0]
    if bitmask.shape[0] < batch:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {batch} logits rows")
    with torch.inference_mode():  # the model's logits are inference tensors
        mask = bitmask[:batch]
        if logits.device.type == "cuda":
            from pagedllm.kernels.triton_bitmask import apply_token_bitmask_triton

            every = len(rows) == batch  # rows are distinct: no row list to copy
            row_ids = None if every else async_tensor_h2d(rows, torch.long, logits.device)
            if mask.is_pinned():
                try:
                    apply_token_bitmask_triton(logits, mask, row_ids)
                    return
                except ValueError:  # pinned but not mapped (registered memory): copy it
                    pass
            apply_token_bitmask_triton(logits, mask.to(logits.device, non_blocking=True), row_ids)
            return
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            from pagedllm.kernels.cpu_kernels import load_cpu_kernels

            native = load_cpu_kernels()
            if native is not None:
                native.apply_token_bitmask(logits, mask, rows)
                return
        import xgrammar

        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        indices = None if len(rows) == batch else rows
        xgrammar.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1], indices=indices)
