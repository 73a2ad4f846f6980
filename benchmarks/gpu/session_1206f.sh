#!/bin/bash
# Session 1206f (BENCHMARKS §81): the cuda-marked tests in two parts (PART=a: the model-family files; PART=b: the
# rest), each under a time limit, with the per-test durations; the bundled GGUF staged by device_setup.sh first.
source benchmarks/gpu/device_setup.sh > /tmp/setup.log 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/gpu.txt"
grep "bundled GGUF" /tmp/setup.log | tee -a "$OUT/gpu.txt"
A="tests/test_models_hf.py tests/test_models_hf_more_families.py tests/test_models_hf_layernorm_families.py
   tests/test_models_hf_gemma.py tests/test_models_hf_llama_variants.py tests/test_models_hf_deepseek.py
   tests/test_lora_more_families.py tests/test_partial_rotary.py"
case "${PART:-a}" in
  a) files=$A; deselect="" ;;
  b) files=tests; deselect="--ignore=tests/test_mamba2_layers.py $(for f in $A; do echo "--ignore=$f"; done)" ;;
  *) files=$PART; deselect="" ;;
esac
timeout ${LIMIT_S:-540} python3 -m pytest -q -m cuda -p no:cacheprovider --durations=15 $files $deselect \
  > "$OUT/cuda_tests_${PART:-a}.txt" 2>&1
echo "rc=$?"; tail -30 "$OUT/cuda_tests_${PART:-a}.txt"
