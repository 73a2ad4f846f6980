# Issue 16: do GEMMs that leave SMs free (cuBLASLt's SM count target, torch._C._set_sm_carveout_experimental)
# let another micro-batch's attention overlap them? Run on the device from the repo root; writes under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
python - <<'PY' 2>&1 | tee $OUT/gemm_carveout.txt
# One GEMM of a 1 024-row decode step (Llama-3-8B gate_up) per carve-out: is the setting honoured?
import torch
torch.backends.cuda.preferred_blas_library("cublaslt")
x = torch.randn(1024, 4096, device="cuda", dtype=torch.bfloat16)
w = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16)
sms = torch.cuda.get_device_properties(0).multi_processor_count
for c in (None, 8, 16, 32, 66):
    torch._C._set_sm_carveout_experimental(c)
    for _ in range(3):
        x @ w.t()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        x @ w.t()
    e.record(); e.synchronize()
    ms = s.elapsed_time(e) / 20
    print(f"SMs {sms}, carve-out {c}: {ms:.3f} ms, {2 * 1024 * 4096 * 28672 / ms / 1e9:.0f} TFLOP/s")
PY
P=benchmarks/gpu/microbatch_overlap_probe.py
python $P --batch 1024 --context 70 --splits 1 --json $OUT/default_b1024c70.json 2>&1 | tee $OUT/default_b1024c70.txt
for cfg in "--batch 1024 --context 70" "--batch 1024 --context 300" "--shape l7b --batch 256 --context 330"; do
  tag=$(echo $cfg | tr -d ' -')
  python $P $cfg --blas cublaslt --carveouts -1 8 16 32 --splits 1 2 --json $OUT/lt_$tag.json 2>&1 | tee $OUT/lt_$tag.txt
done
