#!/bin/bash
# Issue 20 GPU run (2026-11-25, H100): speculative decoding on vs off, `pagedllm bench spec-decode`.
# The bundled GGUF (98 MB) cannot travel to the device (64 MiB limit): smol/ holds its config.json and
# tokenizer files (copied from ~/.cache/pagedllm/gguf/<hash>/) and the weights are dummy (random), so the
# acceptance there is a random model's, not SmolLM2's; greedy identity on/off is still checked on all 100.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 120 python3 -m pagedllm.benchmarks.spec_decode --model smol --load-format dummy --dtype float32 \
  --device cuda --num-prompts 100 --max-tokens 64 --concurrency 1 4 --sharegpt-prompts 128 \
  --sharegpt-concurrency 64 --sharegpt-max-out 256 --max-model-len 2048 --out $OUT/spec2.json 2>&1 | tee $OUT/bench2.log
timeout 30 python3 -m pytest tests/test_spec_decode.py -x -q --noconftest -p no:cacheprovider \
  -k "engine_sampling or greedy_is_argmax" 2>&1 | tail -2 | tee $OUT/tests2.log
