#!/bin/bash
# Issue 16, server part: `pagedllm serve` on the LLaMA-7B shape (32 layers, hidden 4096, MHA, vocab 32000,
# dummy bf16 weights) with `pagedllm bench serving` at several Poisson rates on the issue's ShareGPT-like
# lengths (prompts 16-304, outputs 34-646 tokens: mean 160 / 340, range ratio 0.9), then the HTTP-overhead
# benchmark (64 concurrent short requests, HTTP vs LLM.generate in the same run). Needs a tokenizer in .tok/
# (the bundled SmolLM2 tokenizer saved with save_pretrained; only ids < 32000 are ever decoded):
#   python -c "from pagedllm.tokenizer import get_tokenizer; get_tokenizer(None).save_pretrained('.tok')"
# and, where the device lacks them, the server extras as wheels in .whl/ (pip download --no-deps for cp312
# manylinux: uvicorn fastapi starlette pydantic pydantic_core annotated-types typing-inspection opentelemetry-api).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR=/tmp/triton-cache
# The server's extras (uvicorn, fastapi, starlette, pydantic, opentelemetry-api) travel as wheels in .whl/.
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1; fi
python3 -c "import uvicorn, fastapi, pagedllm.entrypoints.openai.server" || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/sweep.log
python3 -c "from transformers import LlamaConfig; LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048, tie_word_embeddings=False).save_pretrained('/tmp/l7b')"
cp .tok/* /tmp/l7b/ 2>/dev/null
ENGINE=${ENGINE:-"--model /tmp/l7b --load-format dummy --device cuda --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256"}
t0=$(date +%s)
python3 -m pagedllm.entrypoints.cli serve $ENGINE --port 8300 > $OUT/serve.log 2>&1 &
SERVER=$!
get() { python3 -c "import sys,urllib.request; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:8300'+sys.argv[1], timeout=5).read().decode())" "$1"; }
until get /health >/dev/null 2>&1; do sleep 1; [ $(( $(date +%s) - t0 )) -gt ${TS:-240} ] && { echo "server not healthy in time"; tail -30 $OUT/serve.log; exit 1; }; kill -0 $SERVER 2>/dev/null || { echo "server died"; tail -30 $OUT/serve.log; exit 1; }; done
echo "server healthy after $(( $(date +%s) - t0 )) s"
one() { timeout 60 python3 -m pagedllm.entrypoints.cli bench serving --port 8300 --num-prompts 1 --input-len 160 \
  --output-len 32 --range-ratio 0 --seed 1 2>&1 | grep -E "Mean TTFT|Failed" | sed "s/^/$1 request: /" | tee -a $OUT/sweep.log; }
one fresh  # the first request a fresh server sees
for spec in ${RATES:-14:200 18:360 22:360}; do rate=${spec%%:*}; n=${spec##*:}
  # PROFILE_RATE=<rate>: py-spy (a wheel in .whl/) samples the server's threads for PROFILE_S seconds of that rate.
  if [ "$rate" = "${PROFILE_RATE:-}" ] && [ -x /tmp/site/bin/py-spy ]; then (sleep 4; /tmp/site/bin/py-spy record -p $SERVER \
    -d ${PROFILE_S:-12} -r 250 --threads --nonblocking -f raw -o $OUT/pyspy_rate_$rate.txt > $OUT/pyspy.log 2>&1) & fi
  timeout ${TR:-90} python3 -m pagedllm.entrypoints.cli bench serving --port 8300 --num-prompts $n --request-rate $rate \
    --input-len 160 --output-len 340 --range-ratio 0.9 --seed 0 --result-json $OUT/rate_$rate.json > /tmp/rate_$rate.log 2>&1
  echo "== rate $rate ($n prompts) rc=$?"; grep -v "it/s\]\|s/it\]" /tmp/rate_$rate.log | tail -27 | tee -a $OUT/sweep.log
done
one warm  # the same request on the idle server after the sweep
get /metrics | grep -E "^(vllm:num_requests_running|pagedllm:kv_blocks_free|pagedllm:kv_blocks_total|pagedllm:request_aborted_total)" | tee -a $OUT/sweep.log
kill -TERM $SERVER; wait $SERVER; echo "server exit rc=$?"
[ "${SKIP_HTTP:-0}" = 1 ] && exit 0
timeout ${TH:-260} python3 -m pagedllm.entrypoints.cli bench http-overhead $ENGINE --repeats ${REPEATS:-3} --server-arg=--gpu-memory-utilization=0.4 \
  --output-json $OUT/http_overhead.json 2>&1 | grep -v "it/s\]\|s/it\]" | tail -20 | tee $OUT/http_overhead.log
