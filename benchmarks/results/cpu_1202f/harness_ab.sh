#!/usr/bin/env bash
# The int8 GEMM alone, one thread: 58191fe's quant_ops.c (before) against this tree's (after), built alike,
# alternating 5 times per point; prints every run (take the best of each: this VM's neighbours make runs slower,
# never faster). Q4_1 1536 × 576 (an MLP up-projection) and Q8_0 49152 × 576 (the LM head), 1-64 activation rows.
set -eu
cd "$(dirname "$0")"; root=../../..; tmp=$(mktemp -d)
git -C "$root" show 58191fe:pagedllm/kernels/cpu/quant_ops.c > "$tmp/before.c"
cp "$root/pagedllm/kernels/cpu/quant_ops.c" "$tmp/after.c"
for v in before after; do
  gcc -O3 -mavx2 -mfma -mf16c -fopenmp -std=c11 -DQUANT_SRC="\"$tmp/$v.c\"" ../cpu_1202e/harness.c -o "$tmp/$v" -lm
done
for point in "3 1536 1" "3 1536 4" "3 1536 20" "3 1536 64" "8 49152 1" "8 49152 4" "8 49152 20"; do
  read -r t n m <<< "$point"; reps=$(( n > 10000 ? 5 : 200 ))
  for i in 1 2 3 4 5; do
    for v in before after; do
      echo "type $t N $n $v $(T=$t N=$n OMP_NUM_THREADS=1 "$tmp/$v" "$m" "$reps")"
    done
  done
done
rm -rf "$tmp"
