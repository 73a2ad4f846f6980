#!/usr/bin/env bash
# The native float32 GEMM up to 512 rows on an AVX2-only CPU (new) vs 12 rows (.oldpkg = 10efb44's package),
# issue 18's workload (pagedllm side only), alternating, then the full comparison with HF static (new code).
cd "$(dirname "$0")/../../.."
D=benchmarks/results/cpu_1127g
for i in 1 2; do
  for arm in new old; do
    pp=$PWD; [ $arm = old ] && pp=$PWD/.oldpkg
    PYTHONPATH=$pp python benchmarks/throughput.py --quantization none > $D/f32_rows_${arm}_$i.txt 2>&1
    echo "$arm $i: $(grep -E '^pagedllm |^decode ' $D/f32_rows_${arm}_$i.txt | tr -s ' ' | tr '\n' ' ')"
  done
done
python benchmarks/throughput.py --compare hf --quantization none > $D/issue18_f32_vs_hf_new.txt 2>&1
grep -E "^pagedllm |^hf |^decode |^mixed |^prefill |ratio|whole run" $D/issue18_f32_vs_hf_new.txt
