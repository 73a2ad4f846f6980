"""Turns a step's chunks into one flat, unpadded batch of tensors and runs the model.

On CUDA (unless ``enforce_eager``), decode-only steps replay a captured CUDA graph instead
(``worker/cuda_graph.py``); everything else runs eagerly.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedllm.device_utils import async_tensor_h2d
from pagedllm.kernels.metadata import AttentionMetadata
from pagedllm.worker.model_input import SequenceChunk


class ModelRunner:
    def __init__(self, model: nn.Module, device: torch.device, block_size: int, attn_backend) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.attn_backend = attn_backend
        self.graph_runner = None  # a CUDAGraphRunner once capture_cuda_graphs ran

    def capture_cuda_graphs(self, kv_caches, max_num_seqs: int, max_model_len: int) -> None:
        """Capture decode-step graphs over `kv_caches` (CUDA only) for bucketed batches up to max_num_seqs."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {self.device}.")
        from pagedllm.worker.cuda_graph import CUDAGraphRunner

        runner = CUDAGraphRunner(self.model, kv_caches, self.attn_backend, self.block_size, max_num_seqs,
                                 max_model_len)
        runner.capture()
        self.graph_runner = runner

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
        tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        for i, c in enumerate(chunks):
            tables[i, : len(c.block_table)] = c.block_table
        bs = self.block_size
        slots = tables[seq_of_token, positions // bs] * bs + positions % bs
        seq_lens = starts + qlens
        num_decodes = 0
        while num_decodes < num_seqs and qlens[num_decodes] == 1:
            num_decodes += 1

        logits_idx: list[int] = []
        for i, c in enumerate(chunks):
            if c.all_logits:
                logits_idx.extend(range(int(cu[i]), int(cu[i + 1])))
            elif c.sample:
                logits_idx.append(int(cu[i + 1]) - 1)

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
        logits_indices = async_tensor_h2d(logits_idx, torch.int64, dev)
        return to(token_ids, torch.int64), to(positions, torch.int64), meta, logits_indices

    @torch.inference_mode()
    def execute_model(
        self,
        chunks: list[SequenceChunk],
        kv_caches,
        pending_inputs: list[tuple[int, int]] | None = None,
        prev_sampled_token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Run one step; returns float32 logits for the rows the chunks asked for (or None).

        `pending_inputs` (asynchronous scheduling): chunk i's last token is `prev_sampled_token_ids[r]`
        for each (i, r); it is copied on the device, so the host never waits for it.
        """
        if not chunks:
            return None
        gr = self.graph_runner
        if gr is not None and kv_caches is gr.kv_caches and gr.can_run(chunks):
            pending = None
            if pending_inputs:  # graph row i holds chunk i's one token
                pending = ([i for i, _ in pending_inputs], [r for _, r in pending_inputs], prev_sampled_token_ids)
            hidden = gr.run(chunks, pending)  # decode rows, in chunk order: each samples its one token
            return self.model.compute_logits(hidden).float()
        input_ids, positions, meta, logits_indices = self.prepare_inputs(chunks)
        if pending_inputs:
            ends = np.cumsum([len(c.token_ids) for c in chunks]) - 1
            fill_pending_tokens(input_ids, [int(ends[i]) for i, _ in pending_inputs],
                                [r for _, r in pending_inputs], prev_sampled_token_ids)
        hidden = self.model(input_ids, positions, kv_caches, meta)
        if logits_indices.numel() == 0:
            return None
        return self.model.compute_logits(hidden[logits_indices]).float()


def fill_pending_tokens(input_ids: torch.Tensor, positions: list[int], rows: list[int], sampled: torch.Tensor) -> None:
    """input_ids[positions[j]] = sampled[rows[j]], on the device (no host sync)."""
    dev = input_ids.device
    src = sampled.index_select(0, async_tensor_h2d(rows, torch.long, dev))
    input_ids.index_copy_(0, async_tensor_h2d(positions, torch.long, dev), src.to(input_ids.dtype))
