"""Random vs in-order reads of blocks of several sizes (1 GiB, 2 threads). Build: gcc -O3 -mavx2 -mfma -fopenmp -shared -fPIC rd.c -o rd.so;
run with OMP_NUM_THREADS=2."""
import ctypes, time, torch
from pathlib import Path
lib = ctypes.CDLL(str(Path(__file__).with_name("rd.so"))); lib.read_blocks.restype = ctypes.c_float
lib.read_blocks.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
total = 1 << 30
for bsz in (4096, 12288, 24576, 49152, 1 << 20):
    nblk = total // bsz
    x = torch.randn(total // 4)
    for order in ("seq", "rand"):
        idx = (torch.arange(nblk) if order == "seq" else torch.randperm(nblk)).to(torch.int32)
        for pf in (0, 1):
            best = 1e9
            for _ in range(4):
                t0 = time.perf_counter(); lib.read_blocks(x.data_ptr(), idx.data_ptr(), nblk, bsz // 4, pf); best = min(best, time.perf_counter() - t0)
            print(f"block {bsz:8d} {order:4s} pf={pf}: {total/best/1e9:5.1f} GB/s")
