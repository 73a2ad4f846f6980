#!/bin/bash
# GPU session 3 (2026-11-23): kernel + CUDA-graph + async-scheduling tests, the decode-attention table
# with the single-launch split-KV, and the decode roofline with asynchronous vs synchronous scheduling.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
python3 -c "import sys,torch,triton,transformers;print(sys.version.split()[0],torch.__version__,triton.__version__,transformers.__version__)" >> $OUT/gpu.txt
cat $OUT/gpu.txt
timeout ${T_TESTS:-200} python3 -m pytest tests/test_triton_kernels.py tests/test_cuda_graphs.py tests/test_cuda_sharing.py \
  -q --noconftest -p no:cacheprovider > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/tests.log
timeout ${T_KERNELS:-150} python3 benchmarks/decode_attention.py --json $OUT/kernels.json > $OUT/kernels.log 2>&1; echo "kernels rc=$?"
grep -E "^\|" $OUT/kernels.log | head -16
for mode in async-scheduling no-async-scheduling; do
  timeout ${T_ROOF:-150} python3 benchmarks/roofline.py --batch 1 64 256 --context 1024 --steps 20 --$mode \
    --json $OUT/roofline_$mode.json > $OUT/roofline_$mode.log 2>&1; echo "roofline $mode rc=$?"
  tail -6 $OUT/roofline_$mode.log
done
