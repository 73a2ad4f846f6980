import time, torch, sys
n = int(float(sys.argv[1]) * 2**30) // 4
t = time.perf_counter(); x = torch.empty(n); t1 = time.perf_counter()
x.fill_(1.0); t2 = time.perf_counter()
x.fill_(2.0); t3 = time.perf_counter()
s = x.sum(); t4 = time.perf_counter()
print(f"alloc {t1-t:.3f}s first-touch {t2-t1:.3f}s ({n*4/(t2-t1)/1e9:.2f} GB/s) second {t3-t2:.3f}s sum {n*4/(t4-t3)/1e9:.1f} GB/s")
import re; print([l for l in open('/proc/self/smaps_rollup') if 'AnonHuge' in l])
