#!/bin/bash
# New-schema TTFT with a 300-word prompt: the tree (prompt prefilled while the grammar compiles) against the
# previous commit's package (carried in /tmp/oldpkg), alternating, same benchmark script.
cd "$(dirname "$0")/../../.."
export HF_HUB_OFFLINE=1
for round in 1 2; do
  for pkg in /tmp/oldpkg $PWD; do
    echo "== round $round package $pkg"
    PYTHONPATH=$pkg python benchmarks/structured_outputs.py --num-requests 16 --repeats 1 --ttft-repeats 5 \
      --ttft-prompt-words ${WORDS:-300} 2>&1 | grep "^\[new schema\]\|^\[end-to-end"
  done
done
