#!/usr/bin/env bash
# Issue 19: the constrained step's host phases on a SmolLM2-135M-shaped model with dummy bf16 weights and the bundled
# tokenizer (.tok/ carried), via structured_timeline.py; first a CUDA check that the sampler's warm-up (the masked
# one-kernel variant included) runs. Output into $OUT.
set -u
source benchmarks/gpu/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 - <<'PY' 2>&1 | tee "$OUT/warmup_check.txt"
import torch
from pagedllm.model.layers.sampler import Sampler, warm_up_sampler
warm_up_sampler(Sampler(), 49152, torch.device("cuda"), torch.bfloat16)
print("warm_up_sampler on cuda: ok")
PY
python3 - <<'PY'
import shutil
from transformers import LlamaConfig
LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
            torch_dtype="bfloat16").save_pretrained("/tmp/s135")
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f".tok/{f}", "/tmp/s135/")
PY
timeout ${RUN_LIMIT_S:-300} python3 benchmarks/gpu/structured_timeline.py /tmp/s135 > "$OUT/timeline_135m.log" 2>&1
echo "timeline rc=$?"; grep -v "^\s*$" "$OUT/timeline_135m.log" | tail -60
