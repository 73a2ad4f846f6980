"""Property tests: fork / append / free / swap / prefix-cache sequences against a model of KV memory.

A dict stands in for the device and CPU pools (slot → the token whose K/V it holds). Every write
goes where the block table says, copy-on-write copies and swaps move slot contents, and after
every operation each live sequence must read back exactly its own tokens: a write into a slot
that another sequence can see would show up as a corrupted read.
"""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from pagedllm.core.block_manager import BlockManager
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus


class Memory:
    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.slots: dict[tuple[str, int, int], int] = {}

    def copy_block(self, src_pool: str, src: int, dst_pool: str, dst: int) -> None:
        for off in range(self.bm.block_size):
            key = (src_pool, src, off)
            if key in self.slots:
                self.slots[(dst_pool, dst, off)] = self.slots[key]
            else:
                self.slots.pop((dst_pool, dst, off), None)

    def grow(self, seq: Sequence, n: int) -> None:
        """allocate_slots + the step's CoW copies + writing tokens [computed, computed + n)."""
        bm = self.bm
        for src, dst in bm.allocate_slots(seq, n):
            self.copy_block("gpu", src, "gpu", dst)
        table = bm.get_block_table(seq)
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = table[pos // bm.block_size]
            # The property: a slot is written only through a block no other table references.
            assert bm.gpu_pool.ref_counts[block] == 1, f"write into shared block {block}"
            self.slots[("gpu", block, pos % bm.block_size)] = seq.get_token_id(pos)
        seq.num_computed_tokens += n
        bm.cache_computed_blocks(seq)

    def check(self, live: list[Sequence], swapped: list[SequenceGroup]) -> None:
        bm = self.bm
        for pool, seqs, tables in (("gpu", live, bm.block_tables),
                                   ("cpu", [s for g in swapped for s in g.seqs], bm.cpu_block_tables)):
            for seq in seqs:
                table = tables[seq.seq_id]
                for pos in range(seq.num_computed_tokens):
                    got = self.slots.get((pool, table[pos // bm.block_size], pos % bm.block_size))
                    assert got == seq.get_token_id(pos), f"seq {seq.seq_id} pos {pos}: {got} != {seq.get_token_id(pos)}"


ops = st.lists(
    st.tuples(st.sampled_from(["new", "append", "append", "fork", "free", "swap_out", "swap_in"]),
              st.integers(0, 10**6)),
    min_size=1,
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, block_size=st.sampled_from([1, 2, 4]), caching=st.booleans())
def test_cow_never_shares_a_written_slot(ops, block_size, caching):
    bm = BlockManager(block_size=block_size, num_gpu_blocks=32, num_cpu_blocks=16, enable_caching=caching)
    mem = Memory(bm)
    groups: list[list[Sequence]] = []  # live groups: a root and its forks (sharing-closed)
    swapped: list[SequenceGroup] = []
    next_id = 0

    def live() -> list[Sequence]:
        return [s for g in groups for s in g]

    for op, r in ops:
        if op == "new" or not groups:
            # Few distinct prompts, so prefix-cache hits are common.
            s = Sequence(next_id, [r % 3 + i % 4 for i in range(1 + r % 11)])
            next_id += 1
            s.num_computed_tokens = bm.allocate_cached_prefix(s)
            n = s.get_len() - s.num_computed_tokens
            if bm.num_blocks_to_grow(s, n) <= bm.get_num_free_gpu_blocks():
                mem.grow(s, n)
                groups.append([s])
            else:
                bm.free(s)
        elif op == "append":
            g = groups[r % len(groups)]
            s = g[r % len(g)]
            s.append_token(r % 5, 0.0)
            if bm.num_blocks_to_grow(s, 1) <= bm.get_num_free_gpu_blocks():
                mem.grow(s, 1)
            else:
                s.output_token_ids.pop()
        elif op == "fork":
            g = groups[r % len(groups)]
            parent = g[r % len(g)]
            child = parent.fork(next_id)
            next_id += 1
            bm.fork(parent, child)
            g.append(child)
        elif op == "free":
            g = groups[r % len(groups)]
            bm.free(g.pop(r % len(g)))
            if not g:
                groups.remove(g)
        elif op == "swap_out":
            g = groups[r % len(groups)]
            group = SequenceGroup(f"g{next_id}", list(g), None, 0.0)
            next_id += 1
            if bm.can_swap_out(group):
                for gpu, cpu in bm.swap_out(group):
                    mem.copy_block("gpu", gpu, "cpu", cpu)
                groups.remove(g)
                swapped.append(group)
        elif op == "swap_in" and swapped:
            group = swapped[r % len(swapped)]
            if bm.can_swap_in(group):
                for cpu, gpu in bm.swap_in(group):
                    mem.copy_block("cpu", cpu, "gpu", gpu)
                swapped.remove(group)
                groups.append(list(group.seqs))
        bm.check_invariants()
        mem.check(live(), swapped)
    for s in live():
        bm.free(s)
    for g in swapped:
        for s in g.seqs:
            bm.free(s)
    bm.check_invariants()
    assert bm.get_num_free_gpu_blocks() == 32 and bm.get_num_free_cpu_blocks() == 16
    assert all(c == 0 for c in bm.gpu_pool.ref_counts) and all(c == 0 for c in bm.cpu_pool.ref_counts)


# -- scheduler: lockstep groups and prefix-cache counters (pure Python) -------------------------
def _scheduler(num_blocks: int, budget: int, caching: bool = False):
    from pagedllm.config import CacheConfig, SchedulerConfig
    from pagedllm.core.scheduler import Scheduler

    cc = CacheConfig(block_size=4, enable_prefix_caching=caching)
    cc.num_gpu_blocks, cc.num_cpu_blocks = num_blocks, 8
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16, watermark=0.0), cc)


def _run_step(sched) -> list:
    """One step; returns, per scheduled chunk, whether it completes its sequence (so it samples)."""
    out = sched.schedule()
    completes = [item.completes for item in out.scheduled]
    sched.mark_computed(out.scheduled)
    return completes


def test_multi_sequence_group_completes_in_lockstep():
    """Three recomputed beams (5 tokens each) under a 12-token budget: chunks run, none samples alone."""
    from types import SimpleNamespace

    sched = _scheduler(32, budget=12)
    seqs = [Sequence(i, [1, 2, 3, 4], output_token_ids=[i]) for i in range(3)]
    sched.add_seq_group(SequenceGroup("g", seqs, SimpleNamespace(n=3, best_of=3), 0.0))
    first = _run_step(sched)
    assert first and not any(first)
    second = _run_step(sched)
    assert second == [True, True, True]


def test_prefix_lookups_counted_once_per_admission():
    """A request that waits for blocks retries its lookup every step but is counted once."""
    sched = _scheduler(6, budget=64, caching=True)
    bm = sched.block_manager
    first = Sequence(0, list(range(12)))
    sched.add_seq_group(SequenceGroup("a", [first], None, 0.0))
    _run_step(sched)  # 3 blocks, cached when computed
    big = Sequence(1, list(range(100, 116)))  # 4 blocks: must wait until "a" leaves
    sched.add_seq_group(SequenceGroup("b", [big], None, 1.0))
    for _ in range(3):
        _run_step(sched)
    assert bm.stats.prefix_cache_queries == 12  # "b" looked up three times, admitted never
    for seq in (first, big):
        seq.status = SequenceStatus.FINISHED_STOPPED  # finish by hand
        sched.free_seq(seq)
        sched.free_finished_seq_groups()
        _run_step(sched)
    assert bm.stats.prefix_cache_queries == 12 + 16 and bm.stats.prefix_cache_hits == 0
    again = Sequence(2, list(range(12)))
    sched.add_seq_group(SequenceGroup("c", [again], None, 2.0))
    _run_step(sched)
    assert bm.stats.prefix_cache_queries == 12 + 16 + 12
    assert bm.stats.prefix_cache_hits == 8  # two full blocks of "a"'s prompt survived "b"'s eviction
