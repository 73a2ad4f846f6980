#!/bin/bash
# GPU session script (2× H200): 13B-class dummy model, ShareGPT-like workload, TP=1 vs TP=2 (eager) and TP=1 (graphs).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=${N:-500}
python3 -c "
from transformers import LlamaConfig; from pagedllm.benchmarks.roofline import LLAMA_13B
LlamaConfig(**LLAMA_13B).save_pretrained('/tmp/l13b')"
COMMON="--model /tmp/l13b --load-format dummy --device cuda --dtype bfloat16 --dataset sharegpt-like --num-prompts $N --skip-tokenizer-init --max-model-len 2048 --max-num-seqs 256"
for cfg in "tp1_eager:--tensor-parallel-size 1 --enforce-eager" "tp2_eager:--tensor-parallel-size 2 --enforce-eager" "tp1_graphs:--tensor-parallel-size 1"; do
  name=${cfg%%:*}; flags=${cfg#*:}
  echo "=== $name"
  timeout ${T:-170} python3 benchmarks/throughput.py $COMMON $flags --output-json $OUT/$name.json > $OUT/$name.log 2>&1; echo rc=$?
  grep -v "Processed\|Warning\|it/s\]" $OUT/$name.log | grep -i "pagedllm\|blocks\|workload\|error\|Trace" | tail -6
done
