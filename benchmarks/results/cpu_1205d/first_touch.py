import numpy as np, time, mmap, os, sys
N = 1 << 30
def t(label, fn):
    t0 = time.perf_counter(); c0 = os.times(); fn(); c1 = os.times(); dt = time.perf_counter() - t0
    print(f"{label:40s} {dt*1e3:8.1f} ms  {N/dt/1e9:6.2f} GB/s  sys {c1.system-c0.system:.2f}s", flush=True)
keep = []
for rep in range(3):
    m = mmap.mmap(-1, N, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS); b = np.frombuffer(m, np.uint8)
    if sys.argv[1] == "huge": m.madvise(mmap.MADV_HUGEPAGE)
    t(sys.argv[1] + " fresh touch (kept)", lambda: b[::4096].fill(1)); keep.append((m, b))
