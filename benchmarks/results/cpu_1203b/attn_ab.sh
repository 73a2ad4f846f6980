#!/bin/bash
# The attention kernel alone, two trees alternating: bash attn_ab.sh ROUNDS OLD_TREE NEW_TREE [ISA...]
# (each tree a checkout of pagedllm; CONFIGS: attn_lens.py's "LENS QLEN" pairs, separated by ';').
ROUNDS=$1; OLD=$2; NEW=$3; shift 3
ISAS=${@:-avx512 avx2}
HERE=$(cd "$(dirname "$0")" && pwd)
for r in $(seq "$ROUNDS"); do
  for isa in $ISAS; do
    for tree in "$OLD" "$NEW"; do
      IFS=';' read -ra CFGS <<< "${CONFIGS:-700 1;2000 1;4000 1;700 5;2000 5;300,700,1100,1500 1;300,700,1100,1500 5;600,650,700,750,800,850,900,950 1;$(python -c 'print(",".join(str(150 + 10 * i) for i in range(64)))') 1}"
      for cfg in "${CFGS[@]}"; do
        echo "round $r $isa $(basename "$tree"): $(PAGEDLLM_CPU_ISA=$isa PYTHONPATH=$tree python "$HERE/attn_lens.py" $cfg 5 2>&1 | grep lens)"
      done
    done
  done
done
