#!/bin/bash
# GPU session script (1x H100), issue 19: the structured-output GPU tests (jsonschema wheels carried), then
# benchmarks/gpu/profile_structured.py for each backend. Same set-up as structured_outputs.sh.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
timeout 200 python3 -m pytest tests/test_structured_outputs.py -q -x -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
for b in xgrammar guidance; do
  timeout 150 python3 benchmarks/gpu/profile_structured.py $b profile > "$OUT/profile_$b.log" 2>&1
  echo "profile $b rc=$?" | tee -a "$OUT/summary.txt"; grep -a "^==" "$OUT/profile_$b.log" | tee -a "$OUT/summary.txt"
done
