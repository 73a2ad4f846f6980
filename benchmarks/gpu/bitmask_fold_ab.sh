#!/usr/bin/env bash
# Issue 19, the grammar bitmask read inside the Triton sampling kernel (no masking launch): the bundled
# SmolLM2-135M (GGUF joined by device_setup.sh's two-call recipe), 64 JSON-schema requests against their
# unconstrained twins (benchmarks/structured_outputs.py), this tree alternating with the package before the
# change carried as .oldpkg/ (git archive <commit> pagedllm | tar -x -C .oldpkg). PAIRS rounds of (new, old);
# TESTS=1 first runs the sampler / structured-output GPU tests. S135=1 instead runs a SmolLM2-135M-shaped model with
# dummy bf16 weights and the bundled tokenizer (.tok/ carried; no GGUF needed).
set -u
source benchmarks/gpu/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
if [ "${TESTS:-0}" = 1 ]; then
  timeout ${TEST_LIMIT_S:-300} python3 -m pytest -q -p no:cacheprovider tests/test_sample_kernel.py tests/test_sampler.py \
      tests/test_bitmask_kernel.py tests/test_structured_outputs.py > "$OUT/tests.log" 2>&1
  echo "== tests rc=$?: $(tail -1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
fi
MODEL_ARGS=""
if [ "${S135:-0}" = 1 ]; then
  python3 - <<'PY'
import shutil
from transformers import LlamaConfig
LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
            tie_word_embeddings=True).save_pretrained("/tmp/s135")
PY
  MODEL_ARGS="--model /tmp/s135 --tokenizer .tok --load-format dummy --dtype bfloat16"
fi
for i in $(seq 1 ${PAIRS:-2}); do
  for arm in new old; do
    pp=$PYTHONPATH; [ $arm = old ] && pp=$PWD/.oldpkg:$PYTHONPATH
    t0=$(date +%s)
    PYTHONPATH=$pp timeout ${RUN_LIMIT_S:-150} python3 benchmarks/structured_outputs.py --num-requests 64 \
        --repeats ${REPEATS:-4} --ttft-repeats 1 --backend xgrammar $MODEL_ARGS > "$OUT/so_135m_${arm}_$i.log" 2>&1
    echo "== $arm $i rc=$? ($(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
    grep -a -E "^\[end-to-end|^\[xgrammar" "$OUT/so_135m_${arm}_$i.log" | tee -a "$OUT/summary.txt"
  done
done
