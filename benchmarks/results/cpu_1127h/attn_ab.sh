#!/usr/bin/env bash
# The CPU attention kernel with sliced prefetches and 3-row V tiles (new) vs 163cdac (.oldpkg = 163cdac's package),
# issue 18's float32 workload (pagedllm side only), alternating.
cd "$(dirname "$0")/../../.."
D=benchmarks/results/cpu_1127h
for i in 1 2 3; do
  for arm in new old; do
    pp=$PWD; [ $arm = old ] && pp=$PWD/.oldpkg
    PYTHONPATH=$pp HF_HUB_OFFLINE=1 python benchmarks/throughput.py --quantization none > $D/f32_attn_${arm}_$i.txt 2>&1
    echo "$arm $i: $(grep -E '^pagedllm |^decode ' $D/f32_attn_${arm}_$i.txt | tr -s ' ' | tr '\n' ' ')"
  done
done
