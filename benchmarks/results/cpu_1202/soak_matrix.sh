# The soak (benchmarks/soak.py) with preemptions (24 output tokens on 48 blocks), each KV pool with
# VLLM_BATCH_INVARIANT=0 and =1.   OUT=benchmarks/results/cpu_1202 bash benchmarks/results/cpu_1202/soak_matrix.sh
for kv in auto fp8; do
  for bi in 0 1; do
    VLLM_BATCH_INVARIANT=$bi python benchmarks/soak.py --num-requests 300 --max-tokens 24 --rounds 2 \
      --server-args "--kv-cache-dtype $kv" --json $OUT/soak_preempt_${kv}_bi$bi.json > $OUT/soak_preempt_${kv}_bi$bi.log 2>&1
    python -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], {k: d[k] for k in ('sent','output_problems','lost','blocks_leaked','preemptions','fuzz_failures','hostile_failures')})" \
      $OUT/soak_preempt_${kv}_bi$bi.json "kv=$kv VLLM_BATCH_INVARIANT=$bi"
  done
done
