#!/bin/bash
# This session's CPU measurements with the final code: the float32 direct forward against the module path
# (same engine, alternating), then issue 18's workload against HF in one run.
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1
OUT=benchmarks/results/cpu_1127d
python $OUT/direct_vs_module_f32.py 2>&1 | grep -v "it/s\]\|INFO" > $OUT/direct_vs_module_f32.txt
python benchmarks/throughput.py --compare hf --quantization none --output-json $OUT/f32_vs_hf_final.json 2>&1 \
  | grep -v "it/s\]" > $OUT/f32_vs_hf_final.txt
