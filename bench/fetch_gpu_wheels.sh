#!/usr/bin/env bash
# Wheels the GPU machine's image lacks (it has jax 0.11.2, flax, transformers, tokenizers, safetensors, tqdm,
# jinja2, jaxtyping, pytest, pytest-xdist, anyio, h11, httpx, click, prometheus-client): gguf, and the server's
# FastAPI / uvicorn / pydantic stack (bench/serving.py's point). They go to .whl/ (git-ignored via
# .git/info/exclude); pass carry=[".whl"] to the device run and bench/gpu_suite.sh installs them into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
PY=${PYTHON:-python3}
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl gguf==0.19.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 typing-extensions==4.16.0 uvicorn==0.55.0 \
    opentelemetry-api==1.44.0 importlib-metadata==8.7.1
ls -la .whl
