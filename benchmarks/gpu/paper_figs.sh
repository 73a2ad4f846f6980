#!/bin/bash
# GPU session script (1x H100): Figs. 2 and 14-19 of the paper at its shape — OPT-13B config with dummy fp16
# weights, 12 GB of KV (Table 1), block 16, max_model_len 2048 — one `python -m pagedllm.benchmarks.paper.cli`
# per figure, with request counts, rates and block sizes cut so that all of them fit ~25 minutes of one GPU
# (the defaults are written for longer runs). FIGS picks the figures (default: all of them); each writes
# paper/<fig>.{json,md,png} and its log <fig>.log, all in $OUT/paper_figs.tgz. A figure is skipped when under 60 s remain.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TQDM_DISABLE=1
source benchmarks/gpu/carried_wheels.sh
OUT=${OUT:-/tmp/out}; D=$OUT/paper; mkdir -p "$D"
END=$(( $(date +%s) + ${BUDGET_S:-550} ))
declare -A A=(
  # Fig. 2: the first 30 s of each system's all-at-once ShareGPT-like trace (300 requests), one engine.
  [fig2]="--num-requests 300 --max-point-seconds 30"
  # Fig. 14: Alpaca-like, 100 requests per point, n / beam width 2, 4, 6.
  [fig14]="--num-requests 100 --rates 16 32 64 128 --max-point-seconds 60"
  # Fig. 15: the sharing measurement (20 requests per point), both traces.
  [fig15]="--num-requests 20"
  # Fig. 16: 1-shot and 5-shot prefixes, 100 requests per point.
  [fig16]="--num-requests 100 --rates 16 32 64 128 --max-point-seconds 60"
  # Fig. 17: chatbot, 40 requests per point, three systems (the paper's Orca variants behave alike here).
  [fig17]="--num-requests 40 --rates 1.5 3 --systems paged orca-oracle orca-max --max-point-seconds 90"
  # Fig. 18: (a) the Triton decode kernel vs contiguous SDPA; (b) block sizes 1..256 in powers of 4 at fixed rates.
  [fig18]="--num-requests 40 --block-sizes 1 4 16 64 256 --max-point-seconds 60"
  # Fig. 19: swap vs recompute per block size (1024-token sequence), end to end at 4 req/s.
  [fig19]="--num-requests 40 --block-sizes 16 64 256 --max-point-seconds 60"
)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/summary.txt"
for fig in ${FIGS:-fig2 fig14 fig15 fig16 fig17 fig18 fig19}; do
  left=$(( END - $(date +%s) ))
  [ $left -lt 60 ] && { echo "$fig skipped ($left s left)" | tee -a "$OUT/summary.txt"; continue; }
  t0=$(date +%s)
  timeout $left python3 -m pagedllm.benchmarks.paper.cli $fig --scale paper --device cuda ${A[$fig]} \
    --output-dir "$D" > "$OUT/$fig.log" 2>&1
  rc=$?
  echo "$fig rc=$rc $(( $(date +%s) - t0 )) s: ${A[$fig]}" | tee -a "$OUT/summary.txt"
  grep -a -E "done in|engine ready|Error|error" "$OUT/$fig.log" | tail -4
done
# The device returns at most 8 files per call: everything in one archive.
(cd "$OUT" && tar czf paper_figs.tgz paper ./*.log && rm -rf paper ./*.log)
