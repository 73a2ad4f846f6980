#!/bin/bash
# Emulated AVX2 (oneDNN, MKL, ATen and pagedllm's kernels capped at AVX2): issue 18's workload, pagedllm only,
# the direct forward on and off, alternating, two rounds.
cd "$(dirname "$0")/../../.."
export ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 PAGEDLLM_CPU_ISA=avx2
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
for round in 1 2; do
  for direct in 1 0; do
    echo "round $round direct=$direct: $(PAGEDLLM_CPU_DIRECT_FORWARD=$direct python benchmarks/throughput.py \
      --quantization none 2>&1 | grep -E '^(pagedllm |decode )' | tr '\n' ' ')"
  done
done
