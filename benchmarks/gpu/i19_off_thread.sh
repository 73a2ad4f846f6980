#!/usr/bin/env bash
# Issue 19 A/B: a constrained step's grammar accepts and mask fill on the mask thread (the default on a GPU) against
# the step thread (--grammar-on-step-thread), alternating processes. PART=timeline: the host phases per step on a
# SmolLM2-135M-shaped model with dummy bf16 weights (.tok/ carried). PART=sizes: benchmarks/structured_outputs.py on
# the bundled model (the GGUF joined by device_setup.sh's two-call recipe). ROUNDS pairs of processes. Into $OUT.
set -u
source benchmarks/gpu/device_setup.sh > /tmp/setup.log 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/gpu.txt"
python3 -c "import xgrammar, importlib.metadata as m; print('xgrammar', m.version('xgrammar'))" | tee -a "$OUT/gpu.txt"
[ "${PART:-timeline}" = timeline ] && python3 benchmarks/gpu/make_s135.py /tmp/s135
for i in $(seq 1 ${ROUNDS:-2}); do
  for arm in mask step; do
    flag=""; [ $arm = step ] && flag="--grammar-on-step-thread"
    log="$OUT/${PART:-timeline}_${arm}_$i.log"; t0=$(date +%s)
    if [ "${PART:-timeline}" = timeline ]; then
      timeout ${RUN_LIMIT_S:-150} python3 benchmarks/gpu/structured_timeline.py /tmp/s135 $flag > "$log" 2>&1
    else
      timeout ${RUN_LIMIT_S:-150} python3 benchmarks/structured_outputs.py --num-requests 64 --repeats ${REPEATS:-5} \
        --ttft-repeats 1 --backend xgrammar $flag > "$log" 2>&1
    fi
    echo "== $arm $i rc=$? ($(( $(date +%s) - t0 )) s)"
    grep -a -E "^==|^\[end-to-end|^   (step|complete_step|append_samples|accept|start_fill|start_accept|launch_sampling|wait) " "$log"
  done
done
