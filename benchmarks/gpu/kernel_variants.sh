#!/bin/bash
# GPU session script (H100): decode-attention tuning variants at the latency-bound points.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 400 python3 benchmarks/decode_attention.py --batch ${B:-1 16 64} --context ${C:-512 2048 8192} --variants --json $OUT/kernels_variants.json > $OUT/kernels_variants.log 2>&1; echo rc=$?
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/kernels_variants.json"))
for r in d["rows"] if isinstance(d, dict) else d:
    if not isinstance(r, dict) or "paged_ms" not in r: continue
    best = r["best_contig_ms"]
    v = sorted(r.get("variants", {}).items(), key=lambda kv: kv[1])[:4]
    print(f"b{r['batch']} c{r['context']}: paged {r['paged_ms']*1e3:.1f}us best {best*1e3:.1f}us ratio {r['ratio']:.3f} | " +
          " ".join(f"{k}={t*1e3:.1f}({t/best:.2f})" for k, t in v))
PY
