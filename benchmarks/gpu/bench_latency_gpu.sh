#!/usr/bin/env bash
# `pagedllm bench latency --compare hf` on the Llama-3-8B shape (dummy bf16 weights; the HF peer is transformers'
# random initialisation of the same config), vLLM's default batch (8 x 32 in, 128 out). Into $OUT.
set -u
source benchmarks/gpu/device_setup.sh > /tmp/setup.log 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "from transformers import LlamaConfig; from pagedllm.benchmarks.roofline import LLAMA3_8B; LlamaConfig(**LLAMA3_8B).save_pretrained('/tmp/l8b')"
timeout ${BENCH_S:-300} python3 -m pagedllm.entrypoints.cli bench latency --model /tmp/l8b --load-format dummy \
  --skip-tokenizer-init --disable-detokenize --dtype bfloat16 --max-model-len 2048 --gpu-memory-utilization 0.5 \
  --input-len 32 --output-len 128 --batch-size ${BATCH:-8} --num-iters-warmup ${WARM:-3} --num-iters ${ITERS:-10} \
  --compare hf --output-json "$OUT/latency_l8b.json" 2>&1 | tee "$OUT/latency_l8b.txt" | grep -v "it/s\]\|s/it\]" | tail -25
