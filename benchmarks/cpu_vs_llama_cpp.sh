#!/usr/bin/env bash
# Issue 18's quantized rows against llama.cpp on this CPU: the bundled Q4_1 GGUF, the same random token-id prompts
# (16-64 tokens, 64 output tokens each) through pagedllm and llama-server (built as README.md says), one sequence at a
# time (8 requests), 16 and 64 requests, each llama.cpp slot count tried (the best kept). Logs + JSON into $OUT.
set -u
OUT=${OUT:-benchmarks/results/cpu_vs_llama_cpp}; mkdir -p "$OUT"  # this session: OUT=benchmarks/results/cpu_1127g/vs_llama_cpp
lscpu | grep -E "Model name|^CPU\(s\)|CPU family|^Model:" > "$OUT/cpu.txt"
echo "ISA flags: $(grep -o 'avx512[a-z_0-9]*\|avx2\|fma\|avx_vnni\|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')" >> "$OUT/cpu.txt"
for row in "8 1 1" "16 16 1,4,16" "64 64 16,64"; do
  read -r n seqs np <<< "$row"
  pagedllm bench throughput --compare llama.cpp --num-gpu-blocks-override 1024 --input-len-min 16 --input-len-max 64 \
      --output-len 64 --num-prompts $n --max-num-seqs $seqs --llama-parallel $np ${EXTRA:-} \
      --output-json "$OUT/n${n}_seqs${seqs}.json" > "$OUT/n${n}_seqs${seqs}.txt" 2>&1
  echo "== $n requests, max_num_seqs $seqs, llama.cpp -np $np: rc=$?"
  grep -v "it/s\]\|s/it\]" "$OUT/n${n}_seqs${seqs}.txt" | grep -E "^pagedllm |^llama|ratio|np[0-9]+" | tail -8
done
