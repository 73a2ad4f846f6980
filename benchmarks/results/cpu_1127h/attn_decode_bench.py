"""Decode-only timing of the CPU paged attention: 4 KB pages vs huge pages for the caches; variant builds via -D flags."""
import ctypes, sys, time
import torch
from pagedllm.kernels import cpu_isa
from pagedllm.kernels.cpu_kernels import SOURCE, CpuKernels, build_library

BLOCK, HQ, HK, D = 16, 9, 3, 64
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_HUGEPAGE = 14

def alloc(shape, huge):
    n = 1
    for s in shape: n *= s
    if not huge:
        return torch.empty(shape)
    raw = torch.empty(n + (2 << 20) // 4)
    addr = raw.data_ptr(); aligned = (addr + (2 << 20) - 1) & ~((2 << 20) - 1)
    off = (aligned - addr) // 4
    t = raw[off:off + n].view(shape)
    length = (n * 4 + (2 << 20) - 1) & ~((2 << 20) - 1)
    rc = libc.madvise(aligned, length, MADV_HUGEPAGE)
    if rc: raise OSError(ctypes.get_errno())
    t._raw = raw
    return t

def inputs(seqs, ctx, qlen, layers, huge, one_pool):
    g = torch.Generator().manual_seed(seqs * 7 + ctx + qlen)
    per = -(-ctx // BLOCK)
    nb = seqs * per
    if one_pool:  # as the engine: one pool [layers, 2, blocks, ...]? engine has per-layer tensors; emulate big shared
        pool = alloc((layers, 2, nb, BLOCK, HK, D), huge); pool.copy_(torch.randn(pool.shape, generator=g))
        caches = [(pool[l, 0], pool[l, 1]) for l in range(layers)]
    else:
        caches = []
        for _ in range(layers):
            k = alloc((nb, BLOCK, HK, D), huge); k.copy_(torch.randn(k.shape, generator=g))
            v = alloc((nb, BLOCK, HK, D), huge); v.copy_(torch.randn(v.shape, generator=g))
            caches.append((k, v))
    tables = torch.randperm(nb, generator=g).to(torch.int32).view(seqs, per).contiguous()
    qsl = torch.arange(0, seqs * qlen + 1, qlen, dtype=torch.int32)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    return caches, tables, qsl, lens, torch.randn(seqs * qlen, HQ, D, generator=g)

def main():
    flags = tuple(a for a in sys.argv[1:] if a.startswith("-D"))
    isa = cpu_isa.detect_cpu_isa().name
    k = CpuKernels(ctypes.CDLL(str(build_library(SOURCE, isa, flags))), SOURCE, isa)
    for seqs, ctx, qlen in ((64, 300, 1), (16, 300, 1), (4, 500, 1), (4, 500, 5)):
        row = []
        for huge in (False, True):
            caches, tables, qsl, lens, q = inputs(seqs, ctx, qlen, 30, huge, False)
            out, best = torch.empty_like(q), 1e9
            for _ in range(7):
                t0 = time.perf_counter()
                for kc, vc in caches: k.paged_attention(out, q, kc, vc, tables, lens, qsl, D**-0.5, indices_checked=True)
                best = min(best, time.perf_counter() - t0)
            gb = seqs * ctx * 30 * 2 * HK * D * 4 / 1e9
            row.append(f"{'huge' if huge else '4k'} {1e3*best:7.2f} ms {gb/best:5.1f} GB/s")
            del caches
        print(f"{flags} {seqs}x{ctx}x{qlen}: " + " | ".join(row), flush=True)
main() if "--resident" not in sys.argv else None

def resident():
    flags = tuple(a for a in sys.argv[1:] if a.startswith("-D"))
    isa = cpu_isa.detect_cpu_isa().name
    k = CpuKernels(ctypes.CDLL(str(build_library(SOURCE, isa, flags))), SOURCE, isa)
    for seqs, ctx in ((2, 300), (8, 300), (64, 300)):
        caches, tables, qsl, lens, q = inputs(seqs, ctx, 1, 1, False, False)
        kc, vc = caches[0]; out = torch.empty_like(q); best = 1e9
        for _ in range(50):
            t0 = time.perf_counter(); k.paged_attention(out, q, kc, vc, tables, lens, qsl, D**-0.5, indices_checked=True); best = min(best, time.perf_counter() - t0)
        gb = seqs * ctx * 2 * HK * D * 4 / 1e9
        print(f"{flags} one layer, same cache each call {seqs}x{ctx}: {1e6*best:8.1f} us {gb/best:5.1f} GB/s  ({gb*1e3:.1f} MB)")
resident()
