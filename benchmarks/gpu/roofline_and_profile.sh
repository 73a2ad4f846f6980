#!/bin/bash
# GPU session script (H100): decode roofline with CUDA graphs, then where a batch-64 step goes.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
timeout 170 python3 benchmarks/roofline.py --batch 1 64 256 --context 1024 --json $OUT/roofline.json > $OUT/roofline.log 2>&1; echo rc=$?
grep -v "Processed\|Warning" $OUT/roofline.log | tail -7
timeout 120 python3 benchmarks/gpu/profile_step.py 64 2>&1 | grep -v "Warning\|warn" > $OUT/prof64.txt; grep -A1 "ms/step wall" $OUT/prof64.txt
if [ -n "$THROUGHPUT" ]; then
python3 -c "
from transformers import LlamaConfig; from pagedllm.benchmarks.roofline import LLAMA3_8B
LlamaConfig(**LLAMA3_8B).save_pretrained('/tmp/l8b')"
timeout 200 python3 benchmarks/throughput.py --model /tmp/l8b --load-format dummy --device cuda --dtype bfloat16 --dataset sharegpt-like --num-prompts 1000 --skip-tokenizer-init --max-model-len 2048 --max-num-seqs 256 --output-json $OUT/throughput.json > $OUT/throughput.log 2>&1; echo rc=$?
grep "^pagedllm\|KV cache" $OUT/throughput.log
fi
