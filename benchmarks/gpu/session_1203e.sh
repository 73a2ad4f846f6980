# GPU session of 2026-12-03 (fifth): the pooling runner and multi-LoRA on CUDA. Needs the GGUF (two calls with
# .gg1 and .gg2 first). Writes to $OUT.
set -x
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python -m pytest tests/test_pooling.py tests/test_lora.py -m cuda -q -p no:cacheprovider --timeout=300 2>&1 | tail -5
python -m pagedllm.entrypoints.cli bench embed --output-json $OUT/embed_135m_bf16.json 2>&1 | grep -v "INFO\|Processed\|Converting\|Loading" | tail -3
python benchmarks/gpu/make_random_llama.py /tmp/r1b 2>&1 | tail -1
python -m pagedllm.entrypoints.cli bench embed --model /tmp/r1b --skip-tokenizer-init --num-prompts 512 --input-len-max 512 --output-json $OUT/embed_r1b_bf16.json 2>&1 | grep -v "INFO\|Processed\|Converting\|Loading" | tail -3
python -m pagedllm.entrypoints.cli bench lora --model /tmp/r1b --skip-tokenizer-init --num-prompts 64 --output-len 64 --output-json $OUT/lora_r1b_bf16.json 2>&1 | grep -v "INFO\|Processed\|Converting\|Loading\|warn" | tail -6
