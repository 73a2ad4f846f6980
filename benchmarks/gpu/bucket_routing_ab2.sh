#!/bin/bash
# Decode + piecewise bucket routing (this tree) against the package carried in .oldpkg, ShareGPT-like 1 000
# requests on Llama-3-8B and LLaMA-7B (dummy bf16); the graph tests first.
source benchmarks/gpu/device_setup.sh
python3 -m pytest tests/test_cuda_graphs.py tests/test_piecewise_graphs.py -q -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/tests.txt
RUNS=${RUNS:-"l8b:sharegpt1000:bf16:old l8b:sharegpt1000:bf16 l7b:sharegpt1000:bf16 l7b:sharegpt1000:bf16:old"} \
  BUDGET_S=${BUDGET_S:-420} RUN_LIMIT_S=110 OUT=$OUT bash benchmarks/gpu/fp8_many_seqs.sh > $OUT/runs.txt 2>&1
mkdir -p /tmp/r2 && tar xzf $OUT/logs.tar.gz -C /tmp/r2
for f in /tmp/r2/*.log; do echo "== $f"; grep -h "Timed\|Captured" $f | cut -c1-600; grep -A5 "step kind/path" $f; grep "^pagedllm " $f; done
