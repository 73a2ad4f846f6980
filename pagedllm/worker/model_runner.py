"""Turns a step's chunks into one flat, unpadded batch of tensors and runs the model.

On CUDA (unless ``enforce_eager``), decode-only steps replay a captured CUDA graph instead
(``worker/cuda_graph.py``), and so do speculative verification steps, one decode row per query token;
steps with prefill chunks (and decode steps the decode graphs cannot take)
replay piecewise graphs split at attention (``worker/piecewise_graph.py``); steps larger than the
largest token bucket, or with a chunk asking for every token's logits, run eagerly, as do steps with image or
prompt-embedding rows (their input embeddings are built here, not from token ids).
"""
from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn

from pagedllm.distributed.parallel_state import PipelineParallelGroup
from pagedllm.device_utils import async_tensor_h2d
from pagedllm.kernels.compile_watch import CompileWatch
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.model.layers.mamba_state import MambaStateMetadata
from pagedllm.worker.block_table_rows import PersistentBlockTables
from pagedllm.worker.encoder_cache import EncoderCache
from pagedllm.worker.prompt_embeds import write_prompt_embeds
from pagedllm.worker.model_input import (SequenceChunk, fill_block_table_row, logits_rows,
                                         split_into_decode_rows)
from pagedllm.worker.step_stats import StepStats, StepWork, step_kind


class ModelRunner:
    def __init__(self, model: nn.Module, device: torch.device, block_size: int, attn_backend) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.attn_backend = attn_backend
        self.graph_runner = None  # a CUDAGraphRunner once capture_cuda_graphs ran
        self.piecewise_runner = None  # a PiecewiseGraphRunner once capture_cuda_graphs ran (piecewise=True)
        # Steps whose chunks all have at most this many query tokens run as decode rows (speculative
        # verification: 1 + num_speculative_tokens); 0 = only one-token chunks do.
        self.verify_query_len = 0
        self.table_width: int | None = None  # pad every block table to this width (fixed kernel variants)
        # A hybrid model's KV cache groups (core/kv_cache_groups.py): each step's metadata carries one slot mapping
        # and table per group (AttentionMetadata.group_metadata), as its attention layers were told.
        self.num_kv_cache_groups = 1 + max((getattr(m, "kv_cache_group", 0) for m in model.modules()), default=0)
        # Every sequence's tables as rows kept across steps (block_table_rows.py): a step copies new entries only.
        self.table_rows = PersistentBlockTables(self.num_kv_cache_groups)
        self.step_stats: StepStats | None = None
        # CPU, float32 or GGUF linears (Llama, Gemma, LayerNorm families): the stack's kernels called directly
        # (model/cpu_direct_forward.py)
        self.direct_forward = None
        # The pooling runner (embeddings): steps return the final hidden states of the rows asked for, in float32,
        # where a generating runner returns their logits.
        self.pooling = False
        # A classification model's `score` head (pooling runner): the rows a step returns are its label logits.
        self.classifier = None
        self.lora_manager = None  # --enable-lora: each step's token → adapter mapping goes to it (lora/manager.py)
        # A multimodal model's image embeddings, from an image's first prefill chunk until its placeholders ran.
        self.encoder_cache = EncoderCache() if getattr(model, "supports_multimodal", False) else None
        # A BERT-family encoder (model/models/bert.py) takes each token's type; no other model's forward does.
        self.takes_token_types = getattr(model, "supports_token_types", False)
        # --enable-prompt-embeds (the worker sets it): chunks may carry prompt-embedding rows (their prompt_embeds)
        self.prompt_embeds = False
        # A model with state-space (Mamba) layers: every layer's state slots (model/layers/mamba_state.py; the
        # worker sets them). The last slot is scratch space for chunks that own none (warm-up steps).
        self.mamba_caches: list | None = None
        # The Triton builds after the warm start (the worker installs it once the warm start is done on CUDA).
        self.compile_watch = CompileWatch()
        # This rank's pipeline stage (model/pipeline.py): the last stage's logits go to rank 0, which returns them,
        # or, with `defer_pipeline_logits` (several batches in the stages at once), returns PENDING_PIPELINE_LOGITS
        # and receives them later (the executor's receive_pipeline_logits), in launch order.
        self.pipeline: PipelineParallelGroup | None = None
        self.defer_pipeline_logits = False

    def enable_step_stats(self) -> StepStats:
        """Record every step's device time by kind and path from now on (see worker/step_stats.py)."""
        self.step_stats = StepStats()
        return self.step_stats

    def capture_cuda_graphs(self, kv_caches, max_num_seqs: int, max_model_len: int,
                            max_num_batched_tokens: int | None = None, piecewise: bool = True,
                            max_capture_tokens: int | None = None, verify_query_len: int = 0,
                            verify_max_num_seqs: int = 0, time_buckets: bool = True,
                            whole_steps: bool = True) -> None:
        """Warm start (CUDA only): capture decode-step graphs for bucketed batches up to max_num_seqs,
        piecewise graphs for token buckets up to max_num_batched_tokens, and compile every Triton
        attention variant the steps can reach, so that no step pays for a compilation. With
        `verify_query_len` >= 2 (speculative decoding), steps of up to `verify_max_num_seqs` sequences
        of up to that many query tokens each replay the decode graphs too, one row per query token
        (the buckets then reach verify_max_num_seqs × verify_query_len rows). `time_buckets`: time the decode
        and piecewise graphs and route steps to faster larger buckets (cuda_graph.route_to_faster_buckets).
        `whole_steps`: also capture whole-step graphs for steps with prompt chunks (piecewise_graph.capture_whole;
        cudagraph_mode FULL)."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}.")
        from pagedllm.kernels.triton_fused_moe import warm_up_fused_moe
        from pagedllm.kernels.triton_warmup import attention_variants, log_warm_up, warm_up_attention
        from pagedllm.worker.cuda_graph import CUDAGraphRunner
        from pagedllm.worker.piecewise_graph import (DEFAULT_MAX_CAPTURE_TOKENS, WHOLE_GRAPH_MAX_SEQS,
                                                     PiecewiseGraphRunner)

        verify_rows = min(verify_max_num_seqs, max_num_seqs) * verify_query_len if verify_query_len >= 2 else 0
        runner = CUDAGraphRunner(self.model, kv_caches, self.attn_backend, self.block_size,
                                 max(max_num_seqs, verify_rows), max_model_len, self.num_kv_cache_groups,
                                 self.mamba_caches)
        runner.capture(time_buckets)
        self.graph_runner = runner
        self.table_width = runner.max_blocks
        if verify_rows:
            self.verify_query_len = verify_query_len
        if not piecewise:
            if self.mamba_caches is not None:  # state-space layers: decode graphs only; prefill and mixed steps eager
                t0 = time.perf_counter()
                log_warm_up(self.warm_up_eager_attention(kv_caches) + warm_up_fused_moe(self.model)
                            + self.warm_up_steps(kv_caches), time.perf_counter() - t0)
            return
        attn = attention_geometry(self.model)
        pw = PiecewiseGraphRunner(self.model, kv_caches, self.attn_backend, *attn[:3],
                                  max_num_batched_tokens or max_model_len,
                                  max_capture_tokens or DEFAULT_MAX_CAPTURE_TOKENS, pool=runner.pool,
                                  num_kv_cache_groups=self.num_kv_cache_groups)
        pw.capture()
        if whole_steps:
            pw.capture_whole(self.table_width, min(max_num_seqs, WHOLE_GRAPH_MAX_SEQS))
        if time_buckets:
            pw.time_buckets()
        t0 = time.perf_counter()
        done = warm_up_attention(self.attn_backend, kv_caches[0], *pw.qkv_like_steps(min(pw.max_tokens, 512)),
                                 pw.static_out, self.table_width, attn[3], variants=attention_variants(self.model))
        self.piecewise_runner = pw
        done += warm_up_fused_moe(self.model) + self.warm_up_steps(kv_caches)
        log_warm_up(done, time.perf_counter() - t0)

    def warm_up_eager_attention(self, kv_caches, rows: int = 512) -> list[str]:
        """Compile every attention variant that eager steps reach (a hybrid model's prefill and mixed steps run
        eagerly: their decode split counts and decodes-before-chunks specialisations would otherwise compile in a
        request's step, BENCHMARKS.md §84.1); nothing for a model without attention layers."""
        if not kv_caches or self.device.type != "cuda":
            return []
        from pagedllm.kernels.triton_warmup import attention_variants, qkv_like_steps, warm_up_attention

        hq, hk, d, scale = attention_geometry(self.model)
        dtype = next(self.model.parameters()).dtype
        q, k, v = qkv_like_steps(rows, hq, hk, d, dtype, self.device)
        out = torch.zeros((rows, hq, d), dtype=dtype, device=self.device)
        return warm_up_attention(self.attn_backend, kv_caches[0], q, k, v, out, self.table_width, scale,
                                 variants=attention_variants(self.model))

    @torch.inference_mode()
    def warm_up_steps(self, kv_caches) -> list[str]:
        """Run a prefill-only, a mixed and a decode-only step end to end (input staging, graphs, attention,
        lm_head on 1–2 rows) so the first request loads no kernel. They write KV block 0 only, which no
        request owns yet (its first owner overwrites it before reading): with blocks of fewer than 8 tokens
        the table repeats block 0, so every position still has an entry."""
        table = [0] * -(-8 // self.block_size)
        pre = SequenceChunk(-1, [1] * 8, 0, table, sample=True)
        dec = SequenceChunk(-2, [1], 7, table, sample=True)
        steps = [[pre], [dec, pre], [dec], [dec, dec]]
        if self.mamba_caches is not None:  # a prefix-cache snapshot inside a chunk: the scans' snapshot variants
            scratch = self.mamba_caches[0].ssm_state.shape[0] - 1  # (these chunks own no slot: they run in scratch)
            steps.append([SequenceChunk(-3, [1] * 8, 0, table, sample=True, state_snapshots=[(4, scratch)])])
        for chunks in steps:
            self.execute_model(chunks, kv_caches)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return ["steps prefill/mixed/decode"]

    def prepare_inputs(self, chunks: list[SequenceChunk]):
        """→ (input_ids, positions, AttentionMetadata, logits_indices), built with vectorised numpy."""
        num_seqs = len(chunks)
        qlens = np.fromiter((len(c.token_ids) for c in chunks), dtype=np.int64, count=num_seqs)
        starts = np.fromiter((c.start_pos for c in chunks), dtype=np.int64, count=num_seqs)
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(qlens, out=cu[1:])
        num_tokens = int(cu[-1])
        token_ids = np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64, count=num_tokens)
        seq_of_token = np.repeat(np.arange(num_seqs), qlens)
        positions = starts[seq_of_token] + (np.arange(num_tokens) - cu[:-1][seq_of_token])
        max_blocks = max((len(c.block_table) for c in chunks), default=1) or 1
        if self.table_width is not None:
            max_blocks = max(max_blocks, self.table_width)
        rows = self.table_rows.row_indices(chunks)
        group_parts = [self._group_tables_and_slots(chunks, rows, g, max_blocks, seq_of_token, positions)
                       for g in range(self.num_kv_cache_groups)]
        tables, slots = group_parts.pop(0)
        seq_lens = starts + qlens
        num_decodes = 0
        while num_decodes < num_seqs and qlens[num_decodes] == 1:
            num_decodes += 1

        logits_idx = logits_rows(chunks, cu)

        dev = self.device
        to = lambda a, dt: torch.from_numpy(a).to(device=dev, dtype=dt, non_blocking=True)  # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=to(slots, torch.int64),
            block_tables=to(tables, torch.int32),
            seq_lens=to(seq_lens, torch.int32),
            query_start_loc=to(cu, torch.int32),
            seq_lens_cpu=seq_lens.tolist(),
            query_lens_cpu=qlens.tolist(),
            num_decodes=num_decodes,
            max_seq_len=int(seq_lens.max()) if num_seqs else 0,
            max_query_len=int(qlens.max()) if num_seqs else 0,
            backend=self.attn_backend,
        )
        meta.with_groups([(to(g_slots, torch.int64), to(g_tables, torch.int32)) for g_tables, g_slots in group_parts])
        if self.mamba_caches is not None:
            meta.mamba = self._mamba_metadata(chunks)
        logits_indices = async_tensor_h2d(logits_idx, torch.int64, dev)
        return to(token_ids, torch.int64), to(positions, torch.int64), meta, logits_indices

    def _mamba_metadata(self, chunks: list[SequenceChunk]) -> MambaStateMetadata:
        scratch = self.mamba_caches[0].ssm_state.shape[0] - 1 if self.mamba_caches else 0
        slots = [scratch if c.state_slot is None else c.state_slot for c in chunks]
        cuts = [(i, offset, slot) for i, c in enumerate(chunks) for offset, slot in c.state_snapshots
                if offset < len(c.token_ids)]  # (a chunk's end state is copied from its slot after the step)
        return MambaStateMetadata(async_tensor_h2d(slots, torch.int64, self.device), slots,
                                  [c.start_pos > 0 for c in chunks], self.mamba_caches, cuts)

    def _group_tables_and_slots(self, chunks: list[SequenceChunk], rows: np.ndarray | None, group: int, width: int,
                                seq_of_token: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """KV cache group `group`'s block tables [seqs, width] and slot mapping [tokens] for the step: gathered from
        the persistent rows `rows` (`PersistentBlockTables.row_indices`), or, with None, built from the chunks'
        lists (a chunk built without group tables, as the warm-up's, uses its one table for every group)."""
        if rows is not None:
            tables = self.table_rows.gather(group, rows, width)
        else:
            tables = np.zeros((len(chunks), width), dtype=np.int32)
            for i, c in enumerate(chunks):
                fill_block_table_row(tables[i], c.group_block_tables[group - 1] if group and c.group_block_tables
                                     else c.block_table)
        bs = self.block_size
        return tables, tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs

    @torch.inference_mode()
    def execute_model(
        self,
        chunks: list[SequenceChunk],
        kv_caches,
        pending_inputs: list[tuple[int, int]] | None = None,
        prev_sampled_token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Run one step; returns the logits for the rows the chunks asked for (or None), as `sampler_logits` hands them.

        `pending_inputs` (asynchronous scheduling): chunk i's last token is `prev_sampled_token_ids[r]`
        for each (i, r); it is copied on the device, so the host never waits for it.
        """
        if not chunks:
            return None
        if self.lora_manager is not None:
            self.lora_manager.set_mapping([c.lora_id for c in chunks], [len(c.token_ids) for c in chunks])
        stats = self.step_stats
        start = stats.start(self.device) if stats is not None else None
        if ((self.encoder_cache is not None and any(c.mm_features for c in chunks))
                or (self.prompt_embeds and any(c.prompt_embeds is not None for c in chunks))):
            return self._execute_with_embeds(chunks, kv_caches, pending_inputs, prev_sampled_token_ids, start)
        gr = self.graph_runner
        if gr is not None and kv_caches is gr.kv_caches and gr.can_run(chunks):
            pending = None
            if pending_inputs:  # graph row i holds chunk i's one token
                pending = ([i for i, _ in pending_inputs], [r for _, r in pending_inputs], prev_sampled_token_ids)
            hidden = gr.run(chunks, pending, self.table_rows)  # decode rows, in chunk order: each samples its token
            logits = self._head(hidden)
            if stats is not None:
                stats.stop(step_kind(chunks), "graph", len(chunks), start)
            return logits
        rows = split_into_decode_rows(chunks, self.verify_query_len) if gr is not None else None
        if rows is not None and kv_caches is gr.kv_caches and gr.can_run(rows):
            # Speculative verification: each query token a decode row of its own (see cuda_graph.py).
            ends = np.cumsum([len(c.token_ids) for c in chunks])
            pending = None
            if pending_inputs:
                pending = ([int(ends[i]) - 1 for i, _ in pending_inputs], [r for _, r in pending_inputs],
                           prev_sampled_token_ids)
            hidden = gr.run(rows, pending, self.table_rows)
            wanted = logits_rows(chunks, [0, *ends])
            logits = None
            if wanted:
                idx = async_tensor_h2d(wanted, torch.int64, self.device)
                logits = self._head(hidden[idx])
            if stats is not None:
                stats.stop(step_kind(chunks), "graph", len(rows), start, StepWork.of(chunks, len(wanted)))
            return logits
        input_ids, positions, meta, logits_indices = self.prepare_inputs(chunks)
        if pending_inputs:
            ends = np.cumsum([len(c.token_ids) for c in chunks]) - 1
            fill_pending_tokens(input_ids, [int(ends[i]) for i, _ in pending_inputs],
                                [r for _, r in pending_inputs], prev_sampled_token_ids)
        pw = self.piecewise_runner
        if pw is not None and kv_caches is pw.kv_caches and pw.can_run(chunks):
            hidden, path = pw.run(input_ids, positions, meta)
        elif self.direct_forward is not None and self.direct_forward.can_run(meta):
            path = "direct"
            hidden = self.direct_forward(input_ids, positions, kv_caches, meta)
        else:
            path = "eager"
            types = token_type_kwargs(chunks, positions) if self.takes_token_types else {}
            hidden = self.model(input_ids, positions, kv_caches, meta, **types)
        logits = None
        if logits_indices.numel():
            logits = self._head(hidden[logits_indices])
        if stats is not None:
            stats.stop(step_kind(chunks), path, int(input_ids.shape[0]), start,
                       StepWork.of(chunks, int(logits_indices.numel())))
        return logits

    def _execute_with_embeds(self, chunks: list[SequenceChunk], kv_caches, pending_inputs, prev_sampled_token_ids,
                             start) -> torch.Tensor | None:
        """A step with image placeholder rows or prompt-embedding rows: the images' embeddings and the prompts' rows
        merged into the input embeddings, run eagerly on the module path (CUDA graphs and the CPU direct forward
        take token ids)."""
        input_ids, positions, meta, logits_indices = self.prepare_inputs(chunks)
        if pending_inputs:
            ends = np.cumsum([len(c.token_ids) for c in chunks]) - 1
            fill_pending_tokens(input_ids, [int(ends[i]) for i, _ in pending_inputs],
                                [r for _, r in pending_inputs], prev_sampled_token_ids)
        if self.encoder_cache is not None and any(c.mm_features for c in chunks):
            embeds = self.encoder_cache.inputs_embeds(self.model, chunks, input_ids)
        else:
            embeds = self.model.embed_input_ids(input_ids)
        write_prompt_embeds(embeds, chunks)
        hidden = self.model(input_ids, positions, kv_caches, meta, inputs_embeds=embeds)
        logits = self._head(hidden[logits_indices]) if logits_indices.numel() else None
        if self.step_stats is not None:
            self.step_stats.stop(step_kind(chunks), "eager", int(input_ids.shape[0]), start,
                                 StepWork.of(chunks, int(logits_indices.numel())))
        return logits

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """What a step returns for its selected rows: logits (`sampler_logits`), or the pooling runner's hidden states
        (a classifier's: their label logits), in float32."""
        if self.pooling:
            return (hidden if self.classifier is None else self.classifier(hidden)).float()
        stage = self.pipeline
        if stage is None:
            return sampler_logits(self.model.compute_logits(hidden))
        if stage.is_last:
            logits = sampler_logits(self.model.compute_logits(hidden))
            if stage.tp_rank == 0:
                stage.send_to_driver(logits)
            return logits
        if stage.global_rank != 0:
            return hidden  # (not read: only rank 0's result is)
        return PENDING_PIPELINE_LOGITS if self.defer_pipeline_logits else stage.recv_from_last_stage(self.device)

    @torch.inference_mode()
    def run_decode_rows(self, rows, kv_caches) -> torch.Tensor:
        """Logits [R, V] of decode rows built on the device (`spec_decode.device_ngram.DecodeRows`), run eagerly
        (CUDA engines replay them in the decode graphs instead: engine/device_spec_loop.py)."""
        n = int(rows.input_ids.shape[0])
        seq_lens_cpu = rows.seq_lens.tolist()
        meta = AttentionMetadata(
            slot_mapping=rows.slot_mapping,
            block_tables=rows.block_tables,
            seq_lens=rows.seq_lens,
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=self.device),
            seq_lens_cpu=seq_lens_cpu,
            query_lens_cpu=[1] * n,
            num_decodes=n,
            max_seq_len=max(seq_lens_cpu, default=0),
            max_query_len=1,
            backend=self.attn_backend,
        )
        if self.direct_forward is not None and self.direct_forward.can_run(meta):
            hidden = self.direct_forward(rows.input_ids, rows.positions, kv_caches, meta)
        else:
            hidden = self.model(rows.input_ids, rows.positions, kv_caches, meta)
        return self.model.compute_logits(hidden)


class _PendingPipelineLogits:
    """What rank 0 returns for a step whose logits the last pipeline stage will send (see ModelRunner.pipeline)."""

    def __repr__(self) -> str:
        return "PENDING_PIPELINE_LOGITS"


PENDING_PIPELINE_LOGITS = _PendingPipelineLogits()


def sampler_logits(logits: torch.Tensor) -> torch.Tensor:
    """The logits as the sampler takes them: on CUDA in the model's dtype (the sampler's kernels read 16-bit
    logits and compute in float32; a float32 copy of [rows, vocab] cost ~0.4 ms a step at 1 000 rows of a
    128 k vocabulary), on CPU in float32 (its native kernels take float32)."""
    return logits if logits.is_cuda else logits.float()


def fill_pending_tokens(input_ids: torch.Tensor, positions: list[int], rows: list[int], sampled: torch.Tensor) -> None:
    """input_ids[positions[j]] = sampled[rows[j]], on the device (no host sync)."""
    dev = input_ids.device
    src = sampled.index_select(0, async_tensor_h2d(rows, torch.long, dev))
    input_ids.index_copy_(0, async_tensor_h2d(positions, torch.long, dev), src.to(input_ids.dtype))


def token_type_kwargs(chunks: list[SequenceChunk], positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"token_type_ids": ...} for a step with a BERT pair prompt (1 from each chunk's token_type_start on, 0
    elsewhere), else {} (the model's forward takes no such argument)."""
    if all(c.token_type_start is None for c in chunks):
        return {}
    never = 1 << 62
    starts = torch.tensor([never if c.token_type_start is None else c.token_type_start for c in chunks])
    lens = torch.tensor([len(c.token_ids) for c in chunks])
    per_token = torch.repeat_interleave(starts, lens).to(positions.device)
    return {"token_type_ids": (positions >= per_token).long()}


def attention_geometry(model: nn.Module) -> tuple[int, int, int, float]:
    """(query heads, KV heads, head_dim, scale) of this rank's attention layers."""
    from pagedllm.model.layers.attention import Attention

    for m in model.modules():
        if isinstance(m, Attention):
            return m.num_heads, m.num_kv_heads, m.head_dim, m.scale
    raise ValueError(f"{type(model).__name__} has no Attention layer to capture around.")
