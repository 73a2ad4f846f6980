#!/bin/bash
# This session's last runs on the final tree (eda3a7a) against 8647387 (bash final_runs.sh, from this directory).
set -x
CONFIGS="700,1500 1;700,1500 5;300,700,1100,1500 1;300,700,1100,1500 5;600,650,700,750,800,850,900,950 1;$(python -c 'print(",".join(str(150 + 10 * i) for i in range(64)))') 1" \
  bash attn_ab.sh 3 /work/base_clone /work/main > attn_final_multi.txt 2>&1
for t in 1 2; do OMP_NUM_THREADS=$t PAGEDLLM_CPU_ISA=avx2 PYTHONPATH=/work/main python -W ignore gemm_rows.py 1 4 8 20 64 2>&1 | grep -v INFO > gemm_rows_avx2_t$t.txt; done
for arm in off on; do for tree in base_clone main; do
  PYTHONPATH=/work/$tree HF_HUB_OFFLINE=1 python step_breakdown.py $arm 40 12 1 2>&1 | grep -v "^INFO\|WARNING" | tail -n 25 > spec_c1_${arm}_$tree.txt
done; done
