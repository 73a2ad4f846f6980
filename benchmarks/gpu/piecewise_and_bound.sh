#!/bin/bash
# Issue 16, GPU call 1: GPU tests of the capture paths, then offline throughput on the Llama-3-8B shape
# (dummy bf16) for the three workloads with the lower bound and the step-time breakdown; ShareGPT-like
# also with --max-capture-tokens 0 (mixed steps eager) and a second start (Triton's on-disk cache warm).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
rm -rf $TRITON_CACHE_DIR
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 200 python3 -m pytest -q -x tests/test_piecewise_graphs.py tests/test_cuda_graphs.py 2>&1 | tail -15 | tee $OUT/tests.log
python3 -c "from transformers import LlamaConfig; from pagedllm.benchmarks.roofline import LLAMA3_8B; LlamaConfig(**LLAMA3_8B).save_pretrained('/tmp/l8b')"
B="python3 benchmarks/throughput.py --model /tmp/l8b --load-format dummy --device cuda --dtype bfloat16 --skip-tokenizer-init --max-num-seqs 256"
run() { name=$1; shift; timeout ${TO:-150} $B "$@" --output-json $OUT/$name.json > /tmp/$name.log 2>&1; echo "== $name rc=$?";
  grep -v "it/s\]\|s/it\]" /tmp/$name.log | grep -i "init\|measured\|lower bound\|first step\|step kind\|/graph\|/piecewise\|/eager\|pagedllm  \|Warm start\|Captured\|Error\|error" | tee -a $OUT/summary.log; }
run sharegpt_first --dataset sharegpt-like --num-prompts 200 --max-model-len 2048
run sharegpt_second --dataset sharegpt-like --num-prompts 200 --max-model-len 2048
run sharegpt_nopw --dataset sharegpt-like --num-prompts 200 --max-model-len 2048 --max-capture-tokens 0
run short --num-prompts 1000 --input-len-min 8 --input-len-max 64 --output-len 64 --max-model-len 2048
run long --num-prompts 96 --input-len-min 2000 --input-len-max 6000 --output-len 128 --max-model-len 8192
