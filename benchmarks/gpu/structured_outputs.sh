#!/bin/bash
# GPU session script (1x H100): structured outputs on the bundled SmolLM2-135M (issue 19). Needs the bundled
# GGUF and the grammar wheels on the device (briefs' two-call recipe: /tmp/site holds both, PYTHONPATH set by
# the caller). Runs the structured-output GPU tests, then benchmarks/structured_outputs.py with 64 requests:
# xgrammar and llguidance with asynchronous scheduling (the GPU default), and xgrammar with synchronous steps
# (the ablation). Logs in $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/summary.txt"
t0=$(date +%s)
timeout 240 python3 -m pytest tests/test_bitmask_kernel.py tests/test_structured_outputs.py -q -x -p no:cacheprovider \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
for run in "xgrammar:" "guidance:--backend guidance" "xgrammar_sync:--no-async-scheduling"; do
  name=${run%%:*}; extra=${run#*:}
  t0=$(date +%s)
  timeout 150 python3 benchmarks/structured_outputs.py --num-requests 64 $extra > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  grep -a -E "^\[" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
done
