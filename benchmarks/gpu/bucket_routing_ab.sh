source benchmarks/gpu/device_setup.sh
python3 -m pytest tests/test_cuda_graphs.py -q -p no:cacheprovider -x 2>&1 | tail -4 | tee $OUT/tests.txt
RUNS="l8b:u440:bf16:old l8b:u440:bf16 l8b:u440:bf16:old l8b:u440:bf16 l7b:sharegpt1000:bf16:old l7b:sharegpt1000:bf16" BUDGET_S=440 RUN_LIMIT_S=120 OUT=$OUT bash benchmarks/gpu/fp8_many_seqs.sh > $OUT/runs.txt 2>&1
tail -80 $OUT/summary.txt
mkdir -p /tmp/r2 && tar xzf $OUT/logs.tar.gz -C /tmp/r2 && grep -h "Timed\|Captured" /tmp/r2/*.log | cut -c1-400
