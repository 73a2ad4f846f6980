import torch, time
from pagedllm.model.layers.logits_ops import apply_top_k_top_p
torch.manual_seed(0)
x = torch.randn(64, 49152)*3
xm = x.masked_fill(torch.rand(64,49152) > 0.0005, float('-inf'))
cases = {'k50': (x,[50]*64,None), 'p.9': (x,None,[0.9]*64), 'k50p.9': (x,[50]*64,[0.9]*64), 'k20p.8': (x,[20]*64,[0.8]*64),
         'k4000p.9': (x,[4000]*64,[0.9]*64), 'masked k50p.9': (xm,[50]*64,[0.9]*64), 'masked k50': (xm,[50]*64,None), 'masked p.9': (xm,None,[0.9]*64)}
res = {k: [] for k in cases}
for _ in range(15):
    for name,(a,k,p) in cases.items():
        t=time.perf_counter(); apply_top_k_top_p(a,k,p); res[name].append(time.perf_counter()-t)
for name,v in res.items():
    v.sort(); print(f"{name:16s} min {v[0]*1e3:6.2f}  median {v[len(v)//2]*1e3:6.2f} ms")
