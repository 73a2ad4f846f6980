# GPU session for the next lent GPU (written 2026-12-05, not yet run: no machine was lent): pending CUDA tests, the hybrid KV cache on CUDA (eager and graphs), and
# the hybrid layout against one table at the same KV bytes on Gemma-3-1B's shape. One call with .whl carried.
set -x
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a $OUT/gpu.txt
PAGEDLLM_CUDA_HYBRID_KV_CACHE=1 python -m pytest tests/test_triton_fused_ops.py tests/test_int4_checkpoints.py tests/test_multimodal_llava.py \
  tests/test_hybrid_kv_cache.py tests/test_sleep_mode.py -m cuda -q -p no:cacheprovider --timeout=300 -rfE --junitxml=$OUT/cuda_tests.xml \
  2>&1 | tail -25 | tee $OUT/cuda_tests.txt
python benchmarks/gpu/make_random_windowed.py /tmp/g1b gemma3-1b --config-only > /dev/null 2>&1
PAGEDLLM_CUDA_HYBRID_KV_CACHE=1 timeout 240 python benchmarks/hybrid_kv_cache.py --model /tmp/g1b --load-format dummy --device cuda --dtype bfloat16 \
  --num-prompts 128 --input-len 4096 --output-len 256 --kv-cache-memory-bytes 4000000000 \
  --output-json $OUT/hybrid_g1b.json 2>&1 | grep -v "it/s\]" | tail -12 | tee $OUT/hybrid_g1b.txt
true
