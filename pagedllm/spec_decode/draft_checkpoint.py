"""A separate draft checkpoint (vLLM's ``draft_model`` with ``speculative_config.model``): a smaller model that shares
the target's tokenizer proposes greedily.

Design: the draft is a second worker in the target's process (its own weights, attention backend, CPU direct forward)
whose KV pool has exactly the target's number of blocks and is indexed by the target's block tables: block id b holds
the target's K/V of those positions in the target's pool and the draft's in the draft's. The block manager therefore
allocates, frees, shares and truncates both at once, and nothing in `core/` knows the draft exists.

What the draft's pool holds is tracked per sequence, lazily: ``seq.extra["draft_kv"] = (table version, n)`` says that
the draft's K/V of the sequence's first n tokens are in the blocks of that version of its tables. When the draft
proposes, it first runs every token from n on as one chunk (the prompt on a first proposal, the one or two tokens
verification added since the last one otherwise), then one token per draft. A new table version (copy-on-write,
swap, preemption: anything but blocks appended or rejected drafts truncated, which `accepted` carries over) means the
blocks may not hold the draft's K/V of those tokens, and the draft starts again from position 0. A shared block (a
prefix-cache hit, a fork) may be written again by another sequence's catch-up: with the same tokens at the same
positions, so with the same values. A sequence that never speculates costs the draft nothing.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from pagedllm.core.sequence import Sequence
from pagedllm.model.models.registry import get_model_max_len, text_config
from pagedllm.worker.model_input import ExecuteModelRequest, SequenceChunk

logger = logging.getLogger("pagedllm")

#: seq.extra key: (table version, tokens whose draft K/V the pool holds) once a proposal was verified, or
#: (table version, tokens before the proposal, drafts fed) between proposing and verifying.
DRAFT_KV = "draft_kv"


def draft_engine_config(config: Any) -> Any:
    """The draft worker's EngineConfig: the target's, with the draft checkpoint as the model (same dtype, device,
    cache, scheduler and CUDA graph settings: its passes of one token per sequence replay decode graphs, the
    first pass of a proposal a piecewise or whole-step graph; speculative_config.enforce_eager overrides), no LoRA
    and no speculation of its own."""
    spec = config.speculative_config
    eager = config.model_config.enforce_eager if spec.enforce_eager is None else spec.enforce_eager
    mc = dataclasses.replace(config.model_config, model=spec.model, tokenizer=None, quantization=spec.quantization,
                             load_format="auto", enforce_eager=eager, runner="generate", pooler_config=None,
                             pooling_task=None, enable_prompt_embeds=False)
    return dataclasses.replace(config, model_config=mc, speculative_config=None, lora_config=None)


def load_draft_worker(target: Any) -> Any:
    """Load the draft checkpoint of ``target``'s speculative_config into a Worker of its own (ValueError naming what
    does not fit: another vocabulary, layouts the shared block tables cannot serve). A draft with a shorter context
    than the target's drafts for sequences within it (`DraftCheckpointProposer.max_drafts`), as in vLLM."""
    from pagedllm.model import loader
    from pagedllm.worker.worker import Worker

    if target.tp.size > 1:
        raise ValueError("speculative_config.model: a draft checkpoint runs in the target's process "
                         "(tensor_parallel_size=1).")
    config = draft_engine_config(target.config)
    name = config.model_config.model
    try:
        model_dir = loader.prepare_model_dir(name)
        hf_config = loader.load_config(model_dir)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    draft_vocab = int(text_config(hf_config).vocab_size)
    target_vocab = int(text_config(target.hf_config).vocab_size)
    if draft_vocab != target_vocab:
        raise ValueError(f"speculative_config.model {name!r} has a vocabulary of {draft_vocab} tokens, the target "
                         f"{target_vocab}: a draft checkpoint must share the target's tokenizer.")
    draft_len = get_model_max_len(hf_config, None)
    wanted = target.config.speculative_config.max_model_len
    if wanted is not None and wanted > draft_len:
        raise ValueError(f"speculative_config.max_model_len={wanted} is more than the {draft_len} positions the "
                         f"draft {name!r} takes.")
    worker = Worker(config, str(model_dir), hf_config)
    worker.is_draft = True
    for who, layout in (("the target", target.kv_layout), ("the draft", worker.kv_layout)):
        if layout.num_groups != 1 or layout.groups[0].sliding_window is not None:
            raise ValueError(f"speculative_config.model: {who} frees KV blocks behind a sliding window or keeps "
                             f"several KV cache groups, which the draft's pool under the target's block tables "
                             f"cannot follow; use a full-attention target and draft, or method 'ngram'.")
    if worker.no_kv_pool or worker.use_mla:
        raise ValueError(f"speculative_config.model {name!r}: a draft checkpoint must be a decoder with a paged "
                         f"K/V cache (no state-space layers, no latent attention).")
    worker.load_model()
    if getattr(worker.model, "mamba_state_shape", None) is not None:
        raise ValueError(f"speculative_config.model {name!r} has state-space layers, whose recurrent state cannot "
                         f"be rolled back after rejected drafts; pick an attention-only draft.")
    return worker


class DraftCheckpointProposer:
    """Greedy drafts from the draft worker of the target's worker (`Worker.draft_worker`)."""

    def __init__(self, executor: Any, block_manager: Any) -> None:
        target = getattr(executor, "driver_worker", None)
        draft = getattr(target, "draft_worker", None)
        if draft is None:
            raise ValueError("speculative_config.model: a draft checkpoint needs the single-process executor "
                             "(tensor_parallel_size=1, distributed_executor_backend None or 'uni').")
        self.target = target
        self.block_manager = block_manager
        # Positions the draft takes: a sequence drafts only while its drafts fit (`max_drafts`).
        self.max_len = target.config.speculative_config.max_model_len or get_model_max_len(draft.hf_config, None)
        self.pass_seconds: list[float] = []  # the last proposal's one-token passes (after its first), timed
        self.vocab_size = int(text_config(target.hf_config).vocab_size)

    @property
    def worker(self) -> Any:
        return self.target.draft_worker  # (a level-2 wake-up builds a new one)

    def max_drafts(self, seq: Sequence) -> int:
        """How many drafts the draft can propose for ``seq`` within its context: it runs every token up to the
        sequence's last and all drafts but the last (0: the sequence is past it and decodes without drafts)."""
        return max(0, self.max_len + 1 - seq.get_len())

    def _held(self, seq: Sequence) -> int:
        """Tokens of ``seq`` whose draft K/V its current blocks hold."""
        state = seq.extra.get(DRAFT_KV)
        if state is None or len(state) != 2 or state[0] != self.block_manager.table_version(seq):
            return 0
        return min(state[1], seq.get_len() - 1)  # the last token is always run: its logits give the first draft

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: list[int]) -> list[list[int]]:
        """k[i] greedy drafts for each sequence, whose slots for its last token and k[i] drafts are allocated."""
        bm = self.block_manager
        chunks = []
        for seq in seqs:
            start = self._held(seq)
            chunks.append(SequenceChunk(seq.seq_id, seq.tokens_slice(start, seq.get_len()), start,
                                        bm.get_block_table(seq), sample=True))
        out: list[list[int]] = [[] for _ in seqs]
        live = list(range(len(seqs)))
        self.pass_seconds = []
        for step in range(max(k, default=0)):
            live = [i for i in live if len(out[i]) < k[i]]
            if not live:
                break
            # One-token chunks first, then the rest shortest first (what the attention backends expect).
            order = sorted(live, key=lambda i: len(chunks[i].token_ids))
            t0 = time.perf_counter()
            logits = self.worker.execute_model(ExecuteModelRequest([chunks[i] for i in order]))
            tokens = logits[:, :self.vocab_size].argmax(dim=-1).tolist()
            if step:  # (the first pass also runs the tokens the draft has not seen: a prompt, at first)
                self.pass_seconds.append(time.perf_counter() - t0)
            for i, tok in zip(order, tokens):
                out[i].append(int(tok))
                c = chunks[i]
                chunks[i] = SequenceChunk(c.seq_id, [int(tok)], c.start_pos + len(c.token_ids), c.block_table,
                                          sample=True)
        for seq, drafts in zip(seqs, out):  # fed: the tokens up to the last one, and every draft but the last
            seq.extra[DRAFT_KV] = (bm.table_version(seq), seq.get_len(), max(0, len(drafts) - 1))
        return out

    def accepted(self, seq: Sequence, num_kv_valid: int) -> None:
        """After verification and the blocks' truncation: the target's K/V of the first ``num_kv_valid`` tokens are
        valid; the draft's are for those it was fed (the drafts that were accepted, not the token after them)."""
        state = seq.extra.get(DRAFT_KV)
        if state is None or len(state) != 3:
            return
        _, before, fed = state
        seq.extra[DRAFT_KV] = (self.block_manager.table_version(seq), min(num_kv_valid, before + fed))
