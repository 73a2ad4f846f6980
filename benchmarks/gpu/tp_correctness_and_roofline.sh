#!/bin/bash
# GPU session script (2× H200): NCCL tensor-parallel parity, GPU kernel/graph tests, decode roofline.
# Run from the repo root on the device machine; results go to $OUT.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/env.txt
nvidia-smi topo -m 2>&1 | head -8 | tee -a $OUT/env.txt
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.device_count())" | tee -a $OUT/env.txt
echo "=== TP=2 (NCCL) vs TP=1"
timeout 240 python3 -m pytest tests/test_tensor_parallel_gpu.py -q --noconftest -x -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/tp_tests.txt
echo "=== roofline (graphs)"
timeout 150 python3 benchmarks/roofline.py --batch 1 64 256 --context 1024 --json $OUT/roofline.json > $OUT/roofline.log 2>&1; echo rc=$?
grep -v "Processed\|Warning" $OUT/roofline.log | tail -8
echo "=== kernel + graph tests"
timeout 150 python3 -m pytest tests/test_triton_kernels.py tests/test_cuda_graphs.py -q --noconftest -n 4 -p no:cacheprovider 2>&1 | tail -6 | tee $OUT/gpu_tests.txt
