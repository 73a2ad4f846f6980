#!/bin/bash
# Issue 20 on the GPU: whole-graph verification steps (worker/verify_graph.py). The CUDA-graph tests (the new
# verification-graph test included), then `pagedllm bench spec-decode` exactly as §17.1 (SmolLM2-135M config,
# dummy float32 weights) for the before/after comparison. Logs in $OUT.
set -o pipefail
source benchmarks/gpu/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
t0=$(date +%s)
timeout 150 python3 -m pytest tests/test_cuda_graphs.py -q -p no:cacheprovider -rA --tb=short > "$OUT/graph_tests.log" 2>&1
echo "graph tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/graph_tests.log")" | tee -a "$OUT/summary.txt"
t0=$(date +%s)
timeout ${BENCH_S:-200} python3 -m pagedllm.benchmarks.spec_decode --model .tok --load-format dummy --dtype float32 \
  --device cuda --num-prompts 100 --max-tokens 64 --concurrency 1 4 --sharegpt-prompts 128 \
  --sharegpt-concurrency 64 --sharegpt-max-out 256 --max-model-len 2048 --out "$OUT/spec_dummy.json" > "$OUT/spec_dummy.log" 2>&1
echo "spec bench (dummy) rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
grep -v "INFO\|it/s\]\|s/it\]" "$OUT/spec_dummy.log" | tail -25 | tee -a "$OUT/summary.txt"
