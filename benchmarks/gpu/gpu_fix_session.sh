#!/usr/bin/env bash
# gpu-fix session, part 1 (needs the bundled model on the device: the two-call recipe of the GGUF halves):
# FP8 accuracy on the bundled model, the FP8 / spec-decode / CUDA-graph tests on CUDA, the spec-decode
# sampling diagnosis, the FP8 GEMM microbenchmark. STEPS picks which (default: all, in this order). Each
# step has its own timeout and log (tarred into $OUT after each); a step is skipped when the overall budget
# (BUDGET_S) would not cover it.
set -u
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; R=/tmp/r; mkdir -p "$OUT" $R  # logs in $R, tarred into $OUT (8 files come back at most)
END=$(( $(date +%s) + ${BUDGET_S:-560} ))
source benchmarks/gpu/session_steps.sh  # step NAME TIMEOUT CMD...
PYT="python -m pytest -q -p no:cacheprovider -rA --tb=short"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/summary.txt"
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    | tee -a "$OUT/summary.txt"
for s in ${STEPS:-accuracy spec_tests graph_tests spec_diag fp8_tests fp8_gemm}; do case $s in
  accuracy)
    step accuracy 200 python benchmarks/fp8_accuracy.py --configs bf16 fp8-kv fp8-kv-w8 fp8-w8 fp32 \
        --output-json "$OUT/fp8_accuracy.json"
    grep -A6 "^config" "$R/accuracy.log" | grep -v INFO | tee -a "$OUT/summary.txt" ;;
  spec_tests)
    step spec_tests 220 $PYT -s tests/test_spec_decode.py
    grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$R/spec_tests.log" | tail -20 | tee -a "$OUT/summary.txt" ;;
  graph_tests)
    step graph_tests 120 $PYT tests/test_cuda_graphs.py
    tail -3 "$R/graph_tests.log" | tee -a "$OUT/summary.txt" ;;
  spec_diag)
    step spec_diag 200 python benchmarks/gpu/spec_sampling_diag.py --bundled --n 3000 --out "$OUT/spec_diag.json"
    grep -v "INFO\|it/s\]" "$R/spec_diag.log" | tail -20 | tee -a "$OUT/summary.txt" ;;
  fp8_tests)
    step fp8_tests 180 $PYT -s tests/test_fp8_quant_kernel.py tests/test_fp8_weights.py tests/test_fp8_kv_cache.py
    grep -E "passed|failed|agree|FAILED|Error" "$R/fp8_tests.log" | tail -12 | tee -a "$OUT/summary.txt" ;;
  fp8_gemm)
    step fp8_gemm 90 python -m pagedllm.benchmarks.fp8_gemm --out "$OUT/fp8_gemm.json"
    tail -22 "$R/fp8_gemm.log" >> "$OUT/summary.txt" ;;
esac; done
