#!/bin/bash
# Offline throughput on the final code (Llama-3-8B shape, dummy bf16, 1000 ShareGPT-like requests,
# default scheduling: async on CUDA) with transformers' continuous batching on the first 64 requests
# in the same run.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $OUT/gpu.txt; cat $OUT/gpu.txt
python3 -c "from transformers import LlamaConfig; from pagedllm.benchmarks.roofline import LLAMA3_8B; LlamaConfig(**LLAMA3_8B).save_pretrained('/tmp/l8b')"
timeout ${T:-540} python3 benchmarks/throughput.py --model /tmp/l8b --load-format dummy --device cuda --dtype bfloat16 \
  --dataset sharegpt-like --num-prompts 1000 --skip-tokenizer-init --max-model-len 2048 --max-num-seqs 256 \
  --compare hf-cb --hf-num-prompts ${HF_N:-64} --output-json $OUT/throughput_vs_hf.json > $OUT/throughput_vs_hf.log 2>&1
echo "throughput rc=$?"; grep -v "it/s\]" $OUT/throughput_vs_hf.log | tail -12
