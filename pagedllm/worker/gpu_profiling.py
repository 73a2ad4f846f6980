"""Size the GPU KV pool by profiling: one forward at the largest batch the scheduler can form."""
from __future__ import annotations

import logging

import torch

from pagedllm.core.kv_cache_groups import blocks_for_sequence
from pagedllm.worker.model_input import SequenceChunk
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger("pagedllm")


def dummy_chunks(num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int) -> list[SequenceChunk]:
    """Prefill chunks totalling `num_tokens`, at most `max_num_seqs` of them, none longer than `max_model_len`.

    Every block table points at block 0, so a one-block cache serves them all (values are irrelevant).
    """
    num_seqs = max(min(max_num_seqs, num_tokens), -(-num_tokens // max_model_len))
    chunks = []
    left = num_tokens
    for i in range(num_seqs):
        n = left // (num_seqs - i)
        left -= n
        chunks.append(SequenceChunk(i, [0] * n, 0, [0] * -(-n // block_size), sample=True))
    return chunks


def profile_num_gpu_blocks(worker, block_bytes: int) -> int:
    """KV blocks that fit in gpu_memory_utilization × total − weights − peak activations − CUDA graph
    capture memory (− non-torch use). Memory this process held before the worker loaded its model (another
    engine in the same process, e.g. a benchmark's on/off pair) is not this engine's: each engine gets its
    own gpu_memory_utilization share, as separate vLLM instances would.

    Runs one forward over max_num_batched_tokens dummy tokens with a one-block cache, reads the peak
    allocation, logs the block count and the concurrency it allows, and raises if one max_model_len
    sequence cannot fit.
    """
    cfg = worker.config
    cc, sc = cfg.cache_config, cfg.scheduler_config
    device = worker.device
    max_tokens = sc.max_num_batched_tokens or sc.max_model_len
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = getattr(worker, "memory_baseline", 0)
    weights = torch.cuda.memory_allocated(device) - baseline

    tmp_cache = _one_block_cache(worker)
    runner = ModelRunner(worker.model, device, cc.block_size, worker.attn_backend())
    runner.mamba_caches = worker.mamba_caches  # (state-space layers: the dummy chunks share the scratch slot)
    runner.pipeline = getattr(worker, "pp", None)  # (every stage runs this forward at once: their sends pair up)
    chunks = dummy_chunks(max_tokens, sc.max_num_seqs, sc.max_model_len, cc.block_size)
    runner.execute_model(chunks, tmp_cache)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    del runner
    graph_bytes = _capture_bytes(worker, tmp_cache)
    del tmp_cache
    draft = getattr(worker, "draft_worker", None)
    if draft is not None:  # a draft checkpoint's graphs (its weights are in `weights`; its activations are smaller)
        graph_bytes += _capture_bytes(draft, _one_block_cache(draft))
    torch.cuda.empty_cache()

    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    budget = int(total * cc.gpu_memory_utilization) - peak - non_torch - graph_bytes
    num_blocks = max(0, budget // block_bytes)
    per_seq = blocks_for_sequence(worker.kv_layout.group_windows, sc.max_model_len, cc.block_size)
    logger.info(
        "GPU memory: total %.2f GiB, weights %.2f GiB, peak activations %.2f GiB (%d tokens), other %.2f GiB, "
        "CUDA graphs %.2f GiB, other engines in this process %.2f GiB; "
        "KV pool %d blocks (%.2f GiB) = %.1f× concurrency at max_model_len %d",
        total / 2**30, weights / 2**30, (peak - weights) / 2**30, max_tokens, non_torch / 2**30, graph_bytes / 2**30,
        baseline / 2**30,
        num_blocks, num_blocks * block_bytes / 2**30, num_blocks / per_seq, sc.max_model_len,
    )
    if num_blocks < per_seq:
        raise ValueError(
            f"the KV cache has room for {num_blocks} blocks of {cc.block_size} tokens but one sequence of "
            f"max_model_len={sc.max_model_len} needs {per_seq}: raise gpu_memory_utilization "
            f"(now {cc.gpu_memory_utilization}), lower max_model_len or max_num_batched_tokens, or use a smaller model."
        )
    return int(num_blocks)


def _capture_bytes(worker, one_block_cache) -> int:
    """Device bytes the worker's CUDA graphs will keep (0 for an eager worker)."""
    if not worker.use_cuda_graphs():
        return 0
    from pagedllm.worker.cuda_graph import measure_capture_memory

    cc, sc = worker.config.cache_config, worker.config.scheduler_config
    mct = 0 if worker.mamba_caches is not None else worker.config.model_config.max_capture_tokens  # decode only
    return measure_capture_memory(worker.model, one_block_cache, worker.attn_backend(), cc.block_size,
                                  sc.max_num_seqs, sc.max_model_len, sc.max_num_batched_tokens,
                                  max_capture_tokens=mct, mamba_caches=worker.mamba_caches)


def _one_block_cache(worker) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from pagedllm.worker.worker import kv_geometry

    layers, kv_heads, head_dim = kv_geometry(worker.hf_config, worker.tp.size, worker.tp.rank)
    shape = (1, worker.config.cache_config.block_size, kv_heads, head_dim)

    def pair() -> tuple[torch.Tensor, torch.Tensor]:
        key = torch.empty(shape, dtype=worker.kv_spec.dtype, device=worker.device)
        return (key, key) if worker.use_mla else (key, torch.empty_like(key))

    return [pair() for _ in range(layers)]
