"""Can a CUDA tensor alias pinned host memory (UVA) through __cuda_array_interface__, and what does a GEMM that
reads its weight from there cost against one that copies the weight in first? (--cpu-offload-gb's design choice.)"""
import time

import torch


class _Iface:
    def __init__(self, t: torch.Tensor) -> None:
        typestr = {torch.bfloat16: "<i2", torch.float16: "<f2", torch.float32: "<f4"}[t.dtype]
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": typestr, "data": (t.data_ptr(), False),
                                         "version": 2, "strides": None}


def uva_view(host: torch.Tensor) -> torch.Tensor:
    view = torch.as_tensor(_Iface(host), device="cuda")
    return view.view(host.dtype) if view.dtype != host.dtype else view


def timed(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


w_host = torch.randn(14336, 4096, dtype=torch.bfloat16).pin_memory()
w_dev = w_host.cuda()
try:
    w_uva = uva_view(w_host)
    print("UVA view:", w_uva.device, w_uva.dtype, "equal:", torch.equal(w_uva, w_dev))
except Exception as e:  # noqa: BLE001
    print("UVA view failed:", type(e).__name__, e)
    w_uva = None
staging = torch.empty_like(w_dev)
nbytes = w_host.numel() * 2
for m in (1, 16, 64, 256, 1024, 4096):
    x = torch.randn(m, 4096, dtype=torch.bfloat16, device="cuda")
    dev = timed(lambda: x @ w_dev.t())
    copy = timed(lambda: (staging.copy_(w_host, non_blocking=True), x @ staging.t()))
    line = f"M={m:5d}: resident {dev * 1e3:7.3f} ms, copy-in {copy * 1e3:7.3f} ms ({nbytes / copy / 1e9:5.1f} GB/s)"
    if w_uva is not None:
        uva = timed(lambda: x @ w_uva.t(), reps=3)
        line += f", UVA {uva * 1e3:8.3f} ms ({nbytes / uva / 1e9:5.1f} GB/s)"
    print(line)
