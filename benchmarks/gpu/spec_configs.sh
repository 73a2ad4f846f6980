#!/bin/bash
# Issue 20 on the H100, bundled model (GGUF via device_setup.sh's two-call recipe): `pagedllm bench spec-decode`
# once per n-gram configuration in CONFIGS ("k:min:max ...", default "4:4:4 8:1:4 8:2:4"), copy workload at 1 and 4
# concurrent (100 prompts × 64 tokens); SHAREGPT=128 adds the ShareGPT-like part at 64 concurrent. METHOD=ngram_gpu
# runs the device-side proposer (default: ngram).
set -o pipefail
source benchmarks/gpu/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for cfg in ${CONFIGS:-4:4:4 8:1:4 8:2:4}; do
  IFS=: read -r k mn mx <<< "$cfg"
  t0=$(date +%s)
  timeout ${BENCH_S:-200} python3 -m pagedllm.benchmarks.spec_decode --dtype ${DTYPE:-float32} --device cuda \
    --num-prompts 100 --max-tokens ${MAX_TOKENS:-64} --concurrency 1 4 --sharegpt-prompts ${SHAREGPT:-0} --sharegpt-concurrency 64 \
    --sharegpt-max-out 256 --max-model-len 2048 --num-gpu-blocks 8192 \
    --speculative-config "{\"method\": \"${METHOD:-ngram}\", \"num_speculative_tokens\": $k, \"prompt_lookup_min\": $mn, \"prompt_lookup_max\": $mx}" \
    --out "$OUT/${METHOD:-ngram}_k${k}_min${mn}_max${mx}.json" > "$OUT/${METHOD:-ngram}_k${k}_min${mn}_max${mx}.log" 2>&1
  echo "== ${METHOD:-ngram} k=$k min=$mn max=$mx rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  tail -4 "$OUT/${METHOD:-ngram}_k${k}_min${mn}_max${mx}.log" | tee -a "$OUT/summary.txt"
done
