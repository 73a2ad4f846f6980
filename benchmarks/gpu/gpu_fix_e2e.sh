#!/usr/bin/env bash
# gpu-fix session, part 2 (no bundled model needed): end-to-end offline throughput, Llama-3-8B shape with
# dummy bf16 weights, each configuration on the same requests in one run.
#  A. BENCHMARKS §18's FP8-weights rows again (same commands), now with the fused activation quantization:
#     bf16 vs --quantization fp8 --kv-cache-dtype fp8, long (96 × 2000-6000 in) and ShareGPT-like (200).
#  B. A pool-bound run: decode-heavy (128 × 1024 in, 512 out) at --gpu-memory-utilization 0.32, where the
#     bf16 pool holds only ~40 of the 128 sequences at full length: bf16 vs fp8 KV vs fp8 KV + fp8 weights.
# Logs tarred into $OUT after each run, JSON per run in $OUT/json.tar.gz. The engine imports xgrammar: install
# the .snap-so wheels into a --target dir on PYTHONPATH in the same call (see BENCHMARKS §20).
set -u
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; R=/tmp/r; J=/tmp/j; mkdir -p "$OUT" $R $J
END=$(( $(date +%s) + ${BUDGET_S:-560} ))
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/summary.txt"
python -c "from transformers import LlamaConfig; from pagedllm.benchmarks.roofline import LLAMA3_8B; LlamaConfig(**LLAMA3_8B).save_pretrained('/tmp/l8b')"
B="python benchmarks/throughput.py --model /tmp/l8b --load-format dummy --device cuda --dtype bfloat16 --skip-tokenizer-init --max-num-seqs 256"
declare -A W=( [sharegpt]="--dataset sharegpt-like --num-prompts 200 --max-model-len 2048"
  [long]="--num-prompts 96 --input-len-min 2000 --input-len-max 6000 --output-len 128 --max-model-len 8192"
  [poolbound]="--num-prompts 128 --input-len-min 1024 --input-len-max 1024 --output-len 512 --max-model-len 2048 --gpu-memory-utilization ${POOL_UTIL:-0.32}" )
declare -A C=( [bf16]="--kv-cache-dtype auto" [kv8]="--kv-cache-dtype fp8" [w8kv8]="--quantization fp8 --kv-cache-dtype fp8" )
for run in ${RUNS:-poolbound:bf16 poolbound:kv8 poolbound:w8kv8 long:bf16 long:w8kv8 sharegpt:bf16 sharegpt:w8kv8}; do
  w=${run%%:*}; c=${run##*:}
  to=$(( END - $(date +%s) )); [ $to -gt 150 ] && to=150
  [ $to -lt 40 ] && { echo "== $w $c skipped (no time)" | tee -a "$OUT/summary.txt"; continue; }
  t0=$(date +%s)
  timeout $to $B ${W[$w]} ${C[$c]} --output-json "$J/tput_${w}_$c.json" > $R/${w}_$c.log 2>&1
  echo "== $w $c rc=$? ($(( $(date +%s) - t0 )) s, limit $to s)" | tee -a "$OUT/summary.txt"
  grep -v "it/s\]\|s/it\]" $R/${w}_$c.log | grep -i "KV cache:\|^pool:\|preempt\|^pagedllm \|Error\|Traceback" | tail -5 \
      | tee -a "$OUT/summary.txt"
  tar czf "$OUT/logs.tar.gz" -C $R . ; tar czf "$OUT/json.tar.gz" -C $J .
done
