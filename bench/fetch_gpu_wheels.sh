#!/usr/bin/env bash
# Wheels the GPU machine's image lacks (it has jax 0.11.2, flax, transformers, tokenizers, safetensors, tqdm,
# jinja2, jaxtyping, pytest, pytest-xdist). They go to .whl/ (git-ignored via .git/info/exclude); pass
# carry=[".whl"] to the device run and bench/gpu_suite.sh installs them into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl gguf==0.19.0
ls -la .whl
