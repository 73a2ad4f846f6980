#!/bin/bash
# GPU session script (2× H200): final TP parity (fused kernels, graphs) and 13B TP=1 vs TP=2 throughput.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
timeout 200 python3 -m pytest tests/test_tensor_parallel_gpu.py -q --noconftest -x -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/tp_tests.txt
python3 -c "
from transformers import LlamaConfig; from pagedllm.benchmarks.roofline import LLAMA_13B
LlamaConfig(**LLAMA_13B).save_pretrained('/tmp/l13b')"
for tp in 1 2; do
  timeout 130 python3 benchmarks/throughput.py --model /tmp/l13b --load-format dummy --device cuda --dtype bfloat16 --dataset sharegpt-like --num-prompts 400 --skip-tokenizer-init --max-model-len 2048 --max-num-seqs 256 --tensor-parallel-size $tp --output-json $OUT/tp${tp}_final.json > $OUT/tp${tp}_final.log 2>&1; echo tp=$tp rc=$?
  grep "^pagedllm\|KV cache:" $OUT/tp${tp}_final.log
done
