#!/bin/bash
# After the prefill / FP8-decode launch defaults changed (BENCHMARKS.md §29): the kernel tests on CUDA, the FP8
# decode benchmark, issue 16's long and short offline workloads against the lower bound, and issue 21's
# pool-bound end-to-end run (bf16 / FP8 KV / FP8 KV + FP8 weights on the same requests). Llama-3-8B shape,
# dummy bf16 weights. Logs in $OUT.
set -o pipefail
source benchmarks/gpu/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
t0=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest ${TESTS:-tests/test_triton_kernels.py tests/test_fp8_kv_cache.py} -q -p no:cacheprovider \
  --tb=short -k "${TEST_K:-not engine}" > "$OUT/tests.log" 2>&1
echo "kernel tests rc=$? $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
[ -n "$SKIP_FP8_KV" ] || timeout 60 python3 -m pagedllm.benchmarks.fp8_kv --batches 1 64 128 --contexts 2048 4096 8192 --fp8-dot-dtypes fp16 \
  --out "$OUT/fp8_kv.json" 2>&1 | grep -E "copy bandwidth|^batch" | tee -a "$OUT/summary.txt"
python3 -c "from transformers import LlamaConfig; from pagedllm.benchmarks.roofline import LLAMA3_8B; LlamaConfig(**LLAMA3_8B).save_pretrained('/tmp/l8b')"
# max_num_seqs: the offline default (1024 on a >= 70 GiB GPU since §31) unless MAX_NUM_SEQS pins it for every run.
B="python3 benchmarks/throughput.py --model /tmp/l8b --load-format dummy --device cuda --dtype bfloat16 --skip-tokenizer-init ${MAX_NUM_SEQS:+--max-num-seqs $MAX_NUM_SEQS}"
declare -A W=(
  [long]="--num-prompts 96 --input-len-min 2000 --input-len-max 6000 --output-len 128 --max-model-len 8192"
  [sharegpt]="--dataset sharegpt-like --num-prompts 200 --max-model-len 2048"
  [short_8k]="--num-prompts 1000 --input-len-min 8 --input-len-max 64 --output-len 64 --max-model-len 2048 --max-num-batched-tokens 8192"
  [long_8k]="--num-prompts 96 --input-len-min 2000 --input-len-max 6000 --output-len 128 --max-model-len 8192 --max-num-batched-tokens 8192"
  [short]="--num-prompts 1000 --input-len-min 8 --input-len-max 64 --output-len 64 --max-model-len 2048"
  [short_256]="--num-prompts 1000 --input-len-min 8 --input-len-max 64 --output-len 64 --max-model-len 2048 --max-num-seqs 256"
  [short_hf]="--num-prompts 1000 --input-len-min 8 --input-len-max 64 --output-len 64 --max-model-len 2048 --compare hf-cb"
  [sharegpt_hf]="--dataset sharegpt-like --num-prompts 200 --max-model-len 2048 --compare hf-cb"
  [pool_bf16]="--num-prompts 128 --input-len-min 1024 --input-len-max 1024 --output-len 512 --max-model-len 2048 --gpu-memory-utilization 0.32"
  [pool_fp8kv]="--num-prompts 128 --input-len-min 1024 --input-len-max 1024 --output-len 512 --max-model-len 2048 --gpu-memory-utilization 0.32 --kv-cache-dtype fp8"
  [pool_fp8kvw]="--num-prompts 128 --input-len-min 1024 --input-len-max 1024 --output-len 512 --max-model-len 2048 --gpu-memory-utilization 0.32 --kv-cache-dtype fp8 --quantization fp8"
)
for w in ${RUNS:-long short pool_bf16 pool_fp8kv pool_fp8kvw}; do
  t0=$(date +%s)
  timeout ${RUN_S:-100} $B ${W[$w]} --output-json "$OUT/tput_$w.json" > "$OUT/tput_$w.log" 2>&1
  echo "== $w rc=$? $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  grep -v "it/s\]\|s/it\]" "$OUT/tput_$w.log" | grep -iE "KV cache:|^pagedllm|^hf|^ratio|^pool|lower bound|efficiency|decode/|mixed/|prefill/|preempt|Error" | tail -12 | tee -a "$OUT/summary.txt"
done
