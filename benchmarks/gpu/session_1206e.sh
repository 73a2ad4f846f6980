#!/usr/bin/env bash
# Session 1206e (BENCHMARKS §80), call 1 (carries .whl, .tok): KV offloading on a Llama-3-8B-shaped dummy model
# (pagedllm bench kv-offload), the swap kernel's CUDA test and the CUDA swap/preemption tests. Output into $OUT.
set -u
source benchmarks/gpu/device_setup.sh > /tmp/setup.log 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "from transformers import LlamaConfig; from pagedllm.benchmarks.roofline import LLAMA3_8B; LlamaConfig(**LLAMA3_8B).save_pretrained('/tmp/l8b')"
timeout ${TEST_S:-150} python3 -m pytest -q -p no:cacheprovider -k "swap or copy" tests/test_triton_kernels.py \
  tests/test_fp8_kv_cache.py > "$OUT/tests_swap.txt" 2>&1
echo "swap tests rc=$?"; tail -3 "$OUT/tests_swap.txt"
timeout ${BENCH_S:-360} python3 -m pagedllm.entrypoints.cli bench kv-offload --model /tmp/l8b --load-format dummy \
  --skip-tokenizer-init --dtype bfloat16 --device cuda --num-docs ${DOCS:-24} --doc-len ${DOC_LEN:-2048} \
  --rounds ${ROUNDS:-3} --concurrency ${CONC:-4} --max-tokens 8 --kv-offloading-size ${TIER_GIB:-8} \
  --out "$OUT/kv_offload_l8b.json" > "$OUT/kv_offload_l8b.txt" 2>&1
echo "bench rc=$?"; grep -v " INFO " "$OUT/kv_offload_l8b.txt" | tail -12
grep -E "KV offloading|KV cache:" "$OUT/kv_offload_l8b.txt" | head -4
