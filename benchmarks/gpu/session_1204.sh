# GPU session of 2026-12-04: graph-captured LoRA. One call with .whl carried (peft); writes to $OUT.
# EAGER=1 adds the 64-prompt run with --enforce-eager; TESTS=0 skips the CUDA LoRA tests.
set -x
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
[ "${TESTS:-1}" = 1 ] && python -m pytest tests/test_lora.py -m cuda -q -p no:cacheprovider --timeout=300 2>&1 | tail -5
python benchmarks/gpu/make_random_llama.py /tmp/r1b 2>&1 | tail -1
B="python -m pagedllm.entrypoints.cli bench lora --model /tmp/r1b --skip-tokenizer-init"
F="INFO\|Processed\|Converting\|Loading\|warn"
$B --num-prompts 64 --output-len 64 --output-json $OUT/lora_r1b_bf16_graphs.json 2>&1 | grep -v "$F" | tail -6
$B --num-prompts 256 --output-len 128 --hf-batch-size 64 --output-json $OUT/lora_r1b_bf16_256_graphs.json 2>&1 | grep -v "$F" | tail -6
[ "${EAGER:-0}" = 1 ] && $B --num-prompts 64 --output-len 64 --enforce-eager --output-json $OUT/lora_r1b_bf16_eager.json 2>&1 | grep -v "$F" | tail -6
true
