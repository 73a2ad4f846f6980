#!/bin/bash
# GPU session script (second call of device_setup.sh's two-call recipe: the bundled GGUF joined, wheels incl.
# jsonschema carried in .whl): the structured-output and scheduling tests on CUDA, then the new-schema TTFT
# with a long prompt (--ttft-prompt-words, default 1500) and the 64-request end-to-end ratio, for the tree and
# for the previous package carried in .oldpkg (PYTHONPATH=.oldpkg), alternating. Logs in $OUT.
set -o pipefail
export TQDM_DISABLE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
t0=$(date +%s)
timeout ${TEST_S:-200} python3 -m pytest tests/test_sample_hold.py tests/test_structured_outputs.py \
  tests/test_async_scheduling.py -q -p no:cacheprovider > "$OUT/tests.log" 2>&1
echo "tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
for round in $(seq 1 ${ROUNDS:-2}); do
  for pkg in .oldpkg .; do
    name=r${round}_$( [ $pkg = . ] && echo new || echo old )
    t0=$(date +%s)
    PYTHONPATH=$PWD/$pkg:/tmp/site timeout 150 python3 benchmarks/structured_outputs.py --num-requests 64 \
      --repeats ${REPEATS:-3} --ttft-repeats 5 --ttft-prompt-words ${WORDS:-1500} > "$OUT/$name.log" 2>&1
    echo "$name rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
    grep -a -E "^\[(new schema|end-to-end)" "$OUT/$name.log" | tee -a "$OUT/summary.txt"
  done
done
