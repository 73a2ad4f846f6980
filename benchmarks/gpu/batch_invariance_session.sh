#!/usr/bin/env bash
# VLLM_BATCH_INVARIANT on CUDA: the probe (tiny random Llama, bf16, float KV and FP8 KV; off and on), then the cost
# on the Llama-3-8B shape (dummy bf16 weights, 200 short requests: 8-64 in, 64 out), off and on, alternating.
# PROBE=0 skips the probe; ROUNDS (default 2) sets the off/on pairs.
set -u
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/summary.txt"
for kv in $([ "${PROBE:-1}" = 1 ] && echo auto fp8); do
  for bi in 0 1; do
    VLLM_BATCH_INVARIANT=$bi python benchmarks/gpu/batch_invariance_probe.py --kv-cache-dtype $kv 2>&1 \
      | grep -v -i warn | tail -4 | tee -a "$OUT/summary.txt"
  done
done
python3 - <<'PY'
from transformers import LlamaConfig
from pagedllm.benchmarks.roofline import LLAMA3_8B
LlamaConfig(**LLAMA3_8B).save_pretrained("/tmp/l8b")
PY
for round in $(seq 1 ${ROUNDS:-2}); do
  for bi in 0 1; do
    VLLM_BATCH_INVARIANT=$bi python benchmarks/throughput.py --model /tmp/l8b --load-format dummy --dtype bfloat16 \
      --skip-tokenizer-init --num-prompts ${NUM_PROMPTS:-200} --input-len-min 8 --input-len-max 64 --output-len 64 \
      --max-model-len 2048 --no-lower-bound --output-json "$OUT/l8b_short_bi${bi}_r$round.json" > "$OUT/l8b_short_bi${bi}_r$round.txt" 2>&1
    echo "[l8b short, VLLM_BATCH_INVARIANT=$bi, round $round] $(grep -E '^pagedllm ' "$OUT/l8b_short_bi${bi}_r$round.txt")" | tee -a "$OUT/summary.txt"
  done
done
