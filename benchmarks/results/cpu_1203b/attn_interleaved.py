"""Two builds of the attention kernel in one process, called alternately (each pass over 30 layers' pools, old then
new), so a slow spell of the machine hits both alike: python attn_interleaved.py OLD_CPU_OPS_C NEW_CPU_OPS_C PASSES
"LENS QLEN"...  (PAGEDLLM_CPU_ISA picks the build level). Prints each build's median and best ms per pass and
new ÷ old of the medians, and checks that both give the same output where contexts stay within one partition."""
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

from pagedllm.kernels import cpu_isa
from pagedllm.kernels.cpu_kernels import CpuKernels, build_library

isa = cpu_isa.detect_cpu_isa().name
old, new = (CpuKernels(ctypes.CDLL(str(p)), p, isa) for p in (build_library(Path(a), isa) for a in sys.argv[1:3]))
passes = int(sys.argv[3])
BS, HK, HQ, D, LAYERS = 16, 3, 9, 64, 30
print(f"{isa}, {torch.get_num_threads()} threads, {passes} passes per build")
for cfg in sys.argv[4:]:
    lens_s, qlen_s = cfg.split()
    lens, qlen = [int(x) for x in lens_s.split(",")], int(qlen_s)
    torch.manual_seed(0)
    per = (max(lens) + BS - 1) // BS
    nb = max(2048, len(lens) * per)
    kc = [torch.randn(nb, BS, HK, D) for _ in range(LAYERS)]
    vc = [torch.randn(nb, BS, HK, D) for _ in range(LAYERS)]
    tables = torch.randperm(nb)[: len(lens) * per].view(len(lens), per).to(torch.int32).contiguous()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    t = len(lens) * qlen
    q = torch.randn(t, HQ, D)
    qsl = torch.arange(0, t + 1, qlen, dtype=torch.int32)
    outs = {id(old): torch.empty_like(q), id(new): torch.empty_like(q)}
    times = {id(old): [], id(new): []}
    for i in range(passes + 1):
        for k in (old, new) if i % 2 == 0 else (new, old):
            start = time.perf_counter()
            for layer in range(LAYERS):
                k.paged_attention(outs[id(k)], q, kc[layer], vc[layer], tables, seq_lens, qsl, 0.125,
                                  indices_checked=True)
            if i:  # the first pass warms both up
                times[id(k)].append(time.perf_counter() - start)
    mo, mn = (statistics.median(times[id(k)]) * 1e3 for k in (old, new))
    bo, bn = (min(times[id(k)]) * 1e3 for k in (old, new))
    same = torch.equal(outs[id(old)], outs[id(new)])
    print(f"lens={lens_s[:40]} qlen={qlen}: old {mo:.2f} ms (best {bo:.2f}), new {mn:.2f} (best {bn:.2f}): "
          f"new/old {mn / mo:.2f}; outputs {'equal' if same else 'differ (partitioned contexts)'}", flush=True)
