#!/bin/bash
# Issue 16, GPU call 2: the three offline workloads (Llama-3-8B shape, dummy bf16) with transformers'
# continuous batching on ALL the same requests in the same run (HF first, then pagedllm on its weights),
# the lower bound and the step-time breakdown. WORKLOADS selects (default: sharegpt long short).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "from transformers import LlamaConfig; from pagedllm.benchmarks.roofline import LLAMA3_8B; LlamaConfig(**LLAMA3_8B).save_pretrained('/tmp/l8b')"
B="python3 benchmarks/throughput.py --model /tmp/l8b --load-format dummy --device cuda --dtype bfloat16 --skip-tokenizer-init --max-num-seqs 256 --compare hf-cb"
run() { name=$1; to=$2; shift 2; timeout $to $B "$@" --output-json $OUT/$name.json > $OUT/$name.log 2>&1; echo "== $name rc=$?";
  grep -v "it/s\]\|s/it\]" $OUT/$name.log | grep -i "init (\|measured\|lower bound\|first step\|step kind\|/graph\|/piecewise\|/eager\|pagedllm  \|hf-cb  \|ratio\|Error" ; }
for w in ${WORKLOADS:-sharegpt long short}; do case $w in
  sharegpt) run sharegpt ${T_SHAREGPT:-300} --dataset sharegpt-like --num-prompts 200 --max-model-len 2048 ;;
  long) run long ${T_LONG:-240} --num-prompts 96 --input-len-min 2000 --input-len-max 6000 --output-len 128 --max-model-len 8192 ;;
  short) run short ${T_SHORT:-560} --num-prompts 1000 --input-len-min 8 --input-len-max 64 --output-len 64 --max-model-len 2048 ;;
esac; done
