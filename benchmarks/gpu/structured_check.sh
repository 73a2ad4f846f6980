#!/bin/bash
# GPU session script (1x H100), issue 19: validity of constrained generations per backend and scheduling
# mode (benchmarks/gpu/structured_validity.py), then the structured-output tests. Set-up as structured_outputs.sh.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 60 python3 benchmarks/gpu/llguidance_tokenizer_diag.py 2>&1 | grep -a "^==" | tee -a "$OUT/summary.txt"
for run in "xgrammar async" "guidance async"; do
  timeout 100 python3 benchmarks/gpu/structured_validity.py $run > "$OUT/valid_${run// /_}.log" 2>&1
  echo "validity $run rc=$?" | tee -a "$OUT/summary.txt"; grep -a -E "^==|invalid" "$OUT/valid_${run// /_}.log" | tail -4 | tee -a "$OUT/summary.txt"
done
t0=$(date +%s)
timeout 240 python3 -m pytest tests/test_bitmask_kernel.py tests/test_structured_outputs.py -q -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
timeout 150 python3 benchmarks/structured_outputs.py --num-requests 64 --repeats 5 --backend guidance > "$OUT/guidance_e2e.log" 2>&1
echo "guidance e2e rc=$?" | tee -a "$OUT/summary.txt"; grep -a -E "^\[" "$OUT/guidance_e2e.log" | tee -a "$OUT/summary.txt"
