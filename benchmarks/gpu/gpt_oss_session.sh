#!/bin/bash
# GPT-OSS on the GPU (BENCHMARKS §84): a gpt-oss-20b-shaped model cut to LAYERS layers (default 4; hidden 2880,
# 64 query / 8 KV heads of 64, 32 experts top-4 of width 2880, vocab 201 088, 128-token windows on every other layer,
# attention sinks; random bf16 weights saved by transformers), served by throughput.py against transformers' generate
# on all the same requests in the same run (COMPARE=none: pagedllm only). NUM requests of 64-512 prompt tokens, 128 out.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/gpu.txt"
python3 - <<PY 2>&1 | grep -v Writing
import torch, transformers
torch.manual_seed(0)
layers = ${LAYERS:-4}
cfg = transformers.GptOssConfig(num_hidden_layers=layers, layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                                vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                                num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                                sliding_window=128, max_position_embeddings=131072, pad_token_id=199999,
                                eos_token_id=200002, attn_implementation="eager")
with torch.device("cuda"):
    m = transformers.GptOssForCausalLM(cfg).to(torch.bfloat16)
with torch.no_grad():
    for n, p in m.named_parameters():
        p.normal_(0, 1.0 if "sinks" in n else 0.02)
print(f"{sum(p.numel() for p in m.parameters()) / 1e9:.2f} B params")
m.save_pretrained("/tmp/gptoss")
PY
timeout ${T_BENCH:-300} python3 benchmarks/throughput.py --model /tmp/gptoss --skip-tokenizer-init --dtype bfloat16 \
  --device cuda --num-prompts ${NUM:-64} --input-len-min 64 --input-len-max 512 --output-len 128 --max-model-len 2048 \
  --compare ${COMPARE:-hf} --hf-batch-size ${HF_BS:-16} --gpu-memory-utilization 0.6 ${EXTRA:-} \
  --output-json "$OUT/gpt_oss.json" > "$OUT/gpt_oss.log" 2>&1
echo "bench rc=$?"
grep -v "it/s\]\|s/it\]\|Warn\|falling back" "$OUT/gpt_oss.log" | tail -25
