"""CPU penalties, dense over [B, V] vs only the tokens each row saw: 64 rows of 49 152 logits, prompts of 0-300 and
outputs of 0-400 tokens, three settings; checks the bits are equal and times each (median of 15)."""
import random, statistics, time, torch
from pagedllm.model.layers.logits_ops import penalties_dense, penalties_on_seen_tokens
g = torch.Generator().manual_seed(0); rng = random.Random(0)
B, V = 64, 49152
x = torch.randn(B, V, generator=g) * 3
prompts = [[rng.randrange(0, V) for _ in range(rng.randint(0, 300))] for _ in range(B)]
outs = [[rng.randrange(0, 2000) for _ in range(rng.randint(0, 400))] for _ in range(B)]
for name, (pres, freq, rep) in {"presence 0.5": ([0.5] * B, [0.0] * B, [1.0] * B),
                                "frequency 0.7 + repetition 1.3": ([0.0] * B, [0.7] * B, [1.3] * B),
                                "all three, per-row values": ([rng.uniform(-2, 2) for _ in range(B)], [rng.uniform(-2, 2) for _ in range(B)],
                                                              [rng.choice([1.0, 0.8, 1.5]) for _ in range(B)])}.items():
    same = torch.equal(penalties_dense(x, prompts, outs, pres, freq, rep), penalties_on_seen_tokens(x, prompts, outs, pres, freq, rep))
    t = {}
    for nm, f in (("dense", penalties_dense), ("seen tokens", penalties_on_seen_tokens)):
        ts = []
        for _ in range(15):
            t0 = time.perf_counter(); f(x, prompts, outs, pres, freq, rep); ts.append(time.perf_counter() - t0)
        t[nm] = statistics.median(ts) * 1e3
    print(f"{name:32s} dense {t['dense']:6.2f} ms, seen tokens {t['seen tokens']:6.2f} ms ({t['dense'] / t['seen tokens']:.1f}x), bit-equal {same}")
