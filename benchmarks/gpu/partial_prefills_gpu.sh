#!/usr/bin/env bash
# The CUDA tests of the tree (time-boxed), then benchmarks/partial_prefills.py at GPU size: the Llama-3-8B shape with
# dummy bf16 weights and the bundled tokenizer (.tok/ carried), long prompts ahead of short ones, the default chunked
# schedule against vLLM's partial-prefill knobs. Into $OUT.
set -u
source benchmarks/gpu/device_setup.sh > /tmp/setup.log 2>&1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
git log -1 --format=%h 2>/dev/null | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  t0=$(date +%s)
  timeout ${TESTS_S:-300} python3 -m pytest tests -m cuda -q -p no:cacheprovider -rs > "$OUT/cuda_tests.txt" 2>&1
  echo "cuda tests rc=$? ($(( $(date +%s) - t0 )) s)"; tail -15 "$OUT/cuda_tests.txt"
fi
python3 -c "from transformers import LlamaConfig; from pagedllm.benchmarks.roofline import LLAMA3_8B; LlamaConfig(**LLAMA3_8B).save_pretrained('/tmp/l8b')"
cp .tok/tokenizer* .tok/special_tokens_map.json /tmp/l8b/ 2>/dev/null
timeout ${BENCH_S:-200} python3 benchmarks/partial_prefills.py --model /tmp/l8b --tokenizer .tok --load-format dummy \
  --dtype bfloat16 --num-long ${NUM_LONG:-8} --long-words ${LONG_WORDS:-4000} --num-short ${NUM_SHORT:-64} \
  --output-len 32 --threshold ${THRESHOLD:-512} --partial 4 --long-partial 1 \
  --max-num-batched-tokens ${MNBT:-2048} --repeats 3 --kv-cache-memory-bytes 8000000000 2>&1 | tee "$OUT/partial_prefills_l8b.txt" | grep -v "^\s*$" | tail -25
