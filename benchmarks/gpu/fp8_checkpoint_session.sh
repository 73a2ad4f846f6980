#!/usr/bin/env bash
# FP8 checkpoints on the GPU (issue 21) plus the GPU tests of the code they touch and of stop 47's unverified
# refactors (`_attend_causal`, whole-step staging). No GGUF needed (tiny random models and a dummy 8B shape):
#   1. pytest: FP8 checkpoints, FP8 weights, the Triton kernels, piecewise/whole-step graphs, CUDA graphs;
#   2. a random Llama-3-8B-shaped FP8 checkpoint (compressed-tensors, per-channel), written here, then the same
#      short workload through it and through --quantization fp8 of the bf16 dummy model (same engine settings).
set -u
source benchmarks/gpu/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/summary.txt"
git log -1 --format='%h %s' 2>/dev/null | tee -a "$OUT/summary.txt"
TESTS=${TESTS:-tests/test_fp8_checkpoint.py tests/test_fp8_weights.py tests/test_triton_kernels.py tests/test_piecewise_graphs.py tests/test_cuda_graphs.py}
timeout ${TEST_S:-260} python3 -m pytest $TESTS -q -rf -p no:cacheprovider > "$OUT/tests.txt" 2>&1
echo "== tests rc=$?" | tee -a "$OUT/summary.txt"; tail -5 "$OUT/tests.txt" | tee -a "$OUT/summary.txt"
python3 - <<'PY'
from transformers import LlamaConfig
from pagedllm.benchmarks.roofline import LLAMA3_8B
LlamaConfig(**LLAMA3_8B).save_pretrained("/tmp/l8b")
PY
python3 benchmarks/gpu/make_fp8_checkpoint.py /tmp/l8b /tmp/l8b-fp8 2>&1 | tail -2 | tee -a "$OUT/summary.txt"
W="--device cuda --skip-tokenizer-init --num-prompts 1000 --input-len-min 8 --input-len-max 64 --output-len 64 --max-model-len 2048"
for run in ${RUNS:-ckpt requant}; do
  if [ $run = ckpt ]; then M="--model /tmp/l8b-fp8 --dtype bfloat16"; else M="--model /tmp/l8b --load-format dummy --dtype bfloat16 --quantization fp8"; fi
  timeout ${RUN_S:-110} python3 benchmarks/throughput.py $M $W > "$OUT/$run.log" 2>&1
  echo "== $run rc=$?" | tee -a "$OUT/summary.txt"
  grep -v "it/s\]\|s/it\]" "$OUT/$run.log" | grep "FP8 checkpoint\|Loaded\|Model loading\|KV cache:\|engine init\|tok/s\|lower bound\|pool:" | cut -c1-300 | tee -a "$OUT/summary.txt"
done
