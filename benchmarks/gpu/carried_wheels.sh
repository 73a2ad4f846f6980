# Sourced by the GPU session scripts: the engine imports xgrammar (a dependency the device image lacks), so
# install the wheels carried in .snap-so/.whl (if any) into /tmp/site and put it on PYTHONPATH.
if [ -d .snap-so/.whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .snap-so/.whl/*.whl \
    && export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site
fi
