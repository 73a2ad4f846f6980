#!/usr/bin/env bash
# Issue 21 on the GPU, one run: FP8 KV tests (kernels vs reference, swap/CoW, engine pool + greedy agreement),
# then the FP8 vs bf16 decode-kernel benchmark. Results under $OUT.
set -u
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 300 python -m pytest tests/test_fp8_kv_cache.py -q -x -p no:cacheprovider 2>&1 | tail -30 | tee "$OUT/tests.txt"
timeout 200 python -m pagedllm.benchmarks.fp8_kv --batches 1 64 128 --contexts 2048 4096 8192 \
    --out "$OUT/fp8_kv.json" 2>&1 | tail -20 | tee "$OUT/fp8_kv.txt"
