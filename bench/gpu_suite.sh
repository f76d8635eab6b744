#!/usr/bin/env bash
# One-call GPU suite (< 8 minutes on an H200): environment (and the GPU's own XLA target config, for the compile-only
# check: OUT/h200_target_config.txtpb), the kernel and offload tests compiled for the GPU
# (no interpret mode), bench/kernels.py, bench/merge_stress.py (the split merge's atomics under racing programs),
# bench/io_sweep.py, bench/decode_throughput.py at the points of
# bench/points.py, exactly as bench/predict.py predicts them (random Llama-3.1-8B, bf16, synthetic KV with a real
# model's selections replayed; A: 8 x 32K, every system; B: 4 x 128K; C: 24 x 32K and D: 12 x 128K in float8 KV,
# where dense holds 3; each row lists its step's compiled programs with fingerprints), the dense decode bench (scan
# vs layer-wise layer loop, jnp vs Pallas attention) and a short serving point (bench/serving.py: the OpenAI-compatible server at 1 and 8 clients) if time is left. On a GPU the engine probes its Pallas kernels (and, where it uses them,
# its pinned-host transfers) first and falls back (jnp attention, host_io numpy) with a warning in the logs. Point C
# also runs pulseinfer-numpy-io (the recall through PJRT's bounce buffer), last: where pinned staging should matter most. Two extra PulseInfer decode steps of
# point A are profiled (jax.profiler: OUT/profile/.../perfetto_trace.json.gz, for ui.perfetto.dev). Every
# step has its own timeout and every bench rewrites its JSON after each measurement, so a timeout keeps what
# ran. Everything goes to OUT_DIR (ready to copy into bench/results/).
#   bench/gpu_suite.sh OUT_DIR              on a GPU machine (python3 with jax[cuda] 0.11.2 + flax + transformers)
#   bench/gpu_suite.sh OUT_DIR --smoke      tiny sizes on CPU, the whole script end to end (~6 min on 2 cores)
#   bench/gpu_suite.sh OUT_DIR --tests-only just the tests (TEST_TIMEOUT seconds)
#   bench/gpu_suite.sh OUT_DIR --print-args the decode_throughput.py runs on a GPU (name, then each argument;
#                                           tab-separated), nothing run: tests/test_bench_points.py compares them
#                                           with bench/predict.py's
# Tests run in parallel processes (pytest-xdist, if present) without GPU memory preallocation: on the GPU the
# suite's tests are dominated by XLA compile time, which parallelises over the host's cores.
# Wheels the GPU image lacks (gguf) travel in .whl/ (bench/fetch_gpu_wheels.sh) and go to /tmp/site.
set -uo pipefail
OUT=${1:?usage: bench/gpu_suite.sh OUT_DIR [--smoke|--tests-only|--print-args]}
MODE=${2:-}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ "$MODE" != "--print-args" ] && compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s)
# the whole suite stays under 8 minutes of GPU time: each step's limit is cut to what is left
SUITE_BUDGET=${SUITE_BUDGET:-$([ "$MODE" = "--smoke" ] && echo 1800 || echo 465)}

step() {  # step NAME TIMEOUT_S COMMAND...: run with a timeout (cut to what is left of SUITE_BUDGET), log to
    # $OUT/NAME.log, print its tail; skipped when under 15 s are left
    local name=$1 limit=$2
    shift 2
    local left=$(( SUITE_BUDGET - ($(date +%s) - t0) ))
    if [ "$left" -lt 15 ]; then echo "== $name skipped: ${left}s of the suite's ${SUITE_BUDGET}s left"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit}s, at $(( $(date +%s) - t0 ))s)"
    timeout -s INT -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$name exit $?"
    grep -v "^WARNING" "$OUT/$name.log" | tail -"${TAIL:-14}"
}

KERNEL_TESTS=(tests/test_sparse_decode_attention.py tests/test_block_scoring.py tests/test_gather_scatter.py
              tests/test_grouped_matmul.py tests/test_host_offload.py tests/test_offload.py tests/test_attention.py)
if [ "$MODE" = "--smoke" ]; then
    TESTS=(tests/test_gather_scatter.py tests/test_host_offload.py)
    TEST_TIMEOUT=300
    SMOKE=(--smoke)
    TRACE="$OUT/traces/smoke"
    # layer-wise engines as on the GPU (the model unstacked, layer-wise prefill; dense-scan re-stacks a copy)
    DT_A=(--smoke --layer-loop layerwise --replay "$TRACE" --name decode_throughput_a --profile-system pulseinfer
          --profile-dir "$OUT/profile" --systems dense,pulseinfer,offload-headwise,dense-scan,pulseinfer-no-ioaa,pulseinfer-xla-io)
    DT_B=(--smoke --contexts 3000 --batches 2 --systems dense,pulseinfer,offload-headwise --name decode_throughput_b)
    DT_C=(--smoke --batches 4 --systems dense,pulseinfer,offload-headwise,pulseinfer-numpy-io --name decode_throughput_c)
    DT_D=(--smoke --contexts 3000 --batches 3 --kv-dtype float8_e4m3fn --systems dense,pulseinfer,offload-headwise
          --name decode_throughput_d)
    DENSE=(--smoke --layer-loop layerwise,scan)
    # CPU runs the smoke's 3K-token point B several times slower than the GPU's limits assume
    LONG_TIMEOUT=${LONG_TIMEOUT:-150}
    SERVE=(--concurrency 1,2 --input-len 64 --output-len 4 --num-requests 2 --name serving_smoke)
else
    TESTS=("${KERNEL_TESTS[@]}")
    TEST_TIMEOUT=${TEST_TIMEOUT:-110}
    SMOKE=()
    # the points of bench/points.py (model, requests, budgets, KV dtype, replayed trace, steps, systems): what
    # bench/predict.py predicts; nothing here may change them (tests/test_bench_points.py)
    DT_A=(--point A --profile-system pulseinfer --profile-dir "$OUT/profile")
    DT_B=(--point B)
    DT_C=(--point C)
    DT_D=(--point D)
    DENSE=(--model random:llama-3.1-8b --dtype bfloat16 --contexts 4096,32768 --batches 1,8
           --max-kv-tokens 300000 --steps 8 --attention pallas,jnp --layer-loop layerwise,scan
           --engine-prompt 8192 --engine-batch 4)
    # the OpenAI-compatible server under load: random Llama-3.1-8B, 2K-token prompts, 32 new tokens, 1 and 8 clients
    SERVE=(--model random:llama-3.1-8b --dtype bfloat16 --concurrency 1,8 --input-len 2048 --output-len 32
           --num-requests 16 --name gpu --gpu-kv-budget 17179869184)
fi
# the decode-throughput runs: name, time limit (s), the array of their arguments
DT_RUNS=("decode_throughput_a ${THROUGHPUT_TIMEOUT:-140} DT_A" "decode_throughput_b ${LONG_TIMEOUT:-55} DT_B"
         "decode_throughput_c ${POINT_C_TIMEOUT:-60} DT_C" "decode_throughput_d ${POINT_D_TIMEOUT:-50} DT_D")
run_dt() {  # run_dt NAME TIMEOUT ARRAY
    local name=$1 limit=$2
    local -n argv=$3
    if [ "$MODE" = "--print-args" ]; then
        printf '%s' "$name"; printf '\t%s' "${argv[@]}" --out "$OUT"; printf '\n'
        return
    fi
    step "$name" "$limit" "$PY" bench/decode_throughput.py "${argv[@]}" --out "$OUT"
}
if [ "$MODE" = "--print-args" ]; then
    for run in "${DT_RUNS[@]}"; do run_dt $run; done
    exit 0
fi
{
    date -u; nvidia-smi 2>/dev/null || echo "no nvidia-smi"; free -g 2>/dev/null
    "$PY" -c "import jax, flax, transformers; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'transformers', transformers.__version__)"
    # the GPU's own target description, for the compile-only check (replaces bench/aot/targets/h200.txtpb)
    "$PY" -c "from bench.aot.target import device_target_config as c; open('$OUT/h200_target_config.txtpb', 'w').write(c())" \
        && echo "saved $OUT/h200_target_config.txtpb" || echo "no GPU target config saved (not a GPU?)"
} > "$OUT/env.txt" 2>&1
tail -4 "$OUT/env.txt"
XDIST=()
if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n "${TEST_WORKERS:-8}"); fi

echo "== tests on $("$PY" -c 'import jax; print(jax.default_backend())')"
# (the Qwen3-MoE offload cases are plain jnp, platform-independent: left to CPU CI to keep the 110 s limit)
XLA_PYTHON_CLIENT_PREALLOCATE=false TAIL=25 step tests "$TEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider \
    --durations=10 "${XDIST[@]}" -k "not moe4" "${TESTS[@]}"
[ "$MODE" = "--tests-only" ] && exit 0

step kernels "${KERNEL_TIMEOUT:-80}" "$PY" bench/kernels.py "${SMOKE[@]}" --out "$OUT"
# the attention's split merge inside its kernel, many programs racing on the arrival counters, 200 calls a case:
# memory ordering, which interpret mode cannot judge (exit 1 on any disagreement or a counter left set)
MERGE=(--splits 4,16,32)
[ "$MODE" = "--smoke" ] && MERGE=(--smoke)
step merge_stress "${MERGE_TIMEOUT:-60}" "$PY" bench/merge_stress.py "${MERGE[@]}" --out "$OUT"
IO=(--max-copies 2048 --repeats 3)
[ "$MODE" = "--smoke" ] && IO=(--smoke)
step io_sweep "${IO_TIMEOUT:-40}" "$PY" bench/io_sweep.py "${IO[@]}" --out "$OUT"
if [ "$MODE" = "--smoke" ]; then  # the smoke replays a trace recorded here (same budget and shapes)
    step selection_trace 300 "$PY" bench/selection_trace.py --smoke --no-synthetic --trace-dir "$OUT/traces" --out "$OUT"
fi
for run in "${DT_RUNS[@]}"; do run_dt $run; done
step dense_decode "${DENSE_TIMEOUT:-30}" "$PY" bench/dense_decode.py "${DENSE[@]}" --out "$OUT"
step serving "${SERVING_TIMEOUT:-40}" "$PY" bench/serving.py --launch "${SERVE[@]}" --out "$OUT"
"$PY" bench/tables.py "$OUT"/*.json --out "$OUT/tables.md" || true  # markdown tables for bench/RESULTS.md
echo "suite took $(( $(date +%s) - t0 )) s"
