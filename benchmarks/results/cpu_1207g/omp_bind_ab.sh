cd /work/main
for i in 1 2; do
for b in auto nobind; do
  echo "== $b run $i"
  VLLM_CPU_OMP_THREADS_BIND=$b PYTHONPATH=/work/main HF_HUB_OFFLINE=1 python benchmarks/throughput.py --compare none --quantization none 2>&1 | grep -E "CPU threads|^pagedllm |^decode |^all "
  VLLM_CPU_OMP_THREADS_BIND=$b PYTHONPATH=/work/main HF_HUB_OFFLINE=1 python benchmarks/throughput.py --compare none 2>&1 | grep -E "^pagedllm |^decode "
done; done
