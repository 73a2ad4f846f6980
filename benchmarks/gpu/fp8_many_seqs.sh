#!/usr/bin/env bash
# Issue 21 end to end where FP8 KV should pay: many sequences at once. The offline LLM runs up to 1 024
# sequences on a large GPU (§31.2), so with 1 000 ShareGPT-like requests the bf16 pool (LLaMA-7B: MHA, 512 KiB
# of KV per token) caps the batch and the KV bytes per decode step dominate the weights' (Llama-3-8B: GQA, KV
# reads of ~1 000 sequences still exceed the 16 GB of weights). bf16 vs FP8 KV vs FP8 KV + FP8 weights on the
# same requests, dummy bf16 weights. RUNS="shape:workload:config[:old] ..." picks runs; logs + JSON into $OUT.
# A fourth field `old` runs the package copy carried in .oldpkg/ (an earlier commit's pagedllm/, git-ignored)
# instead of the tree's, for a before/after in one call.
set -u
source benchmarks/gpu/device_setup.sh
OUT=${OUT:-/tmp/out}; R=/tmp/r; J=/tmp/j; mkdir -p "$OUT" $R $J
END=$(( $(date +%s) + ${BUDGET_S:-580} ))
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT/summary.txt"
python3 - <<'PY'
from transformers import LlamaConfig
from pagedllm.benchmarks.roofline import LLAMA3_8B
LlamaConfig(**LLAMA3_8B).save_pretrained("/tmp/l8b")
# LLaMA-7B shape (the paper's and issue 16's): MHA, vocab 32 000; positions to 8 192 for the long workload.
LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=32, max_position_embeddings=8192, tie_word_embeddings=False).save_pretrained("/tmp/l7b")
PY
declare -A W=( [sharegpt1000]="--dataset sharegpt-like --num-prompts 1000 --max-model-len 2048"
  [sharegpt3000]="--dataset sharegpt-like --num-prompts 3000 --max-model-len 2048"
  [sharegpt5000]="--dataset sharegpt-like --num-prompts 5000 --max-model-len 2048"
  [short]="--num-prompts 1000 --input-len-min 8 --input-len-max 64 --output-len 64 --max-model-len 2048"
  [u440]="--num-prompts 440 --input-len-min 32 --input-len-max 64 --output-len 256 --max-model-len 2048"
  [long]="--num-prompts 96 --input-len-min 2000 --input-len-max 6000 --output-len 128 --max-model-len 8192" )
declare -A C=( [bf16]="--kv-cache-dtype auto" [kv8]="--kv-cache-dtype fp8" [w8kv8]="--quantization fp8 --kv-cache-dtype fp8" )
for run in ${RUNS:-l7b:sharegpt1000:bf16 l7b:sharegpt1000:kv8 l7b:sharegpt1000:w8kv8}; do
  IFS=: read -r m w c code <<< "$run"
  pp=$PYTHONPATH; [ "${code:-}" = old ] && pp=$PWD/.oldpkg:/tmp/site; tag=${m}_${w}_$c${code:+_$code}
  to=$(( END - $(date +%s) )); [ $to -gt ${RUN_LIMIT_S:-240} ] && to=${RUN_LIMIT_S:-240}
  [ $to -lt 40 ] && { echo "== $run skipped (no time)" | tee -a "$OUT/summary.txt"; continue; }
  t0=$(date +%s)
  PYTHONPATH=$pp timeout $to python3 benchmarks/throughput.py --model /tmp/$m --load-format dummy --device cuda --dtype bfloat16 \
      --skip-tokenizer-init --max-num-seqs ${MAX_NUM_SEQS:-1024} ${W[$w]} ${C[$c]} ${EXTRA:-} \
      --output-json "$J/$tag.json" > $R/$tag.log 2>&1
  echo "== $run rc=$? ($(( $(date +%s) - t0 )) s, limit $to s)" | tee -a "$OUT/summary.txt"
  grep -v "it/s\]\|s/it\]" $R/$tag.log | grep -i "KV cache:\|^pool:\|preempt\|^pagedllm \|lower bound\|step\|Error\|Traceback" \
      | tail -12 | tee -a "$OUT/summary.txt"
  tar czf "$OUT/logs.tar.gz" -C $R . ; tar czf "$OUT/json.tar.gz" -C $J .
done
