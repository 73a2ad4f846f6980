#!/usr/bin/env bash
# Issue 21 follow-up on the GPU, one device call (<= ~550 s): (1) the FP8 tests on CUDA (kernels with fp16 and
# bf16 dots, per-layer scales, calibration, engines), (2) the decode-kernel benchmark with the FP8 pool's
# dots in fp16 (the new default) and bf16 (the former path) against the bf16 pool, (3) FP8 accuracy on the
# bundled model with the fixed KV scales of 1.0 (fp8-kv, fp8-kv-w8) vs calibrated per-layer ones (fp8-kv-cal,
# fp8-kv-cal-w8). STEPS picks steps (default: all, in this order); each has its own timeout, cut to the
# overall budget (BUDGET_S, default 540 s); logs are tarred into $OUT after each step.
#
# The accuracy step needs the bundled GGUF and the engine's wheels (xgrammar, ...) on the device: the two-call
# recipe of benchmarks/gpu/device_setup.sh (first call carries .gg1 (+ .whl) and sources it, this call
# carries .gg2 on the same warm machine). Without the model the step is skipped with a note.
#
#   bash benchmarks/gpu/fp8_session2.sh            # OUT=/tmp/out by default
set -u
if [ -f benchmarks/gpu/device_setup.sh ]; then
  source benchmarks/gpu/device_setup.sh
else
  export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
  [ -f benchmarks/gpu/carried_wheels.sh ] && source benchmarks/gpu/carried_wheels.sh
fi
OUT=${OUT:-/tmp/out}; R=/tmp/r2; mkdir -p "$OUT" $R  # logs in $R, tarred into $OUT (8 files come back at most)
END=$(( $(date +%s) + ${BUDGET_S:-540} ))
source benchmarks/gpu/session_steps.sh  # step NAME TIMEOUT CMD...
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/summary.txt"
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    | tee -a "$OUT/summary.txt"
for s in ${STEPS:-tests kernel accuracy}; do case $s in
  tests)
    step tests 200 python -m pytest -q -p no:cacheprovider -rA --tb=short -s tests/test_fp8_kv_cache.py \
        tests/test_fp8_weights.py tests/test_fp8_quant_kernel.py tests/test_kv_scale_calibration.py
    grep -E "passed|failed|agree|FAILED|ERROR|Error" "$R/tests.log" | tail -16 | tee -a "$OUT/summary.txt" ;;
  kernel)
    step kernel 110 python -m pagedllm.benchmarks.fp8_kv --batches 1 64 128 --contexts 2048 4096 8192 \
        --fp8-dot-dtypes fp16 bf16 --out "$OUT/fp8_kv.json"
    grep -E "copy bandwidth|^batch|Error" "$R/kernel.log" | tee -a "$OUT/summary.txt" ;;
  accuracy)
    if ! python -c "from pagedllm.model.loader import prepare_model_dir; prepare_model_dir(None)" > "$R/model.log" 2>&1; then
      echo "== accuracy skipped: the bundled model is not on this device (carry .gg1/.gg2, see device_setup.sh)" \
          | tee -a "$OUT/summary.txt"; tail -2 "$R/model.log" | tee -a "$OUT/summary.txt"; continue
    fi
    step accuracy 230 python benchmarks/fp8_accuracy.py --configs bf16 fp8-kv fp8-kv-cal fp8-kv-w8 fp8-kv-cal-w8 \
        --output-json "$OUT/fp8_accuracy.json"
    grep -E "FP8 KV scales calibrated|Traceback|Error" "$R/accuracy.log" | tail -6 | tee -a "$OUT/summary.txt"
    python - "$OUT/fp8_accuracy.json" <<'PY' 2>&1 | tee -a "$OUT/summary.txt"
import json, sys
for r in json.load(open(sys.argv[1]))["summary"]:
    print(f"{r['config']:<14} agree {r['agreement_all']:.2%} prefix {r['agreement_prefix']:.2%} identical "
          f"{r['identical_requests']}/{r['num_requests']} teacher-forced {r['agreement_teacher_forced']:.2%} "
          f"text argmax {r['text_argmax_agreement']:.2%} ppl {r['perplexity']:.4f} ({r['ppl_rel_diff']:+.3%}) "
          f"|dNLL| {r['mean_abs_nll_diff']:.4f}")
PY
    ;;
  *) echo "unknown step $s" | tee -a "$OUT/summary.txt" ;;
esac; done
