#!/bin/bash
# GPU session script (1x H100): Fig. 12/13 at the paper's shape — OPT-13B config with dummy fp16 weights,
# 12 GB of KV cache (Table 1: OPT-13B on one A100-40GB), block 16, max_model_len 2048, ShareGPT-like
# lengths (synthetic, pagedllm/benchmarks/paper/workloads.py), N requests per point (the same N for all).
# One process, one engine: the model loads once and common.switch_system swaps the KV manager between
# systems (same pool, kernels, scheduler loop). A warm-up of 4 requests precedes each system's sweep.
# Rates are per system, where its pool binds; a system's sweep stops at its first point over the sustained
# threshold, and --give-up-early stops such a point as soon as it is sure to end over it.
# PREV=path/fig12.json resumes from an earlier run's points (systems already swept are skipped).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
source benchmarks/gpu/carried_wheels.sh
N=${N:-100}; SLACK=${SLACK:-20}; CAP=${CAP:-150}; D=${OUT:-/tmp}/fig12; TRACE=${TRACE:-sharegpt}
RATES=${RATES:-"paged=4,6,8,10,12 orca-oracle=3,4,5,6 orca-max=1.5,2,3 request-level=1 orca-pow2=3,4,5"}
SYSTEMS=${SYSTEMS:-"paged orca-oracle orca-max request-level orca-pow2"}
mkdir -p $D; [ -n "$PREV" ] && cp $PREV $D/fig12.json
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout ${T:-540} python3 -m pagedllm.benchmarks.paper.cli fig12 --scale paper --device cuda --traces $TRACE \
  --num-requests $N --max-point-seconds $CAP --point-slack-seconds $SLACK --give-up-early \
  --systems $SYSTEMS --rates-for $RATES --output-dir $D > $OUT/fig12_run.log 2>&1
echo rc=$?; grep -a "^20[0-9][0-9]-" $OUT/fig12_run.log | cut -c1-220 | tail -40; ls $D
