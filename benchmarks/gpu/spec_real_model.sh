#!/bin/bash
# Issue 20 on the GPU with the bundled SmolLM2-135M (real weights: the GGUF joined by device_setup.sh's two-call
# recipe), `pagedllm bench spec-decode` as in §17.1: 100 copy prompts x 64 tokens at 1 and 4 concurrent,
# ShareGPT-like 128 prompts at 64 concurrent; DTYPES picks the model dtypes (default: float32 bfloat16).
set -o pipefail
source benchmarks/gpu/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for dt in ${DTYPES:-float32 bfloat16}; do
  t0=$(date +%s)
  timeout ${BENCH_S:-200} python3 -m pagedllm.benchmarks.spec_decode --dtype $dt --device cuda --num-prompts 100 \
    --max-tokens 64 --concurrency 1 4 --sharegpt-prompts 128 --sharegpt-concurrency 64 --sharegpt-max-out 256 \
    --max-model-len 2048 --num-gpu-blocks 8192 --out "$OUT/spec_real_$dt.json" > "$OUT/spec_real_$dt.log" 2>&1
  echo "== spec bench (bundled model, $dt) rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  tail -5 "$OUT/spec_real_$dt.log" | tee -a "$OUT/summary.txt"
done
