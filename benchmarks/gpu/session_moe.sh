# GPU session of 2026-12-04 (second): mixture-of-experts models. One call with .whl carried; writes to $OUT.
# PART=tests: the CUDA MoE tests. PART=kernel: benchmarks/fused_moe.py. PART=e2e: a random 1.3 B Qwen3-MoE against
# transformers (throughput.py --compare hf). PART=big: Qwen3-30B-A3B's shape with dummy weights (no peer: the
# lower bound's fraction). Default: tests kernel e2e.
set -x
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
PARTS="${PART:-tests kernel e2e}"
F="INFO\|Processed\|Converting\|Loading\|warn\|it/s\]"
for part in $PARTS; do case $part in
tests) python -m pytest tests/test_fused_moe.py tests/test_models_hf.py -k "cuda or triton or moe or mixtral" -q \
         -p no:cacheprovider --timeout=300 2>&1 | tail -8 ;;
kernel) python benchmarks/fused_moe.py 2>&1 | tee $OUT/fused_moe_kernel.txt ;;
e2e) python benchmarks/gpu/make_random_moe.py /tmp/q3m small 2>&1 | tail -1
     python benchmarks/throughput.py --model /tmp/q3m --skip-tokenizer-init --dtype bfloat16 --compare hf \
       --num-prompts 256 --output-len 128 --hf-batch-size 64 --output-json $OUT/moe_small_vs_hf.json 2>&1 \
       | grep -v "$F" | tee $OUT/moe_small_vs_hf.txt | tail -25 ;;
big) python benchmarks/gpu/make_random_moe.py /tmp/q3big qwen3-30b-a3b --config-only
     python benchmarks/throughput.py --model /tmp/q3big --skip-tokenizer-init --load-format dummy --dtype bfloat16 \
       --compare none --num-prompts 1000 --output-len 128 --output-json $OUT/moe_30b_a3b_dummy.json 2>&1 \
       | grep -v "$F" | tee $OUT/moe_30b_a3b_dummy.txt | tail -25 ;;
esac; done
true
