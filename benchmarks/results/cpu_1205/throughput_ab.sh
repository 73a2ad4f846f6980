#!/bin/bash
# Offline throughput of Gemma-3-270M's shape (random weights), float32 on the CPU, with transformers as the peer in the
# same run; the CPU direct forward on (default) and off (PAGEDLLM_CPU_DIRECT_FORWARD=0), alternating A B A B.
#   python benchmarks/gpu/make_random_windowed.py /tmp/g270m gemma3-270m
#   bash benchmarks/results/cpu_1205/throughput_ab.sh /tmp/g270m
set -e
MODEL=${1:-/tmp/g270m}
OUT=$(dirname "$0")
export PYTHONPATH=${PYTHONPATH:-$(pwd)} HF_HUB_OFFLINE=1
for round in 1 2; do
  for mode in direct module; do
    env_flag=1; [ "$mode" = module ] && env_flag=0
    echo "== round $round, $mode (PAGEDLLM_CPU_DIRECT_FORWARD=$env_flag), load $(cut -d' ' -f1 /proc/loadavg)"
    PAGEDLLM_CPU_DIRECT_FORWARD=$env_flag python benchmarks/throughput.py --model "$MODEL" --skip-tokenizer-init \
      --dtype float32 --quantization none --compare hf --num-prompts 32 --output-len 64 --hf-batch-size 32 \
      --output-json "$OUT/throughput_${mode}_r${round}.json" 2>&1 | grep -v "Writing model\|it/s]"
  done
done
