#!/bin/bash
# GPU session for the next lent GPU (written 2026-12-05 after §73): what §73 left open. Three parts, one call each
# (PART=tests|hybrid|fp8), after device_setup.sh's carry calls (.whl, .gg1, .gg2). Writes to $OUT.
#   tests:  the CUDA tests §73.3's call did not reach (the whole `-m cuda` set; ~80 tests, more than one call's 600 s:
#           FILES picks a subset).
#   hybrid: where the hybrid KV cache's 0.81x on Gemma-3-1B goes (§73.4): both layouts' steps by kind and path,
#           their device time against the wall.
#   fp8:    an FP8 mixed step against a bf16 one at ~300 decode rows + ~1 100 prompt tokens (§73.2).
set -x
source benchmarks/gpu/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
case ${PART:-tests} in
  tests)
    PAGEDLLM_CUDA_HYBRID_KV_CACHE=1 timeout 560 python -m pytest ${FILES:-tests} -m cuda -q -p no:cacheprovider \
      --timeout=200 -rfE 2>&1 | tail -30 | tee "$OUT/cuda_tests.txt" ;;
  hybrid)
    python benchmarks/gpu/make_random_windowed.py /tmp/g1b gemma3-1b --config-only > /dev/null 2>&1
    PAGEDLLM_CUDA_HYBRID_KV_CACHE=1 timeout 400 python benchmarks/hybrid_kv_cache.py --model /tmp/g1b --load-format dummy \
      --device cuda --dtype bfloat16 --num-prompts 128 --input-len 4096 --output-len 256 \
      --kv-cache-memory-bytes 4000000000 --output-json "$OUT/hybrid_g1b.json" 2>&1 | grep -v "it/s\]" | tail -30 \
      | tee "$OUT/hybrid_g1b.txt" ;;
  fp8)
    for kv in auto fp8; do
      timeout 250 python benchmarks/gpu/profile_mixed_step.py l7b 300 100:600 $kv 1 1100 2>&1 | grep -v "it/s\]" \
        | tail -15 | tee "$OUT/mixed_l7b_$kv.txt"
    done ;;
esac
