#!/bin/bash
# Issue 20 on the H100 with the bundled model (GGUF joined by the two-call recipe): spec_real_model.sh (float32),
# then profile_spec.py at 1 concurrent (per-step times by kind, cProfile of the speculating engine, dumped to $OUT).
source benchmarks/gpu/device_setup.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
git log --oneline -1 | tee -a $OUT/gpu.txt
DTYPES=float32 BENCH_S=230 bash benchmarks/gpu/spec_real_model.sh
timeout 150 python3 benchmarks/gpu/profile_spec.py --concurrency 1 --prompts 12 --dump $OUT/prof1 > $OUT/profile_spec_c1.log 2>&1; echo "profile rc=$?"
grep "^==" $OUT/profile_spec_c1.log
