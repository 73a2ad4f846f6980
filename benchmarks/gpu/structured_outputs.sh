#!/bin/bash
# GPU session script (1x H100): structured outputs on the bundled SmolLM2-135M (issue 19). Needs the bundled
# GGUF and the grammar wheels on the device (briefs' two-call recipe: /tmp/site holds both, PYTHONPATH set by
# the caller). Runs the structured-output GPU tests (jsonschema's wheels carried too), then
# benchmarks/structured_outputs.py with 64 requests: llguidance (the default) and xgrammar with asynchronous
# scheduling (the GPU default), and llguidance with synchronous steps (the ablation); then the per-step
# times of benchmarks/gpu/profile_structured.py. Logs in $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/summary.txt"
timeout 120 python3 benchmarks/gpu/xgrammar_fill_scaling.py 2>&1 | grep -a -E "us/row" | tee -a "$OUT/summary.txt"
t0=$(date +%s)
timeout 240 python3 -m pytest tests/test_bitmask_kernel.py tests/test_structured_outputs.py -q -p no:cacheprovider \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
for run in "guidance:" "xgrammar:--backend xgrammar" "guidance_sync:--no-async-scheduling"; do
  name=${run%%:*}; extra=${run#*:}
  t0=$(date +%s)
  timeout 150 python3 benchmarks/structured_outputs.py --num-requests 64 --repeats 5 $extra > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  grep -a -E "^\[" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
done
for b in guidance xgrammar; do
  timeout 100 python3 benchmarks/gpu/profile_structured.py $b > "$OUT/steps_$b.log" 2>&1
  echo "per-step $b rc=$?" | tee -a "$OUT/summary.txt"; grep -a "^==" "$OUT/steps_$b.log" | tee -a "$OUT/summary.txt"
done
