#!/usr/bin/env bash
# gpu-fix session, part 1 (needs the bundled model on the device, see the two-call recipe in the README of
# benchmarks/gpu): FP8 accuracy on the bundled model, the FP8 and spec-decode tests on CUDA, the spec-decode
# sampling diagnosis, the FP8 GEMM microbenchmark. Each step has its own timeout and log (tarred into $OUT); a step
# is skipped when the overall budget (BUDGET_S) would not cover it.
set -u
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; R=/tmp/r; mkdir -p "$OUT" $R  # logs in $R, tarred into $OUT after each step (8 files max)
END=$(( $(date +%s) + ${BUDGET_S:-560} ))
step() {  # step NAME TIMEOUT CMD...: run with min(TIMEOUT, time left), log to $R/NAME.log
  local name=$1 to=$2; shift 2
  local left=$(( END - $(date +%s) )); [ "$to" -gt "$left" ] && to=$left
  if [ "$to" -lt 20 ]; then echo "== $name skipped (no time)" | tee -a "$OUT/summary.txt"; return; fi
  local t0=$(date +%s)
  timeout "$to" "$@" > "$R/$name.log" 2>&1
  echo "== $name rc=$? ($(( $(date +%s) - t0 )) s, limit $to s)" | tee -a "$OUT/summary.txt"
  tar czf "$OUT/logs.tar.gz" -C $R .
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/summary.txt"
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    | tee -a "$OUT/summary.txt"
step accuracy 200 python benchmarks/fp8_accuracy.py --configs bf16 fp8-kv fp8-kv-w8 fp8-w8 fp32 \
    --output-json "$OUT/fp8_accuracy.json"
tail -8 "$R/accuracy.log" | tee -a "$OUT/summary.txt"
step spec_dist 120 python -m pytest tests/test_spec_decode.py -q -x -p no:cacheprovider -s -rA --tb=long \
    -k "sampling_distribution or chi_square or greedy_is_argmax"
tail -4 "$R/spec_dist.log" | tee -a "$OUT/summary.txt"
step spec_diag 150 python benchmarks/gpu/spec_sampling_diag.py --n 3000 --out "$OUT/spec_diag.json"
grep -v INFO "$R/spec_diag.log" | grep -v "it/s\]" | tail -14 | tee -a "$OUT/summary.txt"
step fp8_tests 180 python -m pytest tests/test_fp8_quant_kernel.py tests/test_fp8_weights.py tests/test_fp8_kv_cache.py \
    -q -p no:cacheprovider -s -rA --tb=short
grep -E "passed|failed|agree|FAILED|Error" "$R/fp8_tests.log" | tail -12 | tee -a "$OUT/summary.txt"
step fp8_gemm 90 python -m pagedllm.benchmarks.fp8_gemm --out "$OUT/fp8_gemm.json"
tail -22 "$R/fp8_gemm.log" >> "$OUT/summary.txt"
step spec_rest 200 python -m pytest tests/test_spec_decode.py -q -p no:cacheprovider -rA --tb=short \
    -k "not (sampling_distribution or chi_square or greedy_is_argmax)"
tail -4 "$R/spec_rest.log" | tee -a "$OUT/summary.txt"
