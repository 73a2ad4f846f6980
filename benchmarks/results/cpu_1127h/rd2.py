"""Random 12 KB blocks read with a stand-in for work per byte: prefetching the next block as one burst vs in
slices spread over the work. Build first: gcc -O3 -mavx2 -mfma -fopenmp -shared -fPIC rd2.c -o rd2.so; run with
OMP_NUM_THREADS=2."""
import ctypes, time, torch
from pathlib import Path
lib = ctypes.CDLL(str(Path(__file__).with_name('rd2.so'))); lib.read_blocks_work.restype = ctypes.c_float
lib.read_blocks_work.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
total = 1 << 30; bsz = 12288; nblk = total // bsz
x = torch.randn(total // 4); idx = torch.randperm(nblk).to(torch.int32)
small = torch.randn(bsz // 4 * 64); sidx = torch.randint(0, 64, (nblk,), dtype=torch.int32)
for work in (0, 4, 8, 16):
    row = []
    # compute-only rate: blocks from a tiny resident region
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter(); lib.read_blocks_work(small.data_ptr(), sidx.data_ptr(), nblk, bsz // 4, 0, work, 0); best = min(best, time.perf_counter() - t0)
    row.append(f"resident {total/best/1e9:5.1f}")
    for pf, spread in ((0, 0), (1, 0), (1, 1)):
        best = 1e9
        for _ in range(3):
            t0 = time.perf_counter(); lib.read_blocks_work(x.data_ptr(), idx.data_ptr(), nblk, bsz // 4, pf, work, spread); best = min(best, time.perf_counter() - t0)
        row.append(f"pf={pf} spread={spread} {total/best/1e9:5.1f}")
    print(f"work {work:2d}: " + " | ".join(row) + " GB/s", flush=True)
