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
python3 benchmarks/gpu/make_s135.py /tmp/s135
timeout ${RUN_LIMIT_S:-300} python3 benchmarks/gpu/structured_timeline.py /tmp/s135 > "$OUT/timeline_135m.log" 2>&1
echo "timeline rc=$?"; grep -v "^\s*$" "$OUT/timeline_135m.log" | tail -60
