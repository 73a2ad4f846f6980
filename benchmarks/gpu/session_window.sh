# GPU session of 2026-12-04 (third): sliding-window attention and logit soft caps; Gemma 2 / Gemma 3 / Phi-3.
# One call with .whl carried; writes to $OUT. PART (default "tests kernel"):
#   tests   the CUDA tests of the window kernels and the new families (and the MoE fp8 router test)
#   kernel  benchmarks/gpu/sliding_window_bench.py (decode / prefill with and without a window)
#   gemma   random Gemma-2-2B- and Gemma-3-1B-shaped checkpoints against transformers (throughput.py --compare hf)
#   mistral Mistral-7B-v0.1's shape with dummy weights, window 4096 vs none, 2-6 k-token prompts
#   capacity Mistral-7B-v0.1's shape, 64 requests of 8 192 + 512 tokens in a pool of 262 144 token slots: with its
#           window 4096 (blocks behind it freed) against the same model with full attention
#   fused   the CUDA tests of the fused Gemma norm / GeGLU kernels, the Gemma families and Llama's shared RoPE table,
#           and (session of 2026-12-05) partial rotary's Triton variant and Phi-4-mini on CUDA
set -x
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
PARTS="${PART:-tests kernel}"
F="INFO\|Processed\|Converting\|Loading\|warn\|it/s\]"
for part in $PARTS; do case $part in
tests) python -m pytest tests/test_sliding_window_triton.py tests/test_models_hf.py tests/test_models_hf_gemma.py \
         tests/test_triton_kernels.py tests/test_fp8_kv_cache.py tests/test_piecewise_graphs.py \
         tests/test_sliding_window_engine.py -m cuda -q -p no:cacheprovider --timeout=300 -rfE \
         2>&1 | tail -25 | tee $OUT/cuda_tests.txt ;;
fused) python -m pytest tests/test_triton_fused_ops.py tests/test_models_hf_gemma.py tests/test_partial_rotary.py -m cuda -q -p no:cacheprovider \
         --timeout=300 -rfE 2>&1 | tail -12 | tee $OUT/cuda_tests_fused.txt
       python -m pytest tests/test_models_hf.py -k "cuda_greedy_parity" -q -p no:cacheprovider --timeout=300 -rfE \
         2>&1 | tail -6 | tee -a $OUT/cuda_tests_fused.txt ;;
kernel) python benchmarks/gpu/sliding_window_bench.py 2>&1 | tee $OUT/sliding_window_kernel.txt ;;
gemma) for s in ${GEMMAS:-gemma3-1b gemma2-2b}; do
         python benchmarks/gpu/make_random_windowed.py /tmp/$s $s 2>&1 | tail -1
         python benchmarks/throughput.py --model /tmp/$s --skip-tokenizer-init --dtype bfloat16 --compare hf \
           --num-prompts 256 --output-len 128 --hf-batch-size 64 --output-json $OUT/${s}_vs_hf.json 2>&1 \
           | grep -v "$F" | tee $OUT/${s}_vs_hf.txt | tail -20
       done ;;
mistral) for w in 4096 none; do
           python benchmarks/gpu/make_random_windowed.py /tmp/m7_$w mistral-7b --config-only --window $w
           python benchmarks/throughput.py --model /tmp/m7_$w --skip-tokenizer-init --load-format dummy \
             --dtype bfloat16 --compare none --num-prompts 96 --input-len-min 2048 --input-len-max 6144 \
             --output-len 128 --max-model-len 8192 --output-json $OUT/mistral7b_window_$w.json 2>&1 \
             | grep -v "$F" | tee $OUT/mistral7b_window_$w.txt | tail -20
         done ;;
capacity) for w in 4096 none; do
            python benchmarks/gpu/make_random_windowed.py /tmp/m7c_$w mistral-7b --config-only --window $w
            python benchmarks/throughput.py --model /tmp/m7c_$w --skip-tokenizer-init --load-format dummy \
              --dtype bfloat16 --compare none --num-prompts 64 --input-len-min 8192 --input-len-max 8192 \
              --output-len 512 --num-gpu-blocks-override 16384 --max-model-len 8704 \
              --output-json $OUT/capacity_window_$w.json 2>&1 | grep -v "$F" | tee $OUT/capacity_window_$w.txt | tail -12
          done ;;
esac; done
true
