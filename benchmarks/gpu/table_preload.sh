#!/bin/bash
# GPU session 5 (2026-11-23): decode attention with the block-table row preloaded and 2 pipeline stages
# (default where the table has <= 256 columns): kernel tests, the 12-point table three times plus once
# with variants, the decode roofline (async scheduling), and the CUDA-graph / sharing suites.
set -o pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $OUT/gpu.txt
python3 -c "import sys,torch,triton,transformers;print(sys.version.split()[0],torch.__version__,triton.__version__,transformers.__version__)" >> $OUT/gpu.txt
cat $OUT/gpu.txt
timeout 150 python3 -m pytest tests/test_triton_kernels.py -q -x --noconftest -p no:cacheprovider > $OUT/tests_kernels.log 2>&1
rc=$?; echo "kernel tests rc=$rc"; tail -2 $OUT/tests_kernels.log
[ $rc -eq 0 ] || { grep -m5 -B5 "Error" $OUT/tests_kernels.log; exit 1; }
for i in 1 2 3; do
  timeout 100 python3 benchmarks/decode_attention.py --json /tmp/kernels_$i.json > /tmp/kernels_$i.log 2>&1; echo "table run $i rc=$?"
  grep -E "^\| [0-9]" /tmp/kernels_$i.log | awk -F'|' '{printf "b%s c%s paged%s cudnn%s ratio%s\n", $2, $3, $4, $12, $11}'
done
cp /tmp/kernels_1.log $OUT/kernels.log; cp /tmp/kernels_1.json $OUT/kernels.json
timeout 150 python3 benchmarks/decode_attention.py --variants --json $OUT/kernels_variants.json > /tmp/kernels_variants.log 2>&1; echo "variants rc=$?"
python3 - <<'PY'
import json, os
for r in json.load(open(os.environ["OUT"] + "/kernels_variants.json"))["rows"]:
    best = r["best_contig_ms"]
    v = sorted(r["variants"].items(), key=lambda kv: kv[1])
    print(f"b{r['batch']} c{r['context']}: paged {r['paged_ms']*1e3:.1f} cudnn {best*1e3:.1f} ratio {r['ratio']:.3f} | "
          + " ".join(f"{k}={t*1e3:.1f}({t/best:.3f})" for k, t in v))
PY
timeout 150 python3 benchmarks/roofline.py --batch 1 64 256 --context 1024 --steps 20 --async-scheduling \
  --json $OUT/roofline.json > $OUT/roofline.log 2>&1; echo "roofline rc=$?"; tail -6 $OUT/roofline.log
timeout 150 python3 -m pytest tests/test_cuda_graphs.py tests/test_cuda_sharing.py -q --noconftest -p no:cacheprovider > $OUT/tests_graphs.log 2>&1; echo "graph tests rc=$?"; tail -2 $OUT/tests_graphs.log
