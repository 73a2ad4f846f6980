"""Self-speculative draft: the target's own first `draft_num_layers` decoder layers, then its final
norm and lm_head (LayerSkip-style early exit), proposing greedily.

Design: the draft keeps no KV cache of its own. Its layers *are* the target's first layers, so the
KV entries they need for every accepted token are the ones the target already wrote into the paged
cache. Each draft step runs one token per sequence through those layers, writing layers < n of the
slots that this step's verification chunk owns (allocated by the engine before drafting); the
verification pass then rewrites every layer of those slots with the target's own values. Rejected
positions are rolled back by the engine like any other. No extra memory, no extra block accounting.

The draft is the target's inner model (`model.model`) called with the first n layers' caches: every decoder here
runs `zip(layers, kv_caches)`, so it stops after n layers and applies its final norm, with the model's own embedding
scaling (Gemma's normalizer, Granite's multiplier) and layer structure (post-norms, parallel residuals). Only
single-process executors are supported.
"""
from __future__ import annotations

import time

import torch

from pagedllm.worker.model_input import SequenceChunk


class DraftModelProposer:
    def __init__(self, executor, num_layers: int | None) -> None:
        worker = getattr(executor, "driver_worker", None)
        runner = getattr(worker, "model_runner", None)
        if worker is None:
            raise ValueError("speculative_config method 'draft_model' needs the single-process executor "
                             "(tensor_parallel_size=1).")
        self.worker = worker
        inner = getattr(worker.model, "model", None)
        if not (isinstance(inner, torch.nn.Module) and hasattr(inner, "layers") and hasattr(inner, "norm")):
            raise ValueError(f"self-speculation needs a decoder with `model.layers` and a final norm, not "
                             f"{type(worker.model).__name__}.")
        total = len(inner.layers)
        n = num_layers or max(1, total // 4)
        if n >= total:
            raise ValueError(f"speculative_config.draft_num_layers must be < the model's {total} layers, got {n}.")
        self.num_layers = n
        self._runner = runner
        self.pass_seconds: list[float] = []  # the last proposal's passes (one token per sequence each), timed

    @torch.inference_mode()
    def propose(self, chunks: list[SequenceChunk], k: list[int]) -> list[list[int]]:
        """chunks: each sequence's last token at its position, with its block table (slots for
        len(k_i)+1 positions already allocated). Returns k[i] greedy draft tokens per sequence."""
        runner = self.worker.model_runner
        model = self.worker.model
        inner = model.model
        kv = self.worker.cache_engine.gpu_cache
        out: list[list[int]] = [[] for _ in chunks]
        cur = list(chunks)
        live = list(range(len(chunks)))
        self.pass_seconds = []
        for step in range(max(k, default=0)):
            live = [i for i in live if len(out[i]) < k[i]]
            if not live:
                break
            t0 = time.perf_counter()
            batch = [cur[i] for i in live]
            input_ids, positions, meta, logits_idx = runner.prepare_inputs(batch)
            hidden = inner(input_ids, positions, kv[: self.num_layers], meta)
            toks = model.compute_logits(hidden[logits_idx]).argmax(dim=-1).tolist()
            self.pass_seconds.append(time.perf_counter() - t0)
            for j, i in enumerate(live):
                out[i].append(int(toks[j]))
                c = cur[i]
                cur[i] = SequenceChunk(c.seq_id, [int(toks[j])], c.start_pos + 1, c.block_table, sample=True)
        return out
