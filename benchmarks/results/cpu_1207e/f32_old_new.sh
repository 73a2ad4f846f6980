#!/usr/bin/env bash
# Issue 18: has the float32 row slowed since §72 (ce3be49, 26-27 s) and §84.4 (30.21 s)? The same command on a
# worktree of ce3be49 (/work/old) and on this tree, alternating. Usage: bash f32_old_new.sh [rounds]
for i in $(seq 1 ${1:-2}); do
  for tree in /work/old /work/main; do
    echo "== $tree round $i $(date -u +%H:%M:%S)"
    (cd $tree && PYTHONPATH=$tree HF_HUB_OFFLINE=1 python benchmarks/throughput.py --compare none --quantization none 2>&1 \
      | grep -a -E "elapsed|tok/s|steps|FMA|peak|whole run" | head -12)
  done
done
