cd /work/main
for i in 1 2 3; do
for b in nobind auto; do
  echo "== $b run $i"
  VLLM_CPU_OMP_THREADS_BIND=$b PYTHONPATH=/work/main HF_HUB_OFFLINE=1 python benchmarks/throughput.py --compare none --quantization none 2>&1 | grep -E "^pagedllm |^decode "
done; done
