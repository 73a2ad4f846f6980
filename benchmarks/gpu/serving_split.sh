#!/bin/bash
# Issue 16, server: the API-server / engine-core process split against the engine on a thread of the
# server process, same GPU, same call. LLaMA-7B shape (32 layers, hidden 4096, MHA, vocab 32000, dummy
# bf16 weights), the ShareGPT-like lengths (prompts 16-304, outputs 34-646 tokens), Poisson
# arrivals, every request streamed (`pagedllm bench serving`, aiohttp client). Then `bench http-overhead`
# (64 concurrent short requests, HTTP vs LLM.generate in the same run) against the split server.
# Needs .tok/ (the bundled tokenizer: python -c "from pagedllm.tokenizer import get_tokenizer;
# get_tokenizer(None).save_pretrained('.tok')") and the server extras + xgrammar as cp312 wheels in .whl/.
#   SPLIT_RATES="18:800 22:800" INPROC_RATES="18:800" bash benchmarks/gpu/serving_split.sh
# (an empty SPLIT_RATES or INPROC_RATES skips that server; SKIP_HTTP=1 skips bench http-overhead)
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRITON_CACHE_DIR=/tmp/triton-cache
if [ -d .whl ] && [ -z "${NO_WHL:-}" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD:/tmp/site || exit 1; fi
python3 -c "import uvicorn, fastapi, uvloop, httptools, aiohttp, xgrammar, pagedllm.entrypoints.openai.server, pagedllm.engine.core_client" || exit 1
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"; } | tee $OUT/sweep.log
date -u | tee -a $OUT/sweep.log
python3 -c "from transformers import LlamaConfig; LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=2048, tie_word_embeddings=False).save_pretrained('/tmp/l7b')"
cp .tok/* /tmp/l7b/
ENGINE=${ENGINE:-"--model /tmp/l7b --load-format dummy --device cuda --dtype bfloat16 --max-model-len 2048 --max-num-seqs 256"}
get() { python3 -c "import sys,urllib.request; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:8300'+sys.argv[1], timeout=5).read().decode())" "$1"; }
one() { timeout 60 python3 -m pagedllm.entrypoints.cli bench serving --port 8300 --num-prompts 1 --input-len 160 \
  --output-len 32 --range-ratio 0 --seed 1 2>&1 | grep -E "Mean TTFT|Failed" | sed "s/^/$1 request: /" | tee -a $OUT/sweep.log; }
sweep() {  # $1: mode name, $2: extra serve flags, $3: rates
  local t0=$(date +%s)
  python3 -m pagedllm.entrypoints.cli serve $ENGINE $2 --port 8300 > /tmp/serve_$1.log 2>&1 &
  local server=$!
  until get /health >/dev/null 2>&1; do sleep 1; [ $(( $(date +%s) - t0 )) -gt 240 ] && { echo "server not healthy in time"; tail -30 /tmp/serve_$1.log; return 1; }
    kill -0 $server 2>/dev/null || { echo "server died"; tail -30 /tmp/serve_$1.log; return 1; }; done
  echo "== $1: server healthy after $(( $(date +%s) - t0 )) s" | tee -a $OUT/sweep.log
  one "$1 fresh"
  for spec in $3; do local rate=${spec%%:*} n=${spec##*:}
    timeout ${TR:-110} python3 -m pagedllm.entrypoints.cli bench serving --port 8300 --num-prompts $n --request-rate $rate \
      --input-len 160 --output-len 340 --range-ratio 0.9 --seed 0 --result-json /tmp/res/$1_rate_$rate.json > /tmp/rate.log 2>&1
    echo "== $1 rate $rate ($n prompts) rc=$?" | tee -a $OUT/sweep.log
    grep -E "Successful|Failed|duration|Request throughput|Output token|Median TPOT|P99 TPOT|Median TTFT|P99 TTFT|Mean TPOT" /tmp/rate.log | tee -a $OUT/sweep.log
  done
  one "$1 warm"
  get /metrics | grep -E "^(vllm:num_requests_running|pagedllm:kv_blocks_free|pagedllm:kv_blocks_total|pagedllm:request_aborted_total)" | tee -a $OUT/sweep.log
  kill -TERM $server; wait $server; echo "$1 server exit rc=$?" | tee -a $OUT/sweep.log
  tail -c 20000 /tmp/serve_$1.log > $OUT/serve_$1.log
}
mkdir -p /tmp/res
[ -n "${SPLIT_RATES-18:800 22:800}" ] && sweep split "" "${SPLIT_RATES-18:800 22:800}"
[ -n "${INPROC_RATES-18:800}" ] && sweep inproc "--disable-frontend-multiprocessing" "${INPROC_RATES-18:800}"
if [ "${SKIP_HTTP:-0}" != 1 ]; then
  timeout ${TH:-200} python3 -m pagedllm.entrypoints.cli bench http-overhead $ENGINE --repeats ${REPEATS:-3} \
    --server-arg=--gpu-memory-utilization=0.4 --output-json /tmp/res/http_overhead.json 2>&1 \
    | grep -v "it/s\]\|s/it\]" | tail -12 | tee $OUT/http_overhead.log
fi
tar czf $OUT/results.tgz -C /tmp/res .
