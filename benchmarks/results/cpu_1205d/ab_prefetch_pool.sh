cd /work/main
out=benchmarks/results/cpu_1205d/ab_prefetch_pool.txt; : > $out
for rep in 1 2; do
 for cfg in "old thp" "new thp" "old plain" "new plain"; do
  set -- $cfg
  envs="PYTHONPATH=/work/main HF_HUB_OFFLINE=1"
  [ $1 = old ] && envs="$envs CC=/tmp/exp/cc_old"
  [ $2 = thp ] && envs="$envs PAGEDLLM_EXP_THP_POOL=1"
  r=$(env $envs python benchmarks/throughput.py --compare none --quantization none 2>&1 | grep -E "^decode|^mixed|^prefill|^pagedllm  ")
  echo "== rep $rep kernel=$1 pool=$2" >> $out; echo "$r" >> $out
 done
done
