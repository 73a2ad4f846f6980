#!/bin/bash
# Issue 20 on the H100, bundled model (GGUF via device_setup.sh's two-call recipe): `pagedllm bench spec-decode`
# (copy workload, 1 and 4 concurrent; default n-gram config) with this tree's package (new) and the one carried
# in .oldpkg/ (old), alternating PAIRS times; SHAREGPT_NEW=1 adds the ShareGPT-like part to the first new run.
set -o pipefail
source benchmarks/gpu/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for i in $(seq 1 ${PAIRS:-2}); do
  for arm in new old; do
    pp=$PYTHONPATH; [ $arm = old ] && pp=$PWD/.oldpkg:/tmp/site
    sg=0; [ $arm = new ] && [ $i = 1 ] && [ "${SHAREGPT_NEW:-1}" = 1 ] && sg=128
    t0=$(date +%s)
    (cd /tmp && PYTHONPATH=$pp timeout ${BENCH_S:-150} python3 -m pagedllm.benchmarks.spec_decode --dtype float32 \
      --device cuda --num-prompts 100 --max-tokens 64 --concurrency 1 4 --sharegpt-prompts $sg \
      --sharegpt-concurrency 64 --sharegpt-max-out 256 --max-model-len 2048 --num-gpu-blocks 8192 \
      --out "$OUT/spec_${arm}_$i.json") > "$OUT/spec_${arm}_$i.log" 2>&1
    echo "== $arm pair $i rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
    grep -E "^copy|^sharegpt" "$OUT/spec_${arm}_$i.log" | tee -a "$OUT/summary.txt"
  done
done
