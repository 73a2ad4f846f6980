"""Plain data the engine sends to every worker each step (no core objects, cheap to serialise)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedllm.core.block_manager import leading_null_blocks


@dataclass
class SequenceChunk:
    """Tokens of one sequence to run this step: positions start_pos .. start_pos+len(token_ids)-1."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    # The engine passes its block manager's lists themselves (no copy per step): read them (and
    # `group_block_tables`) when the step launches, never after; a later step's scheduling changes them.
    block_table: list[int]
    sample: bool  # the chunk ends the sequence: return logits for its last token
    all_logits: bool = False  # return logits for every token (prompt_logprobs)
    lora_id: int = 0  # the request's LoRA adapter (lora_int_id), 0 for none
    # Images whose placeholder positions the chunk covers (multimodal.inputs.MultiModalFeature), or None.
    mm_features: list[Any] | None = None
    # An embeds prompt's rows (a CPU tensor [k, hidden_size]) that replace the token embeddings of the chunk's first
    # k positions (engine/prompt_embeds.py), or None.
    prompt_embeds: Any = None
    # A hybrid model's other KV cache groups (core/kv_cache_groups.py): their tables, group 1 first, each as long
    # as `block_table` (group 0's); None with one group.
    group_block_tables: list[list[int]] | None = None
    # A BERT pair prompt's second segment: positions from here on have token type 1 (None: every token type 0).
    token_type_start: int | None = None
    # The block manager's version of the sequence's tables (BlockManager.table_versions): while it holds, the worker
    # copies only entries past those it already has (worker/block_table_rows.py). None: rebuild the rows.
    table_version: int | None = None
    # A model with state-space (Mamba) layers: the recurrent-state slot the sequence owns (core's block manager).
    state_slot: int | None = None
    # Prefix caching of such a model: (offset, snapshot slot): the state after the chunk's first `offset` tokens goes
    # to that slot too (core/state_snapshots.py).
    state_snapshots: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class ExecuteModelRequest:
    chunks: list[SequenceChunk] = field(default_factory=list)  # decodes (one token) first
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Asynchronous scheduling (single process only): chunk i's last token is row r of the previous
    # step's sampled token ids, still on the device, for each (i, r).
    pending_inputs: list[tuple[int, int]] = field(default_factory=list)
    prev_sampled_token_ids: Any = None  # torch.Tensor [num_samples] int64 on the device
    # State-space layers: (src, dst) recurrent-state slots to copy before the step (a fork's parent → child).
    state_copies: list[tuple[int, int]] = field(default_factory=list)


def logits_row_layout(chunks: list[SequenceChunk]) -> list[tuple[int, int]]:
    """For each chunk, the [start, end) rows it owns in the returned logits (empty if none)."""
    layout = []
    row = 0
    for c in chunks:
        n = len(c.token_ids) if c.all_logits else (1 if c.sample else 0)
        layout.append((row, row + n))
        row += n
    return layout


def logits_rows(chunks: list[SequenceChunk], cu) -> list[int]:
    """Rows of a packed batch (`cu`: the chunks' query_start_loc) whose logits the chunks ask for: every
    row of an `all_logits` chunk, the last row of a sampling one."""
    rows: list[int] = []
    for i, c in enumerate(chunks):
        if c.all_logits:
            rows.extend(range(int(cu[i]), int(cu[i + 1])))
        elif c.sample:
            rows.append(int(cu[i + 1]) - 1)
    return rows


def split_into_decode_rows(chunks: list[SequenceChunk], max_query_len: int) -> list[SequenceChunk] | None:
    """One single-token chunk per query token, in order, when every chunk has at most `max_query_len` tokens
    (else None). Row j of a chunk starting at position p is the token at p + j, attending to the p + j + 1
    tokens up to and including itself: exactly the causal attention of the chunk's row j, since every row's
    K/V is written before any row's attention reads the cache. Speculative verification thereby runs
    through the decode path (its kernel and its CUDA graphs). Each row asks for logits (`sample`);
    the caller keeps the rows the original chunks asked for (`logits_rows`)."""
    if max_query_len < 2 or any(len(c.token_ids) > max_query_len for c in chunks):
        return None
    return [SequenceChunk(c.seq_id, [tok], c.start_pos + j, c.block_table, sample=True,
                          group_block_tables=c.group_block_tables, table_version=c.table_version)
            for c in chunks for j, tok in enumerate(c.token_ids)]


def fill_block_table_row(row: np.ndarray, table: list[int]) -> None:
    """`row[:len(table)] = table`, with the leading entries freed behind a sliding window (core's NULL_BLOCK, -1)
    written as block 0: a real block whose keys every window masks, so kernels and their index checks see valid
    ids. Most of a long context's table in a sliding group is such entries, so only the live tail is converted from
    the list (a step's tables are built row by row: BENCHMARKS.md §73.4)."""
    if not table or table[0] >= 0:
        row[: len(table)] = table
        return
    live = leading_null_blocks(table)
    row[:live] = 0
    row[live: len(table)] = table[live:]
