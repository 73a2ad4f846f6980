#!/bin/bash
# State-space models on the GPU (BENCHMARKS §81): the CUDA tests of the Mamba-2 paths, then offline throughput of a
# Bamba-shaped hybrid (random bf16 weights saved by transformers) against transformers' generate on all the same
# requests in the same run. SHAPE=1b (default) or 9b (Bamba), or mamba1 (a mamba-1.4b-shaped Mamba-1); NUM=number of
# requests; COMPARE=none leaves the peer out (step timings only).
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/gpu.txt"
if [ -z "$SKIP_TESTS" ]; then
  timeout ${T_TESTS:-200} python3 -m pytest -q -p no:cacheprovider tests/test_triton_mamba.py tests/test_mamba_engine.py \
    -k "cuda or triton or decode_kernels" > "$OUT/tests.txt" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/tests.txt"
fi
python3 - <<PY
import torch, transformers
shapes = {
  "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=16,
             num_key_value_heads=8, attn_layer_indices=[7, 15, 23], mamba_n_heads=64, mamba_d_head=64),
  "9b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, attn_layer_indices=[9, 18, 27], mamba_n_heads=128, mamba_d_head=64),
}
torch.manual_seed(0)
if "${SHAPE:-1b}" == "mamba1":
    cfg = transformers.MambaConfig(vocab_size=50280, hidden_size=2048, state_size=16, num_hidden_layers=48, expand=2,
                                   conv_kernel=4, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    model_cls = transformers.MambaForCausalLM
else:
    cfg = transformers.BambaConfig(vocab_size=128256, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4,
                                   mamba_chunk_size=256, max_position_embeddings=8192, tie_word_embeddings=False,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2, **shapes["${SHAPE:-1b}"])
    model_cls = transformers.BambaForCausalLM
with torch.device("cuda"):
    m = model_cls(cfg).to(torch.bfloat16)
print(f"{sum(p.numel() for p in m.parameters()) / 1e9:.2f} B params")
m.save_pretrained("/tmp/bamba")
PY
timeout ${T_BENCH:-330} python3 benchmarks/throughput.py --model /tmp/bamba --skip-tokenizer-init --dtype bfloat16 \
  --device cuda --num-prompts ${NUM:-128} --input-len-min 64 --input-len-max 512 --output-len 128 --max-model-len 2048 \
  --compare ${COMPARE:-hf} --hf-batch-size ${HF_BS:-64} --gpu-memory-utilization 0.55 ${EXTRA:-} --output-json "$OUT/bamba_${SHAPE:-1b}.json" > "$OUT/bamba_${SHAPE:-1b}.log" 2>&1
echo "bench rc=$?"
grep -v "it/s\]\|s/it\]\|Warn\|falling back" "$OUT/bamba_${SHAPE:-1b}.log" | tail -30
