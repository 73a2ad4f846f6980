#!/usr/bin/env bash
# --cpu-offload-gb on the GPU: its CUDA tests, then benchmarks/cpu_offload.py on the Llama-3-8B shape (dummy bf16
# weights; 64 requests of 256 in / 128 out) with budgets BUDGETS (GiB; 0 = the peer) in one process.
set -u
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/summary.txt"
python3 -m pytest -m cuda tests/test_cpu_offload.py ${EXTRA_TESTS:-} -q -p no:cacheprovider > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt" | tee -a "$OUT/summary.txt"
python3 - <<'PY'
from transformers import LlamaConfig
from pagedllm.benchmarks.roofline import LLAMA3_8B
LlamaConfig(**LLAMA3_8B).save_pretrained("/tmp/l8b")
PY
python3 benchmarks/cpu_offload.py --model /tmp/l8b --load-format dummy --offload-gb ${BUDGETS:-2 8} > "$OUT/bench.txt" 2>&1
grep -A10 "pinned host-to-device" "$OUT/bench.txt" | tee -a "$OUT/summary.txt"
grep "CPU offload:" "$OUT/bench.txt" | tee -a "$OUT/summary.txt"
python3 benchmarks/gpu/uva_probe.py > $OUT/uva.txt 2>&1; cat $OUT/uva.txt | tee -a $OUT/summary.txt
