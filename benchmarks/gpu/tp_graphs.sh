#!/bin/bash
# GPU session script (2× H200): TP=2 with CUDA graphs (NCCL all-reduce captured): parity, then 13B throughput.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
echo "=== TP=2 (NCCL, graphs and eager) vs TP=1"
timeout 240 python3 -m pytest tests/test_tensor_parallel_gpu.py -q --noconftest -x -p no:cacheprovider 2>&1 | tail -30 | tee $OUT/tp_tests.txt
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
python3 -c "
from transformers import LlamaConfig; from pagedllm.benchmarks.roofline import LLAMA_13B
LlamaConfig(**LLAMA_13B).save_pretrained('/tmp/l13b')"
echo "=== tp2_graphs"
timeout 200 python3 benchmarks/throughput.py --model /tmp/l13b --load-format dummy --device cuda --dtype bfloat16 --dataset sharegpt-like --num-prompts ${N:-400} --skip-tokenizer-init --max-model-len 2048 --max-num-seqs 256 --tensor-parallel-size 2 --output-json $OUT/tp2_graphs.json > $OUT/tp2_graphs.log 2>&1; echo rc=$?
grep -v "Processed\|Warning\|it/s\]" $OUT/tp2_graphs.log | grep -i "pagedllm\|blocks\|workload\|error\|Trace\|Captured" | tail -8
