#!/usr/bin/env bash
# One-call GPU check: environment, the test suite compiled for the accelerator (no interpret mode; kernel
# and offload tests first), bench/kernels.py, the dense decode benchmark (jnp and Pallas decode attention)
# and the offload benchmark (dense vs PulseInfer vs per-head offloading, random Llama-3.1-8B).
# Writes everything into OUT_DIR (ready to copy into bench/results/).
#   bench/gpu_suite.sh OUT_DIR            on a GPU machine (python3 with jax[cuda] 0.11.2 + flax + transformers)
#   bench/gpu_suite.sh OUT_DIR --smoke    tiny sizes on CPU, to check the script before GPU time is spent
#   bench/gpu_suite.sh OUT_DIR --tests-only   just the test suite (TEST_TIMEOUT seconds, default 150)
# Tests run in parallel processes (pytest-xdist, if present) without GPU memory preallocation: on the GPU
# the suite is dominated by XLA compile time, which parallelises over the host's cores.
# Wheels of packages the GPU image lacks (gguf) travel in .whl/ (bench/fetch_gpu_wheels.sh) and are
# installed into /tmp/site.
set -uo pipefail
OUT=${1:?usage: bench/gpu_suite.sh OUT_DIR [--smoke]}
SMOKE=${2:-}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s)
{
    date -u; nvidia-smi 2>/dev/null || echo "no nvidia-smi"
    "$PY" -c "import jax, flax, transformers; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'transformers', transformers.__version__)"
} > "$OUT/env.txt" 2>&1
tail -3 "$OUT/env.txt"

if [ "$SMOKE" = "--smoke" ]; then
    TESTS=(tests/test_attention.py tests/test_kv_cache.py tests/test_gather_scatter.py tests/test_host_offload.py)
    BENCH=(--smoke)
    OBENCH=(--smoke)
    TEST_TIMEOUT=300
else
    # most informative first: kernels-to-be, HF parity, engine; the rest after
    TESTS=(tests/test_sparse_decode_attention.py tests/test_block_scoring.py tests/test_gather_scatter.py
           tests/test_host_offload.py tests/test_offload.py tests/test_sparse_selection.py tests/test_attention.py
           tests/test_hf_parity.py tests/test_engine.py tests/test_ioaa.py tests/test_sampling.py
           tests/test_bad_input.py tests/test_kv_cache.py tests/test_gguf.py tests/test_tokenizer.py tests/test_smollm2.py)
    BENCH=(--model random:llama-3.1-8b --dtype bfloat16 --contexts 4096,32768 --batches 1,8,32
           --max-kv-tokens 300000 --steps 8 --attention jnp,pallas --engine-prompt 8192 --engine-batch 4)
    OBENCH=(--model random:llama-3.1-8b --dtype bfloat16 --context 4096 --batch 4 --steps 6 --budget-tokens 1024
            --systems dense,pulseinfer,offload-headwise,sparse-on-device,pulseinfer-sync,pulseinfer-1mb)
    TEST_TIMEOUT=${TEST_TIMEOUT:-130}
fi
XDIST=()
if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n "${TEST_WORKERS:-8}"); fi

echo "== tests on $("$PY" -c 'import jax; print(jax.default_backend())')"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout -s INT -k 15 "$TEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider \
    --durations=10 "${XDIST[@]}" "${TESTS[@]}" > "$OUT/tests.log" 2>&1
echo "tests exit $?:"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -25

[ "$SMOKE" = "--tests-only" ] && exit 0
echo "== kernel benchmark"
KBENCH=()
[ "$SMOKE" = "--smoke" ] && KBENCH=(--smoke)
timeout "${KERNEL_TIMEOUT:-110}" "$PY" bench/kernels.py "${KBENCH[@]}" --out "$OUT" > "$OUT/kernels.log" 2>&1
echo "kernels exit $?"
grep -v "^WARNING" "$OUT/kernels.log" | tail -25
echo "== dense decode benchmark"
timeout "${DENSE_TIMEOUT:-100}" "$PY" bench/dense_decode.py "${BENCH[@]}" --out "$OUT" > "$OUT/dense_decode.log" 2>&1
echo "bench exit $?"
cat "$OUT/dense_decode.log" | grep -v "^WARNING" | tail -15
echo "== offload decode benchmark"
timeout "${OFFLOAD_TIMEOUT:-150}" "$PY" bench/offload_decode.py "${OBENCH[@]}" --out "$OUT" > "$OUT/offload_decode.log" 2>&1
echo "offload bench exit $?"
grep -v "^WARNING" "$OUT/offload_decode.log" | tail -12
echo "suite took $(( $(date +%s) - t0 )) s"
