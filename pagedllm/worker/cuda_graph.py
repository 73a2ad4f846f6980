"""CUDA graphs for decode-only steps: one graph per bucketed batch size, replayed over static buffers.

A decode step launches a few hundred small kernels whose host-side cost (Python + launches) dwarfs
their device time at small and medium batch sizes. The runner captures the whole model forward
once per bucket (1, 2, 4, 8, 16, 24, …, 256, 272, …, 512, 544, … up to ``max_num_seqs``) into one shared memory pool and
replays it. A batch of ``n`` decodes runs in the smallest bucket ``B ≥ n``, or in a larger one whose graph
replayed faster at start-up (see :func:`route_to_faster_buckets`); rows ``n..B`` are padding: slot ``-1``
(``reshape_and_cache`` skips it), context length 1 over block 0 (finite values, no NaN), and their outputs
are ignored.

The attention metadata seen by the captured kernels is built on the static buffers with
``max_seq_len = max_model_len`` (it only bounds the split-KV count, which therefore depends on the
bucket alone) and every block table padded to ``max_model_len / block_size`` entries.
"""
from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch
from torch import nn

from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.mamba_state import MambaStateMetadata, clear_state_slots
from pagedllm.worker.block_table_rows import PersistentBlockTables
from pagedllm.worker.model_runner import fill_pending_tokens
from pagedllm.worker.model_input import SequenceChunk, fill_block_table_row

logger = logging.getLogger("pagedllm")


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, then every multiple of 8 to 256, of 16 to 512 and of 32 beyond (as vLLM's
    capture sizes; padding stays under ~6 % past 256), up to (and always including) max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}.")
    sizes = ([b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, min(max_num_seqs, 257), 8))
             + list(range(272, min(max_num_seqs, 513), 16)) + list(range(544, max_num_seqs, 32)))
    return sorted(set(b for b in sizes if b < max_num_seqs) | {max_num_seqs})


# Buckets below this keep their own graph: there decode is bound by the weights' bytes, the replay times are flat,
# and a larger bucket would change the attention kernel's split count (it falls with the batch), which a replay
# over padding rows does not time.
MIN_ROUTED_BUCKET = 128
# A larger bucket takes over only when its replay is at least this much faster (not for noise).
MIN_ROUTING_GAIN = 0.03


def route_to_faster_buckets(times_ms: dict[int, float], min_bucket: int = MIN_ROUTED_BUCKET,
                            min_gain: float = MIN_ROUTING_GAIN) -> dict[int, int]:
    """bucket → the bucket its batches run in: itself, or the fastest larger bucket when that one replays at least
    `min_gain` faster. cuBLAS picks a GEMM kernel per row count, and some row counts get a slow one: on an H100 a
    Llama-3-8B decode graph replayed in 15.4 ms at 448 rows and 11.2 ms at 480 (BENCHMARKS.md §47.1). Padding
    rows cost only their GEMM rows (no KV reads), which is what the replay times."""
    route: dict[int, int] = {}
    best: int | None = None  # the fastest routable bucket at or above b
    for b in sorted(times_ms, reverse=True):
        if b < min_bucket:
            route[b] = b
            continue
        if best is None or times_ms[b] < times_ms[best]:
            best = b
        route[b] = best if times_ms[best] <= (1 - min_gain) * times_ms[b] else b
    return route


def log_routes(kind: str, replay_ms: dict[int, float], route: dict[int, int], seconds: float) -> None:
    """One start-up line: how many buckets of `kind` were timed, and each one that runs as a larger bucket."""
    moved = [f"{b}→{r} ({replay_ms[b]:.2f}→{replay_ms[r]:.2f} ms)" for b, r in route.items() if r != b]
    logger.info("Timed %d %s in %.2f s; %d run as a larger, faster bucket%s", len(replay_ms), kind, seconds,
                len(moved), (": " + ", ".join(moved)) if moved else "")


def is_graphable(chunks: list[SequenceChunk], max_batch: int, max_blocks: int) -> bool:
    """True for a pure decode step that fits the captured shapes."""
    if not chunks or len(chunks) > max_batch:
        return False
    for c in chunks:
        if len(c.token_ids) != 1 or not c.sample or c.all_logits or len(c.block_table) > max_blocks:
            return False
    return True


class CUDAGraphRunner:
    """Captures ``model(input_ids, positions, kv_caches, meta)`` for decode batches and replays it."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_backend,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        num_kv_cache_groups: int = 1,
        mamba_caches: list | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.batch_sizes = capture_batch_sizes(max_num_seqs)
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        device = kv_caches[0][0].device
        self.device = device
        mb, nb = self.max_batch, self.max_blocks
        # A hybrid model's KV cache groups each have their slot mapping and block tables (core/kv_cache_groups.py).
        self.num_groups = g = num_kv_cache_groups
        # Host staging (pinned): int64 rows [input_ids, positions, slot_mapping per group];
        # int32 [seq_lens | tables of group 0 | tables of group 1 | ...].
        self._host64 = torch.zeros((2 + g, mb), dtype=torch.int64, pin_memory=True)
        self._host32 = torch.zeros(mb + g * mb * nb, dtype=torch.int32, pin_memory=True)
        self._np64 = self._host64.numpy()
        self._np32 = self._host32.numpy()
        self._dev64 = torch.zeros((2 + g, mb), dtype=torch.int64, device=device)
        self._dev32 = torch.zeros(mb + g * mb * nb, dtype=torch.int32, device=device)
        self.input_ids, self.positions = self._dev64[0], self._dev64[1]
        self.group_slot_mapping = [self._dev64[2 + i] for i in range(g)]
        self.group_block_tables = [self._dev32[mb + i * mb * nb: mb + (i + 1) * mb * nb].view(mb, nb) for i in range(g)]
        self.slot_mapping, self.block_tables = self.group_slot_mapping[0], self.group_block_tables[0]
        self.seq_lens = self._dev32[:mb]
        self.query_start_loc = torch.arange(mb + 1, dtype=torch.int32, device=device)
        # State-space (Mamba) layers: each row's recurrent-state slot, on the device (the kernels update the slots in
        # place); padding rows use the scratch slot (the last). model/layers/mamba_state.py.
        self.mamba_caches = mamba_caches
        if mamba_caches:
            self.scratch_slot = mamba_caches[0].ssm_state.shape[0] - 1
            self._host_slots = torch.full((mb,), self.scratch_slot, dtype=torch.int64, pin_memory=True)
            self.state_slots = torch.full((mb,), self.scratch_slot, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replay_ms: dict[int, float] = {}  # the routable buckets' replay times (time_buckets)
        self.route: dict[int, int] = {b: b for b in self.batch_sizes}
        self.pool = None
        self._copied = torch.cuda.Event()  # host staging may be rewritten once the last copies are done

    def _meta(self, batch: int) -> AttentionMetadata:
        meta = self._attention_meta(batch)
        if self.mamba_caches:  # every captured row continues its slot's state (run() clears fresh rows' slots)
            meta.mamba = MambaStateMetadata(self.state_slots[:batch], [self.scratch_slot] * batch, [True] * batch,
                                            self.mamba_caches)
        return meta

    def _attention_meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            block_tables=self.block_tables[:batch],
            seq_lens=self.seq_lens[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens_cpu=[self.max_model_len] * batch,
            query_lens_cpu=[1] * batch,
            num_decodes=batch,
            max_seq_len=self.max_model_len,
            max_query_len=1,
            backend=self.attn_backend,
        ).with_groups([(self.group_slot_mapping[i][:batch], self.group_block_tables[i][:batch])
                       for i in range(1, self.num_groups)])

    def _stage_state_slots(self, chunks: list[SequenceChunk], batch: int) -> None:
        """The rows' state slots to the device (padding rows: the scratch slot), and zeroed state for rows that start
        at position 0 (a one-token prompt)."""
        n = len(chunks)
        host = self._host_slots.numpy()
        host[:n] = [self.scratch_slot if c.state_slot is None else c.state_slot for c in chunks]
        host[n:batch] = self.scratch_slot
        self.state_slots[:batch].copy_(self._host_slots[:batch], non_blocking=True)
        fresh = [int(host[i]) for i, c in enumerate(chunks) if c.start_pos == 0]
        if fresh:
            clear_state_slots(self.mamba_caches, fresh)

    def _reset_padding(self) -> None:
        """Every row a harmless padding row: token 0 at position 0, slot -1, one token of context in block 0."""
        self._np64[:2] = 0
        self._np64[2:] = -1
        self._np32[:] = 0
        self._np32[: self.max_batch] = 1
        self._dev64.copy_(self._host64)
        self._dev32.copy_(self._host32)

    @torch.inference_mode()
    def capture(self, time_buckets: bool = True) -> None:
        """Capture every bucket, largest first, into one shared pool (warm-up run before each capture); then,
        with `time_buckets`, time them for routing (time_buckets)."""
        t0 = time.perf_counter()
        self._reset_padding()
        torch.cuda.synchronize(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.batch_sizes):
            meta = self._meta(b)
            args = (self.input_ids[:b], self.positions[:b], self.kv_caches, meta)
            self.model(*args)  # warm-up: Triton compilation, allocator caching
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[b] = self.model(*args)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        logger.info("Captured CUDA graphs for %d decode batch sizes (1..%d) in %.2f s",
                    len(self.batch_sizes), self.max_batch, time.perf_counter() - t0)
        if time_buckets:
            self.time_buckets()

    @torch.inference_mode()
    def time_buckets(self, reps: int = 2) -> None:
        """Replay every bucket from MIN_ROUTED_BUCKET up over padding rows (best of `reps`) and route each to
        the fastest larger bucket where that one is clearly faster (route_to_faster_buckets)."""
        sizes = [b for b in self.batch_sizes if b >= MIN_ROUTED_BUCKET]
        if len(sizes) < 2:
            return
        t0 = time.perf_counter()
        self._reset_padding()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for b in sizes:
            self.graphs[b].replay()  # warm (the first replay of a graph uploads it)
            best = float("inf")
            for _ in range(reps):
                start.record()
                self.graphs[b].replay()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end))
            self.replay_ms[b] = best
        self.route.update(route_to_faster_buckets(self.replay_ms))
        log_routes("decode graphs", self.replay_ms, self.route, time.perf_counter() - t0)

    def bucket(self, n: int) -> int:
        """The bucket a batch of `n` decodes replays: the smallest holding it, or the faster one it routes to."""
        i = bisect.bisect_left(self.batch_sizes, n)
        if i == len(self.batch_sizes):
            raise ValueError(f"batch of {n} decodes exceeds the largest captured batch {self.max_batch}.")
        return self.route[self.batch_sizes[i]]

    def can_run(self, chunks: list[SequenceChunk]) -> bool:
        return bool(self.graphs) and is_graphable(chunks, self.max_batch, self.max_blocks)

    def run(self, chunks: list[SequenceChunk], pending=None, table_rows: PersistentBlockTables | None = None
            ) -> torch.Tensor:
        """Fill the static buffers for `chunks` (padded to their bucket), replay, → hidden states [n, H].

        `pending` = (rows, sampler rows, sampled token ids): tokens taken from the device (see
        `model_runner.fill_pending_tokens`). `table_rows`: the runner's persistent block tables; the chunks' rows
        are gathered from it (else built from the chunks' lists)."""
        n = len(chunks)
        b = self.bucket(n)
        self._copied.synchronize()
        bs, nb, mb = self.block_size, self.max_blocks, self.max_batch
        np64, np32 = self._np64, self._np32
        pos = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=n)
        np64[0, :n] = np.fromiter((c.token_ids[0] for c in chunks), dtype=np.int64, count=n)
        np64[1, :n] = pos
        rows = table_rows.row_indices(chunks) if table_rows is not None else None
        blk_of_pos = np.empty(n, dtype=np.int64)
        for g in range(self.num_groups):
            lo = mb + g * mb * nb
            tables = np32[lo: lo + b * nb].reshape(b, nb)
            if rows is not None:
                tables[:n] = table_rows.gather(g, rows, nb)
                blk_of_pos[:] = tables[np.arange(n), pos // bs]
            else:
                for i, c in enumerate(chunks):
                    bt = c.group_block_tables[g - 1] if g and c.group_block_tables else c.block_table
                    fill_block_table_row(tables[i], bt)
                    blk_of_pos[i] = bt[pos[i] // bs]
            np64[2 + g, :n] = blk_of_pos * bs + pos % bs
            tables[n:b, 0] = 0  # padding rows n..b (they may hold a previous step's values)
        np32[:n] = pos + 1
        np64[:2, n:b] = 0
        np64[2:, n:b] = -1
        np32[n:b] = 1
        self._dev64[:, :b].copy_(self._host64[:, :b], non_blocking=True)
        self._dev32[:b].copy_(self._host32[:b], non_blocking=True)
        for g in range(self.num_groups):
            lo = mb + g * mb * nb
            self._dev32[lo: lo + b * nb].copy_(self._host32[lo: lo + b * nb], non_blocking=True)
        if self.mamba_caches:
            self._stage_state_slots(chunks, b)
        self._copied.record()
        if pending is not None:
            fill_pending_tokens(self.input_ids, *pending)
        self.graphs[b].replay()
        return self.outputs[b][:n]


def measure_capture_memory(
    model: nn.Module, kv_caches, attn_backend, block_size: int, max_num_seqs: int, max_model_len: int,
    max_num_batched_tokens: int | None = None, max_capture_tokens: int = 0, mamba_caches: list | None = None,
) -> int:
    """Device bytes that capturing every bucket keeps (graph pool + static buffers; with
    `max_capture_tokens` > 0 the piecewise graphs too), measured by a throw-away capture on `kv_caches`
    (a one-block cache will do: only shapes matter)."""
    from pagedllm.worker.model_runner import ModelRunner

    device = kv_caches[0][0].device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved(device)
    runner = ModelRunner(model, device, block_size, attn_backend)
    runner.mamba_caches = mamba_caches
    runner.capture_cuda_graphs(kv_caches, max_num_seqs, max_model_len, max_num_batched_tokens,
                               piecewise=max_capture_tokens > 0, max_capture_tokens=max_capture_tokens or None,
                               time_buckets=False)
    after = torch.cuda.memory_reserved(device)
    del runner
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return max(0, after - before)
