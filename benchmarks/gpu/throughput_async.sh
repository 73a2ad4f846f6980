#!/bin/bash
# Offline throughput (Llama-3-8B shape, dummy bf16, 1000 ShareGPT-like requests) with asynchronous
# vs synchronous scheduling, same run.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 -c "from transformers import LlamaConfig; from pagedllm.benchmarks.roofline import LLAMA3_8B; LlamaConfig(**LLAMA3_8B).save_pretrained('/tmp/l8b')"
for mode in async-scheduling no-async-scheduling; do
  timeout ${T:-250} python3 benchmarks/throughput.py --model /tmp/l8b --load-format dummy --device cuda --dtype bfloat16 \
    --dataset sharegpt-like --num-prompts ${N:-1000} --skip-tokenizer-init --max-model-len 2048 --max-num-seqs 256 \
    --$mode > $OUT/throughput_$mode.log 2>&1; echo "throughput $mode rc=$?"
  grep -v "it/s\]" $OUT/throughput_$mode.log | tail -4
done
