"""The bundled SmolLM2-135M (its float32 conversion) written as a GPTQ 4-bit checkpoint (symmetric, group 64), with
this suite's packer (tests/int_weight_checkpoints.py; round to nearest, no calibration): DIR and DIR-dequantized."""
import sys
from pathlib import Path

sys.path.insert(0, "tests")
from int_weight_checkpoints import Kind, write_int_checkpoint  # noqa: E402

from pagedllm.model.loader import prepare_model_dir  # noqa: E402

dst = Path(sys.argv[1])
twin = write_int_checkpoint(prepare_model_dir(None), dst, Kind("gptq", 4, 64, sym=True, checkpoint_format="gptq"))
print("wrote", dst, "and", twin)
