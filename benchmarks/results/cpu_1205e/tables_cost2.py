"""Host cost of one step's block tables per KV cache group: the row loop (model_runner before) against filling only
each row's live entries in one scatter. 111 sequences of ~4 300 tokens, blocks of 16 (272 entries); one full group
and 6 sliding groups whose tables hold NULL (-1) before their last 34 entries."""
import bisect, random, time
from itertools import chain
import numpy as np
rows, width, live = 111, 272, 34
rng = random.Random(0)
full = [[rng.randrange(60000) for _ in range(width)] for _ in range(rows)]
slid = [[[-1] * (width - live) + [rng.randrange(60000) for _ in range(live)] for _ in range(rows)] for _ in range(6)]
def loop(tabs):
    t = np.zeros((rows, width), dtype=np.int64)
    for i, tab in enumerate(tabs):
        t[i, :len(tab)] = tab
    np.maximum(t, 0, out=t)
    return t
def scatter(tabs):
    t = np.zeros((rows, width), dtype=np.int64)
    starts = [bisect.bisect_left(x, True, key=lambda b: b != -1) for x in tabs]
    lens = np.fromiter((len(x) - s for x, s in zip(tabs, starts)), dtype=np.int64, count=len(tabs))
    total = int(lens.sum())
    flat = np.fromiter(chain.from_iterable(x[s:] for x, s in zip(tabs, starts)), dtype=np.int64, count=total)
    seq = np.repeat(np.arange(len(tabs)), lens)
    offs = np.cumsum(lens) - lens
    t[seq, np.arange(total) - (offs - np.asarray(starts))[seq]] = flat
    return t
def best(f, tabs):
    r = []
    for _ in range(30):
        t0 = time.perf_counter(); f(tabs); r.append(time.perf_counter() - t0)
    return min(r) * 1e3
for name, f in (("loop", loop), ("scatter", scatter)):
    assert all((loop(x) == scatter(x)).all() for x in [full, *slid])
    print(f"{name}: full group {best(f, full):.3f} ms, one sliding group {best(f, slid[0]):.3f} ms, "
          f"step of 1 + 6 groups {best(f, full) + sum(best(f, s) for s in slid):.2f} ms")
from array import array
def arr(tabs):
    t = np.zeros((rows, width), dtype=np.int64)
    flat = array("q")
    lens = np.empty(len(tabs), dtype=np.int64)
    for i, x in enumerate(tabs):
        flat.extend(x)
        lens[i] = len(x)
    vals = np.frombuffer(flat, dtype=np.int64)
    seq = np.repeat(np.arange(len(tabs)), lens)
    offs = np.cumsum(lens) - lens
    t[seq, np.arange(len(vals)) - offs[seq]] = vals
    np.maximum(t, 0, out=t)
    return t
assert all((loop(x) == arr(x)).all() for x in [full, *slid])
print(f"array: full group {best(arr, full):.3f} ms, one sliding group {best(arr, slid[0]):.3f} ms, "
      f"step of 1 + 6 groups {best(arr, full) + sum(best(arr, s) for s in slid):.2f} ms")
def loop_live(tabs):
    t = np.zeros((rows, width), dtype=np.int64)
    for i, tab in enumerate(tabs):
        s = bisect.bisect_left(tab, True, key=lambda b: b != -1) if tab and tab[0] == -1 else 0
        t[i, s:len(tab)] = tab[s:]
    return t
assert all((loop(x) == loop_live(x)).all() for x in [full, *slid])
print(f"loop_live: full group {best(loop_live, full):.3f} ms, one sliding group {best(loop_live, slid[0]):.3f} ms, "
      f"step of 1 + 6 groups {best(loop_live, full) + sum(best(loop_live, s) for s in slid):.2f} ms")
from pagedllm.worker.model_input import fill_block_table_row
def helper(tabs):
    t = np.zeros((rows, width), dtype=np.int64)
    for i, tab in enumerate(tabs):
        fill_block_table_row(t[i], tab)
    return t
assert all((loop(x) == helper(x)).all() for x in [full, *slid])
print(f"fill_block_table_row: full group {best(helper, full):.3f} ms, one sliding group {best(helper, slid[0]):.3f} ms, "
      f"step of 1 + 6 groups {best(helper, full) + sum(best(helper, s) for s in slid):.2f} ms")
