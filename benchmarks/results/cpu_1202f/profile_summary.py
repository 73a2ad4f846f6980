"""Shares of py-spy's raw samples (profile_{off,on}.raw.gz) inside run_closed_loop: leaf functions, a few
inclusive ones, and the main thread's libgomp samples by the C function that opened the team."""
import gzip
import sys
from collections import Counter

KERNELS = ('quant_linear', 'paged_attention_f32', 'rms_norm_f32', 'silu_and_mul_f32', 'rotary_embedding_f32',
           'quantize_rows_q8')
for name in sys.argv[1:] or ('profile_off.raw.gz', 'profile_on.raw.gz'):
    leaf, incl, gomp, tot = Counter(), Counter(), Counter(), 0
    for line in gzip.open(name, 'rt'):
        stack, n = line.rsplit(' ', 1)
        n = int(n)
        frames = [f.split(' (')[0] for f in stack.split(';')]
        if not any('run_closed_loop' in f for f in frames):
            continue
        tot += n
        leaf[frames[-1][:50]] += n
        for f in set(frames):
            incl[f[:60]] += n
        if 'libgomp' in stack.split(';')[-1]:
            parent = [f for f in frames if f in KERNELS or 'omp_fn' in f or f.endswith('_f32')]
            gomp[(parent[-1] if parent else frames[-3])[:50]] += n
    print(f'{name}: {tot} samples in the run')
    for k, v in leaf.most_common(10):
        print(f'  leaf {100 * v / tot:5.1f}% {k}')
    for k in ('quant_linear', 'paged_attention_f32', 'LlamaDirectForward.__call__', 'LLMEngine._complete_step'):
        print(f'  incl {100 * incl[k] / tot:5.1f}% {k}')
    for k, v in gomp.most_common(4):
        print(f'  libgomp under {k}: {100 * v / tot:5.1f}%')
