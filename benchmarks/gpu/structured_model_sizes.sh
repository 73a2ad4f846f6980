#!/usr/bin/env bash
# Issue 19 on the GPU at three model sizes: the constrained batch of 64 JSON-schema requests against its
# unconstrained twin (benchmarks/structured_outputs.py), on the bundled SmolLM2-135M (needs the GGUF joined by
# device_setup.sh's two-call recipe) and on random (dummy) bf16 weights of a Llama-3.2-1B and a Llama-3-8B shape
# that use the bundled tokenizer (.tok/, vocabulary 49 152), so the grammars mask a real vocabulary.
# SIZES="135m 1b 8b" picks runs; EXTRA adds arguments (e.g. --previous-sampler) and TAG suffixes the log names.
set -u
source benchmarks/gpu/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
python3 - <<'PY'
import shutil
from transformers import LlamaConfig
from pagedllm.benchmarks.roofline import LLAMA3_8B
shapes = {"8b": dict(LLAMA3_8B, vocab_size=49152),
          "1b": dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                     rope_theta=500000.0, tie_word_embeddings=True)}
for name, cfg in shapes.items():
    LlamaConfig(**cfg).save_pretrained(f"/tmp/so_{name}")
PY
for size in ${SIZES:-135m 1b 8b}; do
  args=""; [ "$size" != 135m ] && args="--model /tmp/so_$size --tokenizer .tok --load-format dummy --dtype bfloat16"
  t0=$(date +%s)
  timeout ${RUN_LIMIT_S:-170} python3 benchmarks/structured_outputs.py --num-requests 64 --repeats ${REPEATS:-5} \
      --ttft-repeats 3 --backend xgrammar $args ${EXTRA:-} > "$OUT/so_$size${TAG:-}.log" 2>&1
  echo "== $size${TAG:-} rc=$? ($(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
  grep -a -E "^\[" "$OUT/so_$size${TAG:-}.log" | tee -a "$OUT/summary.txt"
done
