# GPU session of 2026-12-05 (second): the CUDA tests of this session's new code. One call with .whl carried.
#   the fused GeGLU's float32 check (its bound corrected after call 1), GPTQ / AWQ / compressed-tensors checkpoints
#   dequantized on CUDA against transformers, and LLaVA (images) on CUDA against transformers.
set -x
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python -m pytest tests/test_triton_fused_ops.py tests/test_int4_checkpoints.py tests/test_multimodal_llava.py -m cuda \
  -q -p no:cacheprovider --timeout=300 -rfE 2>&1 | tail -15 | tee $OUT/cuda_tests_1205.txt
true
