#!/usr/bin/env bash
# DeepSeek-V2-Lite's shape (dummy bf16 weights), the same ShareGPT-like requests with the two KV-cache layouts of
# DeepSeek's MLA: each head's expanded K / V (the code of commit 1b7d3e9, unpacked from .head_tgz/head.tgz, which
# `git archive 1b7d3e9 pagedllm | gzip` writes) and the compressed latent (this tree). Run from the repo root on the
# device after `source benchmarks/gpu/device_setup.sh`; N requests (default 1000), results under $OUT.
set -u
python3 benchmarks/gpu/make_deepseek_config.py /tmp/dsl v2-lite > /dev/null
mkdir -p /tmp/head && tar xzf .head_tgz/head.tgz -C /tmp/head
ARGS="--model /tmp/dsl --load-format dummy --skip-tokenizer-init --dtype bfloat16 --device cuda --no-lower-bound
      --num-prompts ${N:-1000} --dataset sharegpt-like --max-model-len 2048 ${EXTRA:-}"
for mode in ${MODES:-latent expanded}; do
  if [ "$mode" = expanded ]; then src=/tmp/head; else src=$PWD; fi
  echo "== $mode"
  PYTHONPATH=$src:/tmp/site timeout "${RUN_LIMIT_S:-280}" python3 benchmarks/throughput.py $ARGS \
    --output-json "$OUT/ds_$mode.json" > "$OUT/ds_$mode.log" 2>&1
  grep -E "KV cache:|Maximum concurrency|engine init|pool:|^steps|^decode|^prefill|^mixed|^all|pagedllm  |Error|error" \
    "$OUT/ds_$mode.log" | grep -v "Processed prompts"
done
