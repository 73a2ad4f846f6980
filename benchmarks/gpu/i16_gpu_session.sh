#!/bin/bash
# Issue 16, GPU session (one call, deadline-driven): GPU tests of the capture paths (piecewise vs eager
# greedy parity, warm start, existing decode-graph tests), then offline throughput on the Llama-3-8B
# shape (dummy bf16) for the three workloads with the lower bound, step breakdown and the fresh-engine
# first-request TTFT; then as many workloads as fit with transformers' continuous batching on ALL the
# same requests in the same process (HF first). Fresh Triton cache, so the warm start compiles for real.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
rm -rf $TRITON_CACHE_DIR; mkdir -p /tmp/r
END=$(( $(date +%s) + ${BUDGET_S:-570} ))
left() { echo $(( END - $(date +%s) )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)" | tee -a $OUT/gpu.txt
timeout ${T_TESTS:-170} python3 -m pytest -q -x -p no:cacheprovider tests/test_piecewise_graphs.py tests/test_cuda_graphs.py > $OUT/tests.log 2>&1
echo "tests rc=$?"; tail -4 $OUT/tests.log
python3 -c "from transformers import LlamaConfig; from pagedllm.benchmarks.roofline import LLAMA3_8B; LlamaConfig(**LLAMA3_8B).save_pretrained('/tmp/l8b')"
B="python3 benchmarks/throughput.py --model /tmp/l8b --load-format dummy --device cuda --dtype bfloat16 --skip-tokenizer-init --max-num-seqs 256"
declare -A W=( [sharegpt]="--dataset sharegpt-like --num-prompts 200 --max-model-len 2048"
  [short]="--num-prompts 1000 --input-len-min 8 --input-len-max 64 --output-len 64 --max-model-len 2048"
  [long]="--num-prompts 96 --input-len-min 2000 --input-len-max 6000 --output-len 128 --max-model-len 8192" )
run() { name=$1; to=$2; shift 2; [ $to -gt $(left) ] && to=$(left); [ $to -lt 30 ] && { echo "== $name skipped (no time)"; return; }
  timeout $to $B "$@" --output-json /tmp/r/$name.json > /tmp/r/$name.log 2>&1; rc=$?; echo "== $name rc=$rc (limit $to s)"; [ $rc -ne 0 ] && tail -c 1500 /tmp/r/$name.log | tr "\r" "\n" | tail -8;
  grep -v "it/s\]\|s/it\]\|Warning\|warn" /tmp/r/$name.log | grep -i "engine init\|measured\|lower bound\|first request\|first step\|step kind\|/graph\|/piecewise\|/eager\|^pagedllm \|^hf-cb\|ratio\|Warm start\|Captured\|KV cache\|Error\|Traceback" | tee -a $OUT/summary.log; }
run sharegpt 110 ${W[sharegpt]}
run short 110 ${W[short]}
run hf_long $(( $(left) - 75 )) ${W[long]} --compare hf-cb
[ -s /tmp/r/hf_long.json ] || run long 110 ${W[long]}
for w in ${HF_MORE:-short sharegpt}; do run hf_$w $(left) ${W[$w]} --compare hf-cb; done
tar czf $OUT/runs.tgz -C /tmp/r . ; ls -la /tmp/r
