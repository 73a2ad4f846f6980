"""Each sequence's block tables kept as rows of persistent arrays, one array per KV cache group.

A step's block tables were rebuilt from the chunks' lists every step: one list → numpy conversion per sequence and
group, which at 112 sequences × 7 groups × 272 entries (Gemma-3-1B at 4 k tokens, hybrid KV cache) cost more host
time than the GPU's whole decode step (BENCHMARKS.md §73.4, §75). Here, as in vLLM's worker-side block table, a
sequence keeps its row from step to step; a step copies only the entries appended since the sequence's last step,
and gathers the step's rows with one numpy index per group.

Which entries the worker may keep is told by the block manager's table version (``SequenceChunk.table_version``):
it changes whenever a table changes other than by appending (a new table, copy-on-write, truncation, swap-in). An
entry freed behind a sliding window keeps its old block id in the row: no query reads it again, and any id in a
row is a valid block, so kernels stay in bounds. ``PAGEDLLM_CHECK_BLOCK_TABLE_ROWS=1`` (the tests set it) checks
every step's rows against the chunks' tables.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from pagedllm.worker.model_input import SequenceChunk, fill_block_table_row

CHECK_ENV = "PAGEDLLM_CHECK_BLOCK_TABLE_ROWS"


@dataclass
class _Row:
    index: int  # in the arrays' second dimension
    version: int
    synced: int  # leading entries of the tables the row holds
    last_step: int


class PersistentBlockTables:
    """Rows [groups, capacity, width] (int32) that grow in both capacity and width as sequences and tables need."""

    def __init__(self, num_groups: int, width: int = 16, capacity: int = 64, check: bool | None = None) -> None:
        self.num_groups = num_groups
        self.rows = np.zeros((num_groups, capacity, width), dtype=np.int32)
        self._by_seq: dict[int, _Row] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._step = 0
        self.check = os.environ.get(CHECK_ENV) == "1" if check is None else check

    @property
    def width(self) -> int:
        return self.rows.shape[2]

    def ensure_width(self, width: int) -> None:
        if width > self.width:
            grown = np.zeros((self.num_groups, self.rows.shape[1], max(width, 2 * self.width)), dtype=np.int32)
            grown[:, :, : self.width] = self.rows
            self.rows = grown

    def row_indices(self, chunks: list[SequenceChunk]) -> np.ndarray | None:
        """Bring each chunk's rows up to date; → their indices in chunk order, or None when a chunk carries no table
        version (warm-up and draft steps: the caller builds that step's tables from the lists)."""
        if any(c.table_version is None for c in chunks):
            return None
        self._step += 1
        self.ensure_width(max((len(c.block_table) for c in chunks), default=0))
        out = np.empty(len(chunks), dtype=np.int64)
        for i, c in enumerate(chunks):
            row = self._by_seq.get(c.seq_id)
            n = len(c.block_table)
            if row is None or row.version != c.table_version or n < row.synced:
                row = self._claim(c.seq_id, c.table_version, row)
                self._write(row.index, c, 0)
                row.synced = n
            elif n > row.synced:
                self._write(row.index, c, row.synced)
                row.synced = n
            row.last_step = self._step
            out[i] = row.index
        if self.check:
            self.verify(chunks, out)
        return out

    def gather(self, group: int, indices: np.ndarray, width: int) -> np.ndarray:
        """Group `group`'s rows `indices`, their first `width` entries ([len(indices), width] int32, a copy)."""
        self.ensure_width(width)
        return self.rows[group, indices, :width]

    def verify(self, chunks: list[SequenceChunk], indices: np.ndarray) -> None:
        """Raise if a row differs from its chunk's table at an entry that is not freed (NULL_BLOCK, negative)."""
        for c, index in zip(chunks, indices):
            for g in range(self.num_groups):
                table = np.asarray(_table(c, g), dtype=np.int64)
                row = self.rows[g, index, : len(table)]
                live = table >= 0
                if not np.array_equal(row[live], table[live]):
                    raise RuntimeError(f"persistent block table of sequence {c.seq_id}, group {g} (version "
                                       f"{c.table_version}) differs from its table: {row.tolist()} vs "
                                       f"{table.tolist()}")

    def _claim(self, seq_id: int, version: int, row: _Row | None) -> _Row:
        if row is None:
            if not self._free:
                self._make_room()
            row = _Row(self._free.pop(), version, 0, self._step)
            self._by_seq[seq_id] = row
        row.version, row.synced = version, 0
        return row

    def _make_room(self) -> None:
        """Free the rows of sequences that are not in this step (finished, preempted or waiting: a later step
        rewrites them); if that frees under a quarter of the rows, double the capacity."""
        stale = [s for s, r in self._by_seq.items() if r.last_step < self._step]
        for s in stale:
            self._free.append(self._by_seq.pop(s).index)
        capacity = self.rows.shape[1]
        if not self._free or len(self._free) < capacity // 4:
            grown = np.zeros((self.num_groups, 2 * capacity, self.width), dtype=np.int32)
            grown[:, :capacity] = self.rows
            self.rows = grown
            self._free.extend(range(2 * capacity - 1, capacity - 1, -1))

    def _write(self, index: int, c: SequenceChunk, start: int) -> None:
        for g in range(self.num_groups):
            table = _table(c, g)
            row = self.rows[g, index]
            if start == 0:
                fill_block_table_row(row, table)
                row[len(table):] = 0
            else:
                seg = row[start: len(table)]
                seg[:] = table[start:]
                np.maximum(seg, 0, out=seg)  # (an appended entry is never freed yet; kept valid regardless)


def _table(c: SequenceChunk, group: int) -> list[int]:
    return c.group_block_tables[group - 1] if group and c.group_block_tables else c.block_table
