#!/bin/bash
# GPU session script (1x H100): Fig. 12/13 at the paper's shape — OPT-13B config with dummy fp16 weights,
# 12 GB of KV cache (Table 1: OPT-13B on one A100-40GB), block 16, max_model_len 2048, ShareGPT-like
# lengths (synthetic, pagedllm/benchmarks/paper/workloads.py), a shortened trace of N requests per point.
# Each system's sweep runs in its own process (one 13B model on the GPU at a time) into one fig12.json.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
N=${N:-40}; CAP=${CAP:-45}; D=${OUT:-/tmp}/fig12
COMMON="--scale paper --device cuda --traces sharegpt --num-requests $N --max-point-seconds $CAP --output-dir $D"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for cfg in "paged:1 2 3 4 6" "orca-oracle:1 2 3 4" "orca-max:1 1.5 2" "request-level:1"; do
  sys=${cfg%%:*}; rates=${cfg#*:}
  echo "=== $sys rates $rates"
  timeout ${T:-135} python3 -m pagedllm.entrypoints.cli bench paper fig12 $COMMON --systems $sys --rates $rates \
    > $D.log 2>&1; echo rc=$?; cat $D.log >> $OUT/fig12_run.log
  grep "req/s: normalized\|Error\|error" $D.log | tail -8
done
# final outputs with all systems (re-reads fig12.json; every point is there, nothing reruns)
python3 -m pagedllm.entrypoints.cli bench paper fig12 $COMMON --rates 1 > $D.log 2>&1; tail -20 $D.log; rm -f $D.log
