# BENCHMARKS §72.2: old/new attention prefetch × numpy (huge-page) / plain-mapping pool, alternating. "old" builds the
# kernels through a compiler wrapper with the old prefetch settings; "thp" needs the one-session experiment switch
# PAGEDLLM_EXP_THP_POOL (numpy's calloc in cache_engine._zeros), which lived only in the working tree during the A/B.
cd "$(dirname "$0")/../../.."
mkdir -p /tmp/exp && printf '#!/bin/sh\nexec gcc -DPREFETCH_LOCALITY=3 -DPREFETCH_AHEAD=1 "$@"\n' > /tmp/exp/cc_old && chmod +x /tmp/exp/cc_old
out=benchmarks/results/cpu_1205d/ab_prefetch_pool.txt; : > $out
for rep in 1 2; do
 for cfg in "old thp" "new thp" "old plain" "new plain"; do
  set -- $cfg
  envs="PYTHONPATH=$PWD HF_HUB_OFFLINE=1"
  [ $1 = old ] && envs="$envs CC=/tmp/exp/cc_old"
  [ $2 = thp ] && envs="$envs PAGEDLLM_EXP_THP_POOL=1"
  r=$(env $envs python benchmarks/throughput.py --compare none --quantization none 2>&1 | grep -E "^decode|^mixed|^prefill|^pagedllm  ")
  echo "== rep $rep kernel=$1 pool=$2" >> $out; echo "$r" >> $out
 done
done
