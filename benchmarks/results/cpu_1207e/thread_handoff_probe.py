import sys, time, threading
from concurrent.futures import ThreadPoolExecutor
def pw(n=3000):
    s = 0
    for i in range(n): s += i*i
    return s
def native_sleep(): time.sleep(0.00015)   # releases the GIL for 150 us, like a GIL-free fill
def hold_gil(n=1500):  # Python work on the worker (holds the GIL)
    return pw(n)
pool = ThreadPoolExecutor(1)
pool.submit(lambda: None).result()
N = 300
def bench(label, fn):
    fn()
    t0 = time.perf_counter()
    for _ in range(N): fn()
    print(f"{label:55s} {1e6*(time.perf_counter()-t0)/N:7.1f} us")
for si in (5e-3, 1e-4, 1e-5):
    sys.setswitchinterval(si)
    print("switch interval", si)
    bench("python alone", lambda: pw())
    bench("python + inline 150us GIL-free", lambda: (native_sleep(), pw()))
    bench("submit GIL-free 150us, python, result", lambda: (lambda f: (pw(), f.result()))(pool.submit(native_sleep)))
    bench("submit no-op, python, result", lambda: (lambda f: (pw(), f.result()))(pool.submit(lambda: None)))
