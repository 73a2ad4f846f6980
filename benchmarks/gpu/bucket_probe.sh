#!/bin/bash
# decode_bucket_times.py on the LLaMA-7B (bf16; FP8 KV + FP8 weights) and Llama-3-8B shapes, dummy weights.
source benchmarks/gpu/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 - <<'PY'
from transformers import LlamaConfig
from pagedllm.benchmarks.roofline import LLAMA3_8B
LlamaConfig(**LLAMA3_8B).save_pretrained("/tmp/l8b")
LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=32, max_position_embeddings=8192, tie_word_embeddings=False).save_pretrained("/tmp/l7b")
PY
for run in ${RUNS:-l7b:none l7b:fp8 l8b:none}; do
  IFS=: read -r m q <<< "$run"
  qa=""; [ "$q" = fp8 ] && qa="--quantization fp8 --kv-cache-dtype fp8"
  timeout ${RUN_S:-150} python3 benchmarks/gpu/decode_bucket_times.py /tmp/$m $qa --out "$OUT/buckets_${m}_$q.json" \
    > "$OUT/buckets_${m}_$q.log" 2>&1
  echo "== $run rc=$?" | tee -a "$OUT/summary.txt"
  grep -v "it/s\]" "$OUT/buckets_${m}_$q.log" | tail -75 >> "$OUT/summary.txt"
done
