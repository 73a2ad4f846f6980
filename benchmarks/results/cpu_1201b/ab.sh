# Issue 18's workload (float32, pagedllm only) at HEAD (a clone at /tmp/head_clone) and the working tree,
# alternating; the decode-step rows and the whole run of each.
#   bash benchmarks/results/cpu_1201b/ab.sh NAME ROUNDS
name=${1:-ab}; rounds=${2:-2}; out=benchmarks/results/cpu_1201b
for i in $(seq 1 "$rounds"); do
  for side in head new; do
    root=$([ $side = head ] && echo /tmp/head_clone || echo "$PWD")
    PYTHONPATH=$root HF_HUB_OFFLINE=1 python "$root/benchmarks/throughput.py" --quantization none \
      > "$out/${name}_${side}_$i.txt" 2>&1
    echo "$side $i: $(grep -E '^(decode|whole run)' "$out/${name}_${side}_$i.txt" | tr -s ' ' | cut -c1-120 | tr '\n' '|')"
  done
done
