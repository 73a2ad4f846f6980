"""A step whose model run and sampling are queued on the device but not yet read back."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.core.scheduler import ScheduledSequence
from pagedllm.model.layers.sampler import SamplerOutput
from pagedllm.worker.model_input import SequenceChunk


@dataclass
class LaunchedStep:
    scheduled: list[ScheduledSequence]  # in chunk order: decodes first
    chunks: list[SequenceChunk]
    logits: torch.Tensor | None  # the rows the chunks asked for
    owners: list[ScheduledSequence] = field(default_factory=list)  # the sampled items, in sampler row order
    row_of_seq: dict[int, int] = field(default_factory=dict)  # seq_id → sampler row
    sampler_output: SamplerOutput | None = None
    sampling_launched: bool = False
    # The next schedule must wait for this step's tokens: forks (n > 1), beam search, penalties, min_tokens.
    needs_host_results: bool = False
    # Speculative decoding: seq_id → the drafts this step verifies (their chunks carry every row's logits).
    spec_drafts: dict[int, list[int]] = field(default_factory=dict)
    # Structured outputs: the sampler rows under a grammar, their (sequence, compiled grammar), and the job
    # filling their bitmask rows. A row whose sequence still waits for the previous step's token is filled
    # only after that step completed (the matcher must accept the token first).
    num_sample_rows: int = 0
    mask_rows: list[int] = field(default_factory=list)
    mask_seqs: list[tuple[Any, Any]] = field(default_factory=list)
    mask_waits_for_prev: bool = False
    mask_job: Future | None = None
