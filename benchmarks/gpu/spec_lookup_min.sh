#!/bin/bash
# Issue 20 on the H100, bundled model (GGUF via device_setup.sh's two-call recipe): `pagedllm bench spec-decode`
# as in spec_real_model.sh, once per n-gram prompt_lookup_min in MINS (default "1 4"; num_speculative_tokens 4,
# prompt_lookup_max 4). SHAREGPT=0 skips the ShareGPT-like part.
set -o pipefail
source benchmarks/gpu/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for mn in ${MINS:-1 4}; do
  t0=$(date +%s)
  timeout ${BENCH_S:-200} python3 -m pagedllm.benchmarks.spec_decode --dtype ${DTYPE:-float32} --device cuda \
    --num-prompts 100 --max-tokens 64 --concurrency 1 4 --sharegpt-prompts ${SHAREGPT:-128} --sharegpt-concurrency 64 \
    --sharegpt-max-out 256 --max-model-len 2048 --num-gpu-blocks 8192 \
    --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": $mn}" \
    --out "$OUT/spec_min$mn.json" > "$OUT/spec_min$mn.log" 2>&1
  echo "== prompt_lookup_min=$mn rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  tail -4 "$OUT/spec_min$mn.log" | tee -a "$OUT/summary.txt"
done
