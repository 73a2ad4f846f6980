"""Full CUDA graphs for steps of a few query tokens per sequence: speculative verification (1 + k tokens a
sequence), with plain decodes and short prompt pieces alongside.

The decode graphs (``worker/cuda_graph.py``) take one query token per sequence; a verification step used to
fall to the piecewise graphs, whose attention runs eagerly between ``num_layers + 1`` replays: 5.8 ms a step
against 1.4 ms for a decode step on an H100 with a 135M model (BENCHMARKS.md §17.1). Here the whole forward,
attention included, is one graph per batch bucket ``b`` with room for ``Q`` query tokens per sequence
(vLLM's "uniform decode" full graphs with ``query_len = 1 + num_speculative_tokens``).

What the captured launches see does not depend on the step's layout: every sequence goes through the
paged prefill kernel (causal attention of its query rows over its cached context), whose grid is
``(b, 1, heads)`` for ``Q`` up to its row tile, and whose per-sequence query ranges, context lengths and
block tables are read from static device buffers. A step's ``T`` query tokens are packed at the front
(``query_start_loc`` as in an eager step); rows ``T..b·Q`` are padding (token 0, position 0, slot ``-1``:
never written to the KV cache), owned by no sequence, so attention never reads or writes them; sequences
``n..b`` are empty (no query rows: their programs return at once). Every other layer works row by row, so
padding rows cannot reach real ones.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch import nn

from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.worker.cuda_graph import capture_batch_sizes
from pagedllm.worker.model_input import SequenceChunk

logger = logging.getLogger("pagedllm")


def is_verify_graphable(chunks: list[SequenceChunk], max_batch: int, max_query_len: int, max_blocks: int) -> bool:
    """True for a step of at most `max_batch` chunks of at most `max_query_len` tokens each."""
    if not chunks or len(chunks) > max_batch:
        return False
    return all(len(c.token_ids) <= max_query_len and len(c.block_table) <= max_blocks for c in chunks)


class VerifyGraphRunner:
    """Captures ``model(input_ids, positions, kv_caches, meta)`` for batches of up to `max_query_len` query
    tokens per sequence, one graph per batch bucket, and replays it."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_backend,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        max_query_len: int,
        pool=None,
    ) -> None:
        if max_query_len < 2:
            raise ValueError(f"max_query_len must be >= 2 (one query token is the decode graphs'), got {max_query_len}.")
        self.model = model
        self.kv_caches = kv_caches
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_query_len = max_query_len
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.device = kv_caches[0][0].device
        mb, nb, q = self.max_batch, self.max_blocks, max_query_len
        self.max_tokens = mb * q
        # Host staging (pinned): int64 rows [input_ids, positions, slot_mapping];
        # int32 [seq_lens (mb) | query_start_loc (mb + 1) | block tables (mb × nb)].
        self._host64 = torch.zeros((3, self.max_tokens), dtype=torch.int64, pin_memory=True)
        self._host32 = torch.zeros(2 * mb + 1 + mb * nb, dtype=torch.int32, pin_memory=True)
        self._np64 = self._host64.numpy()
        self._np32 = self._host32.numpy()
        self._dev64 = torch.zeros_like(self._host64, device=self.device)
        self._dev32 = torch.zeros_like(self._host32, device=self.device)
        self.input_ids, self.positions, self.slot_mapping = self._dev64[0], self._dev64[1], self._dev64[2]
        self.seq_lens = self._dev32[:mb]
        self.query_start_loc = self._dev32[mb: 2 * mb + 1]
        self.block_tables = self._dev32[2 * mb + 1:].view(mb, nb)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = pool
        self._copied = torch.cuda.Event()  # host staging may be rewritten once the last copies are done

    def _meta(self, batch: int) -> AttentionMetadata:
        t = batch * self.max_query_len
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t],
            block_tables=self.block_tables[:batch],
            seq_lens=self.seq_lens[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens_cpu=[self.max_model_len] * batch,
            query_lens_cpu=[self.max_query_len] * batch,
            num_decodes=0,  # every sequence through the prefill kernel: a grid fixed by the bucket
            max_seq_len=self.max_model_len,
            max_query_len=self.max_query_len,
            backend=self.attn_backend,
        )

    def _stage_capture_layout(self) -> None:
        """Every sequence `Q` padding tokens at positions 0..Q-1 over block 0, written nowhere (slot -1)."""
        mb, q = self.max_batch, self.max_query_len
        self._np64[0] = 0
        self._np64[1] = np.tile(np.arange(q), mb)
        self._np64[2] = -1
        self._np32[:] = 0
        self._np32[:mb] = q
        self._np32[mb: 2 * mb + 1] = np.arange(mb + 1) * q
        self._dev64.copy_(self._host64)
        self._dev32.copy_(self._host32)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (warm-up run before each capture)."""
        t0 = time.perf_counter()
        self._stage_capture_layout()
        torch.cuda.synchronize(self.device)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.batch_sizes):
            t = b * self.max_query_len
            args = (self.input_ids[:t], self.positions[:t], self.kv_caches, self._meta(b))
            self.model(*args)  # warm-up: Triton compilation, allocator caching
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[b] = self.model(*args)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        logger.info("Captured CUDA graphs for %d verification batch sizes (1..%d sequences x %d query tokens) "
                    "in %.2f s", len(self.batch_sizes), self.max_batch, self.max_query_len, time.perf_counter() - t0)

    def bucket(self, n: int) -> int:
        for b in self.batch_sizes:
            if b >= n:
                return b
        raise ValueError(f"a step of {n} sequences exceeds the largest captured verification batch {self.max_batch}.")

    def can_run(self, chunks: list[SequenceChunk]) -> bool:
        return bool(self.graphs) and is_verify_graphable(chunks, self.max_batch, self.max_query_len, self.max_blocks)

    def stage(self, chunks: list[SequenceChunk]) -> tuple[int, np.ndarray]:
        """Write the step's packed layout into the host staging buffers → (bucket, query_start_loc[: n + 1])."""
        n = len(chunks)
        b = self.bucket(n)
        bs, nb, mb, q = self.block_size, self.max_blocks, self.max_batch, self.max_query_len
        np64, np32 = self._np64, self._np32
        qlens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=n)
        starts = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=n)
        cu = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(qlens, out=cu[1:])
        t = int(cu[-1])
        seq_of_token = np.repeat(np.arange(n), qlens)
        pos = starts[seq_of_token] + (np.arange(t) - cu[:-1][seq_of_token])
        tables = np32[2 * mb + 1: 2 * mb + 1 + b * nb].reshape(b, nb)
        for i, c in enumerate(chunks):
            tables[i, : len(c.block_table)] = c.block_table
        np64[0, :t] = np.fromiter((tok for c in chunks for tok in c.token_ids), dtype=np.int64, count=t)
        np64[1, :t] = pos
        np64[2, :t] = tables[seq_of_token, pos // bs].astype(np.int64) * bs + pos % bs
        # Padding rows t..b·q and padding sequences n..b (they may hold a previous step's values).
        np64[:2, t: b * q] = 0
        np64[2, t: b * q] = -1
        np32[:n] = starts + qlens
        np32[n:b] = 1
        np32[mb: mb + n + 1] = cu
        np32[mb + n + 1: mb + b + 1] = t
        tables[n:b, 0] = 0
        return b, cu

    def run(self, chunks: list[SequenceChunk], pending=None) -> tuple[torch.Tensor, np.ndarray]:
        """Fill the static buffers for `chunks`, replay → (hidden states [T, H] of the packed query tokens,
        query_start_loc of the chunks). `pending` = (packed rows, sampler rows, sampled token ids): tokens
        taken from the device (see `model_runner.fill_pending_tokens`)."""
        from pagedllm.worker.model_runner import fill_pending_tokens

        self._copied.synchronize()
        b, cu = self.stage(chunks)
        mb, nb, q = self.max_batch, self.max_blocks, self.max_query_len
        self._dev64[:, : b * q].copy_(self._host64[:, : b * q], non_blocking=True)
        self._dev32[:b].copy_(self._host32[:b], non_blocking=True)
        self._dev32[mb: mb + b + 1].copy_(self._host32[mb: mb + b + 1], non_blocking=True)
        lo = 2 * mb + 1
        self._dev32[lo: lo + b * nb].copy_(self._host32[lo: lo + b * nb], non_blocking=True)
        self._copied.record()
        if pending is not None:
            fill_pending_tokens(self.input_ids, *pending)
        self.graphs[b].replay()
        return self.outputs[b][: int(cu[-1])], cu
