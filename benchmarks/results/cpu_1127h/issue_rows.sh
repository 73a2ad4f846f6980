#!/usr/bin/env bash
# Issue 20's CPU row (float32, 4 concurrent), issue 18's 16-request row against llama.cpp and its float32 row against
# HF static, after the attention change (e20a1d6), one after another on this CPU.
cd "$(dirname "$0")/../../.."
D=benchmarks/results/cpu_1127h
export HF_HUB_OFFLINE=1
pagedllm bench spec-decode --device cpu --quantization none --num-prompts 24 --max-tokens 128 --rounds 3 --concurrency 4 \
    --sharegpt-prompts 0 --max-model-len 1024 --num-gpu-blocks 1024 > $D/spec_f32_c4_${RUN:-1}.txt 2>&1
grep -A4 "^workload" $D/spec_f32_c4_${RUN:-1}.txt
pagedllm bench throughput --compare llama.cpp --num-gpu-blocks-override 1024 --input-len-min 16 --input-len-max 64 \
    --output-len 64 --num-prompts 16 --max-num-seqs 16 --llama-parallel 4,16 > $D/llama_n16_${RUN:-1}.txt 2>&1
grep -v "it/s\]\|s/it\]" $D/llama_n16_${RUN:-1}.txt | grep -E "^pagedllm |^llama|ratio|np[0-9]+" | tail -6
python benchmarks/throughput.py --compare hf --quantization none > $D/issue18_f32_vs_hf_${RUN:-1}b.txt 2>&1
grep -E "^pagedllm |^hf |^decode |ratio" $D/issue18_f32_vs_hf_${RUN:-1}b.txt
