#!/bin/bash
# Triton builds after the warm start (BENCHMARKS §84.1): small random bf16 models of four kinds (Llama; a Bamba hybrid;
# a Qwen3-MoE; a Jamba hybrid with MoE) through benchmarks/gpu/compile_watch_probe.py, each in a fresh process; then
# (unless SKIP_BAMBA) §83's first-step stall case: the 2.31 B Bamba after throughput.py's measurements (BEFORE=measure).
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/gpu.txt"
python3 benchmarks/gpu/make_random_llama.py /tmp/cw_llama 1024 8 16 4 2816 32000 > /dev/null 2>&1
python3 benchmarks/gpu/make_random_moe.py /tmp/cw_moe small > /dev/null 2>&1
python3 - <<PY 2>&1 | grep -v Writing
import torch, transformers
torch.manual_seed(0)
bamba = transformers.BambaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=4, attn_layer_indices=[3, 7], mamba_n_heads=32, mamba_d_head=64,
    mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_chunk_size=256, max_position_embeddings=4096,
    tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
jamba = transformers.JambaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
    attn_layer_period=4, attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, num_experts=8,
    num_experts_per_tok=2, num_attention_heads=16, num_key_value_heads=4, mamba_d_state=16, mamba_expand=2,
    mamba_dt_rank=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
for path, cfg, cls in (("/tmp/cw_bamba", bamba, transformers.BambaForCausalLM),
                       ("/tmp/cw_jamba", jamba, transformers.JambaForCausalLM)):
    with torch.device("cuda"):
        m = cls(cfg).to(torch.bfloat16)
    m.save_pretrained(path)
    print(path, f"{sum(p.numel() for p in m.parameters()) / 1e9:.2f} B params")
PY
timeout ${T_PROBE:-300} python3 benchmarks/gpu/compile_watch_probe.py ${MODELS:-/tmp/cw_llama /tmp/cw_bamba /tmp/cw_moe /tmp/cw_jamba} \
  > "$OUT/compile_watch.txt" 2>&1; echo "probe rc=$?"
grep -v "^    built" "$OUT/compile_watch.txt" | tail -20
grep "^    built" "$OUT/compile_watch.txt" | cut -c1-160 | sort | uniq -c | sort -rn | head -30
if [ -z "$SKIP_BAMBA" ]; then
  SKIP_TESTS=1 T_BENCH=3 NUM=2 COMPARE=none bash benchmarks/gpu/mamba_session.sh > /dev/null 2>&1
  BEFORE=measure timeout ${T_STALL:-200} python3 benchmarks/gpu/mamba_steps_probe.py /tmp/bamba 64 "" 2 > "$OUT/stall_probe.log" 2>&1
  echo "stall probe rc=$?"; grep -E "^run|Triton builds|step (prefill|mixed)" "$OUT/stall_probe.log" | head -40
fi
