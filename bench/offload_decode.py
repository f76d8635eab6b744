"""Decode with the KV dense, offloaded (PulseInfer) and offloaded the per-head way, side by side.

    python bench/offload_decode.py                                    # CPU: SmolLM2, 2 x ~4K-token haystacks
    python bench/offload_decode.py --model random:llama-3.1-8b --dtype bfloat16 --context 8192 --batch 4 --out DIR
    python bench/offload_decode.py --smoke                            # tiny random model (script check)
    python bench/offload_decode.py --dtype bfloat16 --kv-dtype float8_e4m3fn --name offload_decode_cpu_bf16_kv_fp8

Each system runs in its own engine on the same prompts, twice (the first run compiles every shape, the second
is measured): the prompts are prefilled (timed apart), two decode steps run untimed, then `--steps` decode
steps are timed one by one (each ends with the sampled tokens on the host, so its wall time is honest). Per
system: step time (median, p90), decode tokens/s, host-to-device bytes and copies per step, recall wait per
step, slot-cache hit rate, GPU KV bytes in use, and how many generated tokens agree with dense. Prompts: the
passkey haystack (real text) for models with a tokenizer, random token ids otherwise (labelled). On CPU "host"
and "device" are the same RAM: the I/O numbers count what would cross PCIe; the times say nothing about PCIe.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.common import sparse_io_stats, write_result  # noqa: E402

SYSTEMS = {
    "dense": dict(mode="dense"),
    "pulseinfer": dict(mode="offload"),  # SoloHead + coalesced + recall one step ahead
    "pulseinfer-same-layer": dict(mode="offload", recall="interruptible"),  # (+ 2 micro-batches on GPU)
    "offload-headwise": dict(mode="offload", selection="headwise", io="fragmented", recall="sync", micro_batches=1),
    "sparse-on-device": dict(mode="offload", offload_placement="device"),  # same selection, no I/O
    "pulseinfer-sync": dict(mode="offload", recall="sync"),
    "pulseinfer-fragmented": dict(mode="offload", io="fragmented"),
    "pulseinfer-headwise": dict(mode="offload", selection="headwise"),
    "pulseinfer-1mb": dict(mode="offload", micro_batches=1),
    "pulseinfer-2mb": dict(mode="offload", recall="interruptible", micro_batches=2),
    "pulseinfer-cache1x": dict(mode="offload"),  # slot cache = one step's selection (set in _run_once)
    # the pool in numpy, recalls gathered on the recall thread (a GPU engine's default with recall ahead)
    "pulseinfer-numpy-io": dict(mode="offload", host_io="numpy"),
}
DEFAULT_SYSTEMS = ("dense,pulseinfer,pulseinfer-same-layer,offload-headwise,sparse-on-device,pulseinfer-sync,"
                   "pulseinfer-fragmented,pulseinfer-cache1x")


def make_prompts(model, context: int, batch: int) -> tuple[list, str]:
    if model.tokenizer is not None:
        from pulseinfer_jax.demo import passkey_prompt

        texts = [passkey_prompt(model.tokenizer, context, (i + 1) / (batch + 1), 10000 + 7919 * i)
                 for i in range(batch)]
        return [model.tokenizer.encode(t, add_special_tokens=True) for t in texts], "passkey haystack (real text)"
    rng = np.random.default_rng(0)
    return [rng.integers(0, model.cfg.vocab_size, context).tolist() for _ in range(batch)], "random token ids"


def run_system(model, name: str, prompts: list, steps: int, base: dict) -> dict:
    """Two identical runs in fresh engines; the first compiles every shape the workload meets (the jit caches
    are shared), the second is measured."""
    _run_once(model, name, prompts, steps, base)
    return _run_once(model, name, prompts, steps, base)


def _run_once(model, name: str, prompts: list, steps: int, base: dict) -> dict:
    from pulseinfer_jax import Engine, EngineConfig, SamplingParams
    from pulseinfer_jax.request import Status

    cfg = EngineConfig.of(**base, **SYSTEMS[name])
    if name == "pulseinfer-cache1x":  # the smallest slot cache: only what one step selects (LRU across steps)
        cfg = cfg.with_settings(slot_cache_blocks=cfg.budget_blocks - cfg.offload.sink_blocks - cfg.window_blocks)
    eng = Engine(model, cfg)
    warm = 2
    # a request decodes while later ones prefill (one chunk per step): budget those steps too, so every
    # request is still running during the timed steps
    prefill_steps = sum(-(-len(p) // cfg.prefill_chunk) for p in prompts)
    sp = SamplingParams(max_new_tokens=prefill_steps + warm + steps + 2, ignore_eos=True)
    reqs = [eng.make_request(i, p, sp) for i, p in enumerate(prompts)]
    eng.ensure_pool(reqs)
    for r in reqs:
        eng.scheduler.add(r)
    t0 = time.perf_counter()
    while any(r.status is not Status.RUNNING for r in reqs):
        list(eng.step())
    prefill_s = time.perf_counter() - t0
    for _ in range(warm):
        list(eng.step())
    log0 = len(eng.sparse.step_log) if eng.sparse is not None else 0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        events = list(eng.step())
        times.append(time.perf_counter() - t)
        if len(events) != len(reqs) or any(e.finish_reason for e in events):
            raise RuntimeError(f"{name}: a timed step decoded {len(events)} of {len(reqs)} requests")
    io = sparse_io_stats(eng, log0, reqs)
    outputs = [list(r.output) for r in reqs]
    for r in reqs:
        if r.status is not Status.FINISHED:
            eng.stop_request(r, "length")
    del eng
    med = statistics.median(times)
    return {
        "system": name, "config": SYSTEMS[name], "batch": len(prompts), "steps": steps,
        "step_s_median": med, "step_s_p90": float(np.percentile(times, 90)), "step_s_all": times,
        "decode_tokens_per_s": len(prompts) / med, "prefill_s": prefill_s,
        "h2d_bytes_per_step": io["h2d_bytes_per_step"], "h2d_copies_per_step": io["h2d_copies_per_step"],
        "recall_wait_s_per_step": io["recall_wait_s_per_step"], "slot_hit_rate": io["slot_hit_rate"],
        "gpu_kv_bytes": io["gpu_kv_bytes_in_use"], "outputs": outputs,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=4000, help="prompt tokens per request")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps")
    ap.add_argument("--budget-tokens", type=int, default=1024)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dense-layers", type=int, default=2)
    ap.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma list of {', '.join(SYSTEMS)}")
    ap.add_argument("--kv-dtype", default="auto", help="EngineConfig.kv_dtype: auto (the model's) or float8_e4m3fn")
    ap.add_argument("--name", default=None, help="result file name (default offload_decode_<platform>)")
    ap.add_argument("--smoke", action="store_true", help="tiny random model and sizes (CPU check of the script)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.model, args.dtype, args.context, args.batch, args.steps = "random:tiny-llama", "float32", 300, 2, 3
        args.budget_tokens, args.dense_layers = 128, 1
    unknown = [s for s in args.systems.split(",") if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")

    from pulseinfer_jax.models.loading import load_model

    model = load_model(args.model, dtype=args.dtype)
    prompts, prompt_kind = make_prompts(model, args.context, args.batch)
    base = dict(block_size=args.block_size, budget_tokens=args.budget_tokens, max_batch=max(args.batch, 1),
                dense_layers=args.dense_layers, kv_dtype=args.kv_dtype)
    import jax

    out_name = "offload_decode_smoke" if args.smoke else args.name or f"offload_decode_{jax.devices()[0].platform}"
    meta = {"model": args.model or "SmolLM2-135M-Instruct (GGUF)", "dtype": args.dtype, "context": args.context,
            "prompt_kind": prompt_kind, "prompt_tokens": [len(p) for p in prompts], "engine": base}
    rows = []
    for name in args.systems.split(","):
        try:
            r = run_system(model, name, prompts, args.steps, base)
        except Exception as e:  # noqa: BLE001 - record it and go on: GPU time is scarce, later systems matter
            err = f"{type(e).__name__}: {str(e)[:2000]}"
            print(f"{name:22s} FAILED: {err[:300]}", flush=True)
            rows.append({"system": name, "config": SYSTEMS[name], "error": err})
            write_result(out_name, {**meta, "systems": rows, "complete": False}, args.out)
            continue
        rows.append(r)
        write_result(out_name, {**meta, "systems": rows, "complete": False}, args.out)  # survives a timeout
        print(f"{name:22s} step {r['step_s_median'] * 1e3:8.1f} ms (p90 {r['step_s_p90'] * 1e3:7.1f}), "
              f"{r['decode_tokens_per_s']:7.1f} tok/s, H2D {r['h2d_bytes_per_step'] / 1e6:7.2f} MB in "
              f"{r['h2d_copies_per_step']:6.1f} copies/step, wait {r['recall_wait_s_per_step'] * 1e3:6.2f} ms/step, "
              f"hit {r['slot_hit_rate'] if r['slot_hit_rate'] is None else round(r['slot_hit_rate'], 3)}, "
              f"GPU KV {r['gpu_kv_bytes'] / 1e6:.1f} MB", flush=True)
    dense = next((r for r in rows if r["system"] == "dense" and "error" not in r), None)
    for r in rows:
        if dense is not None and "error" not in r:
            same = [sum(a == b for a, b in zip(x, y, strict=True)) / len(x)
                    for x, y in zip(r["outputs"], dense["outputs"], strict=True)]
            r["token_agreement_with_dense"] = statistics.mean(same)
    path = write_result(out_name, {**meta, "systems": rows, "complete": True}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
