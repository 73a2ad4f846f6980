#!/usr/bin/env bash
# Issue 21 on the GPU, one run: FP8 KV tests (kernels vs reference, swap/CoW, engine pool + greedy agreement),
# the FP8 vs bf16 decode-kernel benchmark, then offline throughput (Llama-3-8B shape, dummy bf16 weights)
# with the bf16 and the FP8 KV pool on the same requests. Results under $OUT.
set -u
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/r
END=$(( $(date +%s) + ${BUDGET_S:-560} ))
left() { echo $(( END - $(date +%s) )); }
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 150 python -m pytest tests/test_fp8_kv_cache.py -q -x -p no:cacheprovider ${TEST_K:+-k "$TEST_K"} 2>&1 | tail -30 > "$OUT/tests.txt"; tail -3 "$OUT/tests.txt"
timeout 120 python -m pagedllm.benchmarks.fp8_kv --batches 1 64 128 --contexts 2048 4096 8192 ${FP8_TILES:+--fp8-tiles $FP8_TILES} \
    --out "$OUT/fp8_kv.json" 2>&1 | tail -12 | tee "$OUT/fp8_kv.txt"
python -c "from transformers import LlamaConfig; from pagedllm.benchmarks.roofline import LLAMA3_8B; LlamaConfig(**LLAMA3_8B).save_pretrained('/tmp/l8b')"
B="python benchmarks/throughput.py --model /tmp/l8b --load-format dummy --device cuda --dtype bfloat16 --skip-tokenizer-init --max-num-seqs 256"
declare -A W=( [sharegpt]="--dataset sharegpt-like --num-prompts 200 --max-model-len 2048"
  [long]="--num-prompts 96 --input-len-min 2000 --input-len-max 6000 --output-len 128 --max-model-len 8192" )
for w in ${WORKLOADS:-long sharegpt}; do for kv in auto fp8; do
  to=$(( $(left) )); [ $to -gt 150 ] && to=150; [ $to -lt 40 ] && { echo "== $w $kv skipped (no time)"; continue; }
  timeout $to $B ${W[$w]} --kv-cache-dtype $kv --output-json "$OUT/tput_${w}_$kv.json" > /tmp/r/${w}_$kv.log 2>&1
  echo "== $w kv=$kv rc=$? (limit $to s)"
  grep -v "it/s\]\|s/it\]" /tmp/r/${w}_$kv.log | grep -i "KV cache\|KV pool\|^pagedllm \|measured\|Error\|Traceback" | tail -6 | tee -a "$OUT/summary.txt"
done; done
cp /tmp/r/*.log "$OUT/" 2>/dev/null
