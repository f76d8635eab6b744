#!/usr/bin/env bash
# The evaluation's full throughput sweep, for a GPU machine after bench/gpu_suite.sh has passed (one call,
# < 10 minutes on an H200; each part under its own timeout, JSON rewritten after every point):
#   1. random Llama-3.1-8B bf16: contexts 32K / 64K / 128K x batches 1, 2, 4, 8 for dense, per-head
#      offloading, PulseInfer and PulseInfer with every request offloaded (TPOT at equal batch) under a 33 GiB
#      GPU KV budget (points whose host pool would not fit in the machine's RAM are recorded as skipped);
#   2. random Qwen3-14B with its 128K YaRN setting: 32K / 64K / 128K x 1, 2, 4, same systems;
#   3. a Mooncake-shaped mix (16 requests, prompts x 4, outputs <= 128) on Llama-3.1-8B;
#   4. only with MOE_TIMEOUT=<seconds> set (it does not fit the 10 minutes with the rest): bench/moe_ffn.py (the
#      expert strategies on the GPU, the grouped-GEMM Pallas kernel among them, <= 90 s), then random Qwen3-30B-A3B (128 experts, 8 per token;
#      61 GB of bf16 weights) at 32K / 128K x 1, 4, 16 under a 40 GiB GPU KV budget, then at 32K again with
#      moe_strategy grouped-pallas (the grouped-GEMM kernel in every expert layer).
# All with a real model's selections replayed (bench/results/traces/smollm2_*_b2048.npz).
#   bench/gpu_sweep.sh OUT_DIR [--smoke]
set -uo pipefail
OUT=${1:?usage: bench/gpu_sweep.sh OUT_DIR [--smoke]}
MODE=${2:-}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
t0=$(date +%s)
step() {  # step NAME TIMEOUT_S ARGS...: one decode_throughput run
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s, at $(( $(date +%s) - t0 ))s)"
    timeout -s INT -k 10 "$limit" "$PY" bench/decode_throughput.py "$@" --name "$name" --out "$OUT" > "$OUT/$name.log" 2>&1
    echo "$name exit $?"
    grep -v "^WARNING" "$OUT/$name.log" | tail -"${TAIL:-16}"
}
SYS=dense,pulseinfer,offload-headwise
if [ "$MODE" = "--smoke" ]; then
    step sweep_llama 300 --smoke --systems "$SYS"
    step sweep_qwen 300 --smoke --systems "$SYS"
    step sweep_mix 300 --smoke --systems "$SYS" --mix mooncake --mix-only
    echo "== moe_ffn smoke (every strategy, the Pallas one in interpret mode)"
    "$PY" bench/moe_ffn.py --model tiny-qwen3-moe --dtype float32 --tokens 1,8 --repeats 1 \
        --strategies dense,gather,grouped,grouped-pallas --out "$OUT" > "$OUT/moe_ffn.log" 2>&1
    echo "moe_ffn exit $?"; tail -3 "$OUT/moe_ffn.log"
    step sweep_moe 300 --model random:tiny-qwen3-moe --dtype float32 --contexts 600 --batches 1,3 --steps 2 \
        --warm 1 --budget-tokens 128 --dense-layers 1 --gpu-kv-budget 2MiB --systems "$SYS"
    step sweep_moe_grouped 300 --model random:tiny-qwen3-moe --dtype float32 --contexts 600 --batches 1 --steps 2 \
        --warm 1 --budget-tokens 128 --dense-layers 1 --gpu-kv-budget 2MiB --systems "$SYS" --moe-strategy grouped-pallas
else
    COMMON=(--dtype bfloat16 --budget-tokens 2048 --gpu-kv-budget 33GiB --replay smollm2 --steps 8 --warm 4
            --systems "$SYS")
    # pulseinfer-no-ioaa (every request offloaded) gives the offloaded TPOT at the batch dense runs too
    step sweep_llama "${LLAMA_TIMEOUT:-300}" --model random:llama-3.1-8b "${COMMON[@]}" \
        --contexts 32768,65536,130816 --batches 1,2,4,8 --systems "$SYS,pulseinfer-no-ioaa"
    step sweep_qwen "${QWEN_TIMEOUT:-170}" --model random:qwen3-14b-128k "${COMMON[@]}" \
        --contexts 32768,65536,130816 --batches 1,2,4
    step sweep_mix "${MIX_TIMEOUT:-110}" --model random:llama-3.1-8b "${COMMON[@]}" \
        --mix mooncake --mix-only --mix-requests 16 --mix-scale 4 --mix-max-output 128
    if [ "${MOE_TIMEOUT:-0}" -gt 0 ]; then
        echo "== moe_ffn (limit 90s): dense / gather / grouped (jnp, Pallas) expert matmuls by token count, one Qwen3-30B-A3B layer"
        timeout -s INT -k 10 90 "$PY" bench/moe_ffn.py --out "$OUT" > "$OUT/moe_ffn.log" 2>&1
        echo "moe_ffn exit $?"; tail -8 "$OUT/moe_ffn.log"
        step sweep_moe "$MOE_TIMEOUT" --model random:qwen3-30b-a3b-128k --dtype bfloat16 --budget-tokens 2048 \
            --gpu-kv-budget 40GiB --replay smollm2 --steps 8 --warm 4 --systems "$SYS" \
            --contexts 32768,130816 --batches 1,4,16
        # the same at 32K with the grouped-GEMM kernel in every expert layer (the engine probes it first)
        step sweep_moe_grouped "$MOE_TIMEOUT" --model random:qwen3-30b-a3b-128k --dtype bfloat16 --budget-tokens 2048 \
            --gpu-kv-budget 40GiB --replay smollm2 --steps 8 --warm 4 --systems "$SYS" \
            --contexts 32768 --batches 1,4,16 --moe-strategy grouped-pallas
    else
        echo "== sweep_moe skipped (set MOE_TIMEOUT=<seconds> to run Qwen3-30B-A3B)"
    fi
fi
echo "sweep took $(( $(date +%s) - t0 )) s"
