# Piecewise graphs hand attention non-owning views of the graph pool's q/k/v instead of copying them (issue 21/16):
# the CUDA tests of the captured paths, then a mixed FP8 step of LLaMA-7B (300 decode rows + 7 x 160 prompt tokens)
# with the previous package (.oldpkg, copies) and this one. Run from the repo root on the device, OUT set.
source benchmarks/gpu/device_setup.sh
python -m pytest tests/test_piecewise_graphs.py tests/test_cuda_graphs.py -q -m cuda -p no:cacheprovider 2>&1 | tail -6 > $OUT/tests.txt
for pkg in old new; do
  if [ $pkg = old ]; then pp=$PWD/.oldpkg:/tmp/site; else pp=$PWD:/tmp/site; fi
  PYTHONPATH=$pp python benchmarks/gpu/profile_mixed_step.py l7b 300 200:600 fp8 7 160 > $OUT/mixed_fp8_$pkg.log 2>&1
done
grep -h "step\|copy\|attention\|passed\|failed" $OUT/*.txt $OUT/*.log | grep -v JSON
