#!/usr/bin/env bash
# Whole-step graphs with the unified attention kernel (issue 16), this tree against a carried old package (.oldpkg/),
# alternating: the ShareGPT-like closed loop at 64 on a SmolLM2-135M-shaped model with dummy bf16 weights (speculation
# off), and profile_mixed_step.py's LLaMA-7B step of 190 decodes + 5 × 160 prompt tokens. Output into $OUT.
set -u
source benchmarks/gpu/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 benchmarks/gpu/make_s135.py /tmp/s135
for i in ${ROUNDS:-1 2}; do
  for v in old new; do
    if [ $v = old ]; then PP=$PWD/.oldpkg:/tmp/site; else PP=$PWD:/tmp/site; fi
    PYTHONPATH=$PP timeout 150 python3 benchmarks/gpu/sharegpt_spec_probe.py --model /tmp/s135 --load-format dummy \
      --methods --repeats 3 2>&1 | tr '\r' '\n' | grep -v -E "^\s*$" > "$OUT/s135_${v}_$i.txt"
    echo "## s135 $v $i"; grep -E "^==|/" "$OUT/s135_${v}_$i.txt"
    PYTHONPATH=$PP timeout 150 python3 benchmarks/gpu/profile_mixed_step.py ${MIXED:-l7b 190 200:600 auto 5 160} \
      > "$OUT/l7b_${v}_$i.txt" 2>&1
    echo "## l7b $v $i"; grep "^JSON" "$OUT/l7b_${v}_$i.txt" | python3 -c "
import json, sys
d = json.loads(sys.stdin.read()[5:]); print({k: round(v, 2) for k, v in d.items() if k.endswith('_ms')})"
  done
done
