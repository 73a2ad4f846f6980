#!/usr/bin/env bash
# Issue 18's 16-request quantized row, pagedllm side only, this session's code (new) against 163cdac's package
# (.oldpkg = git archive 163cdac pagedllm), alternating.
cd "$(dirname "$0")/../../.."
D=benchmarks/results/cpu_1127h
for i in 1 2 3 4; do
  for arm in new old; do
    pp=$PWD; [ $arm = old ] && pp=$PWD/.oldpkg
    PYTHONPATH=$pp HF_HUB_OFFLINE=1 python -c "import sys; from pagedllm.entrypoints.cli import main; sys.exit(main())" bench throughput --num-gpu-blocks-override 1024 --input-len-min 16 \
        --input-len-max 64 --output-len 64 --num-prompts 16 --max-num-seqs 16 > $D/quant16_${arm}_$i.txt 2>&1
    echo "$arm $i: $(grep -E '^pagedllm |^decode ' $D/quant16_${arm}_$i.txt | tr -s ' ' | tr '\n' ' ')"
  done
done
