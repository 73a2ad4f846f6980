# Issue 18's workload (64 requests, 16-256 in, 128 out) with VLLM_BATCH_INVARIANT=0 and =1 alternating,
# float32 (--quantization none) and the default GGUF-quantized path.
# OUT=benchmarks/results/cpu_1202 bash benchmarks/results/cpu_1202/bi_cost.sh
set -e
for round in 1 2; do
  for q in none gguf; do
    for bi in 0 1; do
      VLLM_BATCH_INVARIANT=$bi python benchmarks/throughput.py --quantization $q --output-json $OUT/bi_${q}_${bi}_$round.json \
        > $OUT/bi_${q}_${bi}_$round.txt 2>&1
      grep -E "^pagedllm |^decode|^mixed|^prefill|host speed" $OUT/bi_${q}_${bi}_$round.txt | sed "s/^/[$q bi=$bi r$round] /"
    done
  done
done
