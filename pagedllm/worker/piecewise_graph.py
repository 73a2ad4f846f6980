"""Piecewise CUDA graphs for steps that carry prefill chunks (mixed prefill + decode, prefill-only).

A step of ``T`` tokens runs in the smallest captured token bucket ``B >= T``, or in a larger one whose pieces
replayed clearly faster at start-up (``time_buckets``). For each bucket the model
forward is captured as ``num_layers + 1`` graphs split at the attention calls (vLLM splits a
torch.compile graph at attention; here the split happens by hand, at the attention backend): piece 0
is the embedding and layer 0 up to its attention, piece i the rest of layer i-1 and layer i up to its
attention, the last piece ends with the final norm. Between pieces the attention backend runs eagerly on
the first ``T`` rows with the step's own metadata (any mix of decodes and prefill chunks, any context
length): it reads the layer's rotated q, k, v where the piece left them (strided views of the qkv
projection's output in the graphs' memory pool, held without owning it, as vLLM's weak-ref tensors: no
copy) and writes the static output buffer the next piece reads. Rows ``T..B`` are padding: stale but valid
token ids and positions, never written to the KV cache (attention never sees them), outputs ignored.

So a mixed step costs ``num_layers + 1`` graph replays plus the attention launches instead of a few
hundred eager launches, and the graphs never bake in the sequence layout.

A step of up to ``WHOLE_GRAPH_MAX_TOKENS`` tokens and the scheduler's sequence cap (at most
``WHOLE_GRAPH_MAX_SEQS``) replays one whole-step graph per bucket instead, attention inside: the layout is
static metadata read on the device, and one launch per layer attends for decodes and chunks alike
(``capture_whole``, kernels/triton_unified_attention.py). One replay instead of ~2 launches per layer from
the host, which cost more than a small model's whole step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.kernels.triton_warmup import qkv_like_steps
from pagedllm.worker.model_input import SequenceChunk

logger = logging.getLogger("pagedllm")

DEFAULT_MAX_CAPTURE_TOKENS = 8192
# Steps up to this many tokens (and sequences) replay one whole graph each, attention inside: the ~60
# attention-kernel launches of a piecewise replay cost 3-7 ms of host time (BENCHMARKS.md §49-§50).
WHOLE_GRAPH_MAX_TOKENS = 2048
WHOLE_GRAPH_MAX_SEQS = 256
WHOLE_GRAPH_MAX_CONTEXT = 4096


def capture_token_counts(max_num_batched_tokens: int, max_capture_tokens: int = DEFAULT_MAX_CAPTURE_TOKENS) -> list[int]:
    """Token buckets: 8, 16, 32, 64, then every 64 up to 512, every 128 up to 2048, every 256 up to 4096,
    every 512 beyond; up to min(max_num_batched_tokens, max_capture_tokens), which is always included.
    Padding: at most 50 % from 128 tokens, 25 % from 512."""
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}.")
    if max_capture_tokens < 1:
        raise ValueError(f"max_capture_tokens must be >= 1, got {max_capture_tokens}.")
    top = min(max_num_batched_tokens, max_capture_tokens)
    sizes = [8, 16, 32, 64]
    for step, end in ((64, 512), (128, 2048), (256, 4096), (512, top)):
        sizes += range(sizes[-1] + step, end + 1, step)
    return sorted({s for s in sizes if s < top} | {top})


def bucket_for(num_tokens: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding `num_tokens` tokens, or None when none does."""
    for b in buckets:
        if b >= num_tokens:
            return b
    return None


def fits_whole_graph(meta: AttentionMetadata, bucket_captured: bool, num_seq_slots: int, table_width: int) -> bool:
    """Whether a step laid out as `meta` may replay a whole-step graph: its bucket was
    captured, its sequences fit the graphs' static slots and block-table width, and no sequence's context is
    longer than WHOLE_GRAPH_MAX_CONTEXT (the unified kernel has no split-KV; past that, a few long decodes are
    faster in the decode kernel of a piecewise step than the launches it saves)."""
    return (bucket_captured and meta.num_seqs <= num_seq_slots and meta.block_tables.shape[1] <= table_width
            and meta.max_seq_len <= WHOLE_GRAPH_MAX_CONTEXT)


def static_whole_metadata(max_tokens: int, max_seqs: int, table_width: int, device: torch.device,
                          backend=None, num_kv_cache_groups: int = 1) -> AttentionMetadata:
    """The whole-step graphs' static metadata: KV slots for `max_tokens` rows (all -1), and block tables, context
    lengths and query offsets for `max_seqs` sequence slots (all empty); a slot mapping and tables per KV cache
    group of a hybrid model."""
    def slots_and_tables() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.full((max_tokens,), -1, dtype=torch.int64, device=device),
                torch.zeros((max_seqs, table_width), dtype=torch.int32, device=device))

    slot_mapping, block_tables = slots_and_tables()
    return AttentionMetadata(
        slot_mapping=slot_mapping, block_tables=block_tables,
        seq_lens=torch.zeros(max_seqs, dtype=torch.int32, device=device),
        query_start_loc=torch.zeros(max_seqs + 1, dtype=torch.int32, device=device),
        seq_lens_cpu=[0] * max_seqs, query_lens_cpu=[0] * max_seqs, num_decodes=0, max_seq_len=0,
        max_query_len=0, backend=backend, unified=True,
    ).with_groups([slots_and_tables() for _ in range(num_kv_cache_groups - 1)])


def stage_whole_step(static: AttentionMetadata, num_tokens: int, bucket: int, meta: AttentionMetadata) -> None:
    """Copy a step of `num_tokens` tokens laid out as `meta` into the static metadata before a replay of `bucket`:
    padding rows write no KV, and the sequence slots past the step own no rows. What the previous step left past
    the step's block-table columns and in unused slots is never read (no position reaches it)."""
    t, n = num_tokens, meta.num_seqs
    for group, step in zip(static.group_metadata or [static], meta.group_metadata or [meta]):
        group.slot_mapping[:t].copy_(step.slot_mapping)
        if bucket > t:
            group.slot_mapping[t:bucket].fill_(-1)
        group.block_tables[:n, : step.block_tables.shape[1]].copy_(step.block_tables)
    static.seq_lens[:n].copy_(meta.seq_lens)
    static.query_start_loc[: n + 1].copy_(meta.query_start_loc)
    static.query_start_loc[n + 1 :].fill_(t)


def is_piecewise_graphable(chunks: list[SequenceChunk], max_tokens: int) -> bool:
    """Any step whose token count fits the largest bucket (decode-only steps too, when the decode
    graphs cannot take them)."""
    return bool(chunks) and sum(len(c.token_ids) for c in chunks) <= max_tokens


class _BorrowedMemory:
    """Exposes a CUDA tensor's memory through ``__cuda_array_interface__`` as integers of its element size,
    without a reference to the tensor: ``torch.as_tensor`` of it is a view that does not own the memory."""

    _INT_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}

    def __init__(self, t: torch.Tensor) -> None:
        size = t.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape), "typestr": self._INT_TYPESTR[size], "data": (t.data_ptr(), False),
            "strides": tuple(st * size for st in t.stride()), "version": 2,
        }


def non_owning_view(t: torch.Tensor) -> torch.Tensor:
    """A view of `t`'s memory (same shape, strides, dtype) that does not keep it allocated. Valid as long as
    whatever writes that memory (here: a graph replay into its private pool) keeps writing it there."""
    return torch.as_tensor(_BorrowedMemory(t), device=t.device).view(t.dtype)


@dataclass
class _Site:
    """One attention call of the captured forward: where its inputs sit (non-owning views of the bucket's
    rows in the graph pool, written by the piece that ends at this call) and which layer it is."""

    kv_index: int
    scale: float
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    kv_cache_group: int = 0  # whose slot mapping and tables the layer reads (AttentionMetadata.group_metadata)
    latent_dim: int | None = None  # MLA (Attention.latent_dim): decodes take the MLA decode kernel at replay
    # GPT-OSS's attention sinks (Attention.sinks, a parameter: a reference of its own, not a view of the pool)
    sinks: torch.Tensor | None = None


class _SplitRecorder:
    """The attention backend the model sees while a bucket is captured: it ends the current piece,
    remembers the call, starts the next piece, and hands back the static output buffer."""

    name = "piecewise-capture"
    takes_latent_dim = True  # recorded with the call, handed to the real backend at replay

    def __init__(self, runner: "PiecewiseGraphRunner", num_tokens: int, capturing: bool) -> None:
        self.runner = runner
        self.t = num_tokens
        self.capturing = capturing
        self.sites: list[_Site] = []
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.graph: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        if self.capturing:
            self.graph = torch.cuda.CUDAGraph()
            self.graph.capture_begin(pool=self.runner.pool)

    def end(self) -> None:
        if self.capturing:
            self.graph.capture_end()
            self.graphs.append(self.graph)
            self.graph = None

    def forward(self, query, key, value, kv_cache, meta, scale, sliding_window=None, logits_soft_cap=None,
                latent_dim=None, sinks=None):
        r, t = self.runner, self.t
        if query.shape[0] != t:
            raise ValueError(f"piecewise capture: attention saw {query.shape[0]} tokens, the bucket has {t}.")
        self.end()
        kv_index = next(i for i, c in enumerate(r.kv_caches) if c is kv_cache)
        # Released to the pool when the model drops them; later pieces may reuse that memory, which is safe:
        # they replay after this attention has read it.
        views = (non_owning_view(query), non_owning_view(key), non_owning_view(value))
        self.sites.append(_Site(kv_index, scale, *views, sliding_window, logits_soft_cap, meta.kv_cache_group,
                                latent_dim, sinks))
        self.begin()
        return r.static_out[:t]


class PiecewiseGraphRunner:
    """Captures the model forward per token bucket in pieces split at attention, and replays it."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attn_backend,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_num_batched_tokens: int,
        max_capture_tokens: int = DEFAULT_MAX_CAPTURE_TOKENS,
        pool=None,
        num_kv_cache_groups: int = 1,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.num_groups = num_kv_cache_groups  # a hybrid model's KV cache groups (core/kv_cache_groups.py)
        self.attn_backend = attn_backend
        self.buckets = capture_token_counts(max_num_batched_tokens, max_capture_tokens)
        self.max_tokens = self.buckets[-1]
        device = kv_caches[0][0].device
        dtype = next(model.parameters()).dtype  # activations: not the KV pool's (an FP8 pool stores fp8)
        self.device = device
        mt = self.max_tokens
        self.input_ids = torch.zeros(mt, dtype=torch.int64, device=device)
        self.positions = torch.zeros(mt, dtype=torch.int64, device=device)
        self.static_out = torch.zeros((mt, num_heads, head_dim), dtype=dtype, device=device)
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        self.pool = pool
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.sites: dict[int, list[_Site]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replay_ms: dict[int, float] = {}  # the routable buckets' replay times (time_buckets)
        self.route: dict[int, int] = {b: b for b in self.buckets}
        # Whole-step graphs of single-sequence steps (capture_whole): bucket → graph, and its output.
        self.whole_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.whole_outputs: dict[int, torch.Tensor] = {}
        self._whole_meta: AttentionMetadata | None = None

    def _capture_meta(self, t: int, backend) -> AttentionMetadata:
        # Only the backend (and each group's index) is read during capture (attention itself runs at replay).
        meta = AttentionMetadata(
            slot_mapping=self.positions[:t], block_tables=self.positions[:1].view(1, 1), seq_lens=self.positions[:1],
            query_start_loc=self.positions[:2], seq_lens_cpu=[t], query_lens_cpu=[t], num_decodes=0,
            max_seq_len=t, max_query_len=t, backend=backend,
        )
        return meta.with_groups([(meta.slot_mapping, meta.block_tables)] * (self.num_groups - 1))

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, into one shared memory pool."""
        t0 = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for t in reversed(self.buckets):
                ids, pos = self.input_ids[:t], self.positions[:t]
                warm = _SplitRecorder(self, t, capturing=False)
                self.model(ids, pos, self.kv_caches, self._capture_meta(t, warm))  # compiles, sizes the allocator
                stream.synchronize()
                rec = _SplitRecorder(self, t, capturing=True)
                rec.begin()
                out = self.model(ids, pos, self.kv_caches, self._capture_meta(t, rec))
                rec.end()
                self.graphs[t], self.sites[t], self.outputs[t] = rec.graphs, rec.sites, out
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.static_out.zero_()
        n_pieces = sum(len(g) for g in self.graphs.values())
        logger.info("Captured piecewise CUDA graphs for %d token buckets (%d..%d tokens, %d pieces) in %.2f s",
                    len(self.buckets), self.buckets[0], self.max_tokens, n_pieces, time.perf_counter() - t0)

    @torch.inference_mode()
    def capture_whole(self, table_width: int, max_seqs: int, max_tokens: int = WHOLE_GRAPH_MAX_TOKENS) -> None:
        """Capture the whole forward, attention included, per token bucket up to `max_tokens`, for steps of up
        to `max_seqs` sequences, decodes and prefill chunks in any mix. Attention reads static metadata (the
        step's KV slots, padding rows -1; block tables, context lengths and query ranges of `max_seqs`
        sequences, padding ones without rows) in one launch whose grid covers the bucket's rows and every
        sequence slot (kernels/triton_unified_attention.py)."""
        sizes = [b for b in self.buckets if b <= max_tokens]
        if not sizes or max_seqs < 1:
            return
        t0 = time.perf_counter()
        dev = self.device
        meta = static_whole_metadata(self.max_tokens, max_seqs, table_width, dev, self.attn_backend, self.num_groups)
        self._whole_meta = meta
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for t in reversed(sizes):
                # No sequence owns a row here and every KV slot is -1: capturing writes no cache.
                step = AttentionMetadata(meta.slot_mapping[:t], meta.block_tables, meta.seq_lens,
                                         meta.query_start_loc, meta.seq_lens_cpu, meta.query_lens_cpu, 0, 0, 0,
                                         self.attn_backend, unified=True).with_groups(
                    [(g.slot_mapping[:t], g.block_tables) for g in (meta.group_metadata or [meta])[1:]])
                ids, pos = self.input_ids[:t], self.positions[:t]
                self.model(ids, pos, self.kv_caches, step)  # warm-up: compiles, sizes the allocator
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    out = self.model(ids, pos, self.kv_caches, step)
                self.whole_graphs[t], self.whole_outputs[t] = graph, out
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)
        logger.info("Captured whole-step CUDA graphs for steps of up to %d sequences, %d..%d tokens (%d buckets) "
                    "in %.2f s", max_seqs, sizes[0], sizes[-1], len(sizes), time.perf_counter() - t0)

    def takes_whole(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """True when the step replays a whole-step graph (``fits_whole_graph``)."""
        static = self._whole_meta
        if static is None:
            return False
        return fits_whole_graph(meta, bucket_for(num_tokens, self.buckets) in self.whole_graphs,
                                static.seq_lens.shape[0], static.block_tables.shape[1])

    def _run_whole(self, t: int, meta: AttentionMetadata) -> torch.Tensor:
        b = bucket_for(t, self.buckets)
        stage_whole_step(self._whole_meta, t, b, meta)
        self.whole_graphs[b].replay()
        return self.whole_outputs[b][:t]

    @torch.inference_mode()
    def time_buckets(self, reps: int = 1) -> None:
        """Replay every bucket's pieces from MIN_ROUTED_BUCKET tokens up without the attention between them
        (what the bucket's padding rows cost: their GEMM rows; best of `reps` after a warm replay) and route
        each to the fastest larger bucket where that one is clearly faster (cuda_graph.route_to_faster_buckets)."""
        from pagedllm.worker.cuda_graph import MIN_ROUTED_BUCKET, log_routes, route_to_faster_buckets

        sizes = [b for b in self.buckets if b >= MIN_ROUTED_BUCKET]
        if len(sizes) < 2:
            return
        t0 = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for b in sizes:
            best = float("inf")
            for i in range(reps + 1):
                start.record()
                for graph in self.graphs[b]:
                    graph.replay()
                end.record()
                end.synchronize()
                if i:  # the first replay uploads the graphs
                    best = min(best, start.elapsed_time(end))
            self.replay_ms[b] = best
        self.static_out.zero_()
        self.route.update(route_to_faster_buckets(self.replay_ms))
        log_routes("piecewise token buckets", self.replay_ms, self.route, time.perf_counter() - t0)

    def qkv_like_steps(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of `rows` tokens with the strides the steps hand to attention (triton_warmup.qkv_like_steps)."""
        return qkv_like_steps(rows, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, self.device)

    def can_run(self, chunks: list[SequenceChunk]) -> bool:
        return bool(self.graphs) and is_piecewise_graphable(chunks, self.max_tokens)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> tuple[torch.Tensor, str]:
        """Replay the bucket of len(input_ids) tokens → (hidden states [T, H], the path: "whole" when a whole-step
        graph took the step, else "piecewise", attention eagerly between the pieces)."""
        t = input_ids.shape[0]
        b = bucket_for(t, self.buckets)
        if b is None:
            raise ValueError(f"a step of {t} tokens exceeds the largest captured bucket {self.max_tokens}.")
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        if self.takes_whole(t, meta):
            return self._run_whole(t, meta), "whole"
        b = self.route[b]
        graphs, sites = self.graphs[b], self.sites[b]
        for i, graph in enumerate(graphs):
            graph.replay()
            if i < len(sites):
                site = sites[i]
                step = meta.group_metadata[site.kv_cache_group] if site.kv_cache_group else meta
                extra = {"latent_dim": site.latent_dim} if site.latent_dim is not None else {}
                if site.sinks is not None:
                    extra["sinks"] = site.sinks
                self.attn_backend.forward(site.query[:t], site.key[:t], site.value[:t],
                                          self.kv_caches[site.kv_index], step, site.scale, out=self.static_out[:t],
                                          sliding_window=site.sliding_window,
                                          logits_soft_cap=site.logits_soft_cap, **extra)
        return self.outputs[b][:t], "piecewise"
