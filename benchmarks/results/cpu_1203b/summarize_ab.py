"""Best time per (ISA, config, tree) in attn_ab.sh's output, and old ÷ new: python summarize_ab.py FILE..."""
import collections
import re
import sys

best = collections.defaultdict(lambda: 1e9)
trees = []
for name in sys.argv[1:]:
    for line in open(name):
        m = re.match(r"round \d+ (\S+) (\S+): lens=(\S+) qlen=(\d+): ([\d.]+) ms", line)
        if m:
            isa, tree, lens, q, ms = m.groups()
            if tree not in trees:
                trees.append(tree)
            key = (isa, lens, q)
            best[key, tree] = min(best[key, tree], float(ms))
old, new = trees[:2]
for key in sorted({k for k, _ in best}):
    o, n = best[key, old], best[key, new]
    print(f"{key[0]:7s} lens={key[1][:40]:40s} qlen {key[2]}: {old} {o:7.2f} ms, {new} {n:7.2f} ms: {o / n:.2f}x")
