"""Decode throughput and latency: dense serving vs per-head offloading vs PulseInfer (+ one ablation per technique).

    python bench/decode_throughput.py --smoke                              # tiny random model on CPU (script check)
    python bench/decode_throughput.py --point A --out DIR                  # a GPU-suite point (bench/points.py)
    python bench/decode_throughput.py --model random:llama-3.1-8b --dtype bfloat16 \
        --contexts 32768,65536,131072 --batches 1,2,4,8 --gpu-kv-budget 24GiB --replay smollm2 --out DIR
    python bench/decode_throughput.py --model random:qwen3-14b --dtype bfloat16 --mix mooncake --mix-requests 12 ...

Every system is this engine with one configuration (SYSTEMS below), on the same model and the same requests, in
the same run. Long prompts are NOT prefilled: their KV is synthetic (random values written straight into the
prefill blocks, `bench/synthetic.py`; labelled "synthetic KV" in the JSON), because prefilling 128K-token
prompts of an 8B model would take the GPU window many times over and decode cost does not depend on the
values. Selection over random keys is arbitrary, so `--replay NAME` makes sparse requests attend and recall the
blocks a real model selected (`bench/traces.py`, traces recorded by `bench/selection_trace.py` at the same
budget); without it the miss pattern is that of random KV (say so).

Memory: `--gpu-kv-budget` caps the GPU KV (pool + offload metadata), emulating a smaller GPU;
the host pool holds every offloaded request's KV (checked against the machine's free RAM before a point runs:
a point that would not fit is recorded as skipped, not run). Dense serving admits as many requests as its
budget holds and queues the rest: "batch reached" is what actually decoded together.

Fixed-batch points (`--contexts` x `--batches`): all requests are admitted and prefilled (synthetic), `--warm`
decode steps run untimed (they compile), then `--steps` steps are timed one by one (each ends with the tokens on
the host). Reported: decode tokens/s, step time = TPOT p50/p99, batch reached and placements, GPU KV bytes (pool
in use, offload metadata) and host KV bytes, host-to-device bytes and copies per step, the PCIe rate they imply
(bytes per step / step time), recall wait per step, slot-cache hit rate, XLA compiles during the timed steps.
Mix (`--mix mooncake`): request prompt and output lengths drawn from the Mooncake trace's empirical
distribution (bench/workload.py), run to completion; per-request TPOT p50/p99 and decode tokens/s.

`--point NAME` takes the model, requests, budgets, KV dtype, replayed trace, timed window and systems from
bench/points.py (what bench/predict.py predicts; the options it sets cannot be given beside it). Every fixed-batch
row also lists the compiled programs of its decode step with their fingerprints (bench/fingerprint.py: the programs
run in `FINGERPRINT_STEPS` more steps after the timed ones), to be matched with the predicted row's.
"""

from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench import points  # noqa: E402
from bench.common import RESULTS, sparse_io_stats, write_result  # noqa: E402

SYSTEMS = {
    "dense": dict(mode="dense"),  # layers run as the engine's layer_loop="auto" says (layer-wise on a GPU)
    "dense-scan": dict(mode="dense", layer_loop="scan"),  # the same, one jitted scan over stacked weights (a copy)
    # the existing-offloading baseline: per-head selection, one copy per (block, head), wait for every recall
    "offload-headwise": dict(mode="offload", selection="headwise", io="fragmented", recall="sync", micro_batches=1),
    # SoloHead + coalesced gather-scatter + recall one step ahead (one call per layer, one micro-batch) + IOAA
    "pulseinfer": dict(mode="auto"),
    # the same-layer recall: the driver reads each layer's plan, recalls, attends the resident blocks meanwhile
    # (two micro-batches on a GPU)
    "pulseinfer-same-layer": dict(mode="auto", recall="interruptible"),
    # one technique off at a time
    "pulseinfer-no-solohead": dict(mode="auto", selection="headwise"),
    "pulseinfer-no-coalescing": dict(mode="auto", io="fragmented"),
    "pulseinfer-no-interrupt": dict(mode="auto", recall="sync", micro_batches=1),
    "pulseinfer-no-ioaa": dict(mode="offload"),  # every request offloaded
    "pulseinfer-min-reuse": dict(mode="auto"),  # slot cache = one step's selection (set in run_point)
    # the same-layer recall without a second micro-batch: each micro-batch costs the host a layer loop of dispatches
    # (bench/host_overhead.py) and the GPU a weight pass
    "pulseinfer-1mb": dict(mode="auto", recall="interruptible", micro_batches=1),
    # the early attention queued before the driver reads each layer's plan (hides the read and the recall's issue)
    "pulseinfer-eager": dict(mode="auto", recall="eager"),
    # the host pool's backend fixed (on a GPU, "auto" with recall ahead is numpy-pinned: pageable RAM, gathered on the
    # recall thread into pinned staging): the same gather through PJRT's bounce buffer, and the pinned pool's XLA host
    # gather, which waits for the GPU's queued work and holds its later programs
    "pulseinfer-numpy-io": dict(mode="auto", host_io="numpy"),
    "pulseinfer-xla-io": dict(mode="auto", host_io="xla"),
    "sparse-on-device": dict(mode="offload", offload_placement="device"),  # same selection, no PCIe
}
DEFAULT_SYSTEMS = "dense,offload-headwise,pulseinfer,pulseinfer-same-layer,pulseinfer-no-solohead," \
                  "pulseinfer-no-coalescing,pulseinfer-no-interrupt,pulseinfer-no-ioaa,pulseinfer-min-reuse"


def parse_bytes(text: str) -> int:
    units = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    num = t.rstrip("abgikm")
    unit = t[len(num):]
    if unit not in units or not num:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 24GiB, 512MiB or 1000000")
    return int(float(num) * units[unit])


def free_host_bytes() -> int | None:
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class CompileCounter:
    """Counts XLA backend compiles (jax.monitoring events) so timed windows can say whether they compiled."""

    def __init__(self):
        import jax.monitoring

        self.count = 0

        def listener(event: str, duration: float, **_) -> None:
            if "backend_compile" in event:
                self.count += 1

        jax.monitoring.register_event_duration_secs_listener(listener)


def engine_for(model, system: str, base: dict, replay: dict | None, cache: dict, overrides: dict | None = None):
    """A synthetic-KV engine for `system` (replaying the trace of its selection mode when given). It takes the
    pinned host pool the previous engine left in `cache` (the engine keeps it if the shape matches, else frees
    it and allocates its own): pinning tens of GiB per system would cost more than the decode steps measured.
    `overrides` (EngineConfig fields) win over the system's own settings."""
    from bench.synthetic import SyntheticKVEngine
    from bench.traces import ReplaySelector

    cfg = system_config(base, system, overrides)
    selector = ReplaySelector(replay[cfg.ablation.selection]) if replay is not None and cfg.mode != "dense" else None
    eng = SyntheticKVEngine(model, cfg, selector=selector)
    eng.host_pool = cache.pop("host_pool", None)
    return eng, cfg


def system_config(base: dict, system: str, overrides: dict | None = None):
    """The EngineConfig of `system` over the bench's `base` settings (`engine_base`); `overrides` win."""
    from pulseinfer_jax import EngineConfig

    cfg = EngineConfig.of(**{**base, **SYSTEMS[system], **(overrides or {})})  # over base: a system's own settings
    if system == "pulseinfer-min-reuse":
        cfg = cfg.with_settings(slot_cache_blocks=cfg.budget_blocks - cfg.offload.sink_blocks - cfg.window_blocks)
    return cfg


def _release(eng, cache: dict) -> None:
    """Keep the engine's host pool for the next engine; free everything else now."""
    if eng.host_pool is not None:
        cache["host_pool"] = eng.host_pool
    eng.kv = eng.sparse = eng.host_pool = None
    gc.collect()


def _host_pool_skip(eng, cache: dict, need: int) -> dict | None:
    """A "skipped" row (and the engine released) if a host pool of `need` bytes would not fit in 80% of the
    free RAM, else None. The pool the engine took from the cache is reused or freed before a new one is
    pinned, so it counts as free."""
    free = free_host_bytes()
    if free is None:
        return None
    if eng.host_pool is not None:
        free += eng.host_pool.total_bytes
    if need <= 0.8 * free:
        return None
    _release(eng, cache)
    return {"skipped": f"host KV pool {need / 2**30:.1f} GiB > 80% of free RAM ({free / 2**30:.1f} GiB)"}


def host_bytes_needed(model, cfg, total_tokens: list[int]) -> int:
    if cfg.mode == "dense":
        return 0
    c = model.cfg
    import jax.numpy as jnp

    sparse_layers = c.num_layers - cfg.offload.dense_layers
    per_token = sparse_layers * 2 * c.num_kv_heads * c.head_dim * jnp.dtype(model.dtype).itemsize
    return sum(-(-t // cfg.block_size) * cfg.block_size for t in total_tokens) * per_token


def run_point(model, system: str, prompt_len: int, batch: int, steps: int, warm: int, base: dict,
              replay: dict | None, compiles: CompileCounter, cache: dict | None = None,
              profile_dir: str | None = None) -> dict:
    """One (system, context, batch) point; see the module docstring. With `profile_dir`, two more decode steps
    run after the timed ones under `jax.profiler.trace` (a Perfetto trace there; the timed steps are not
    profiled); then `points.FINGERPRINT_STEPS` more, whose programs the row lists with their fingerprints."""
    from bench.fingerprint import ExecutedPrograms
    from pulseinfer_jax import SamplingParams
    from pulseinfer_jax.request import Status

    cache = {} if cache is None else cache
    eng, cfg = engine_for(model, system, base, replay, cache)
    new = points.max_new_tokens(warm, steps, batch)
    skip = _host_pool_skip(eng, cache, host_bytes_needed(model, cfg, [prompt_len + new] * batch))
    if skip is not None:
        return skip
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    rng = np.random.default_rng(batch)
    reqs = [eng.make_request(i, rng.integers(1, model.cfg.vocab_size, prompt_len).tolist(), sp)
            for i in range(batch)]
    eng.ensure_pool(reqs)
    for r in reqs:
        eng.scheduler.add(r)
    sched = eng.scheduler
    t0 = time.perf_counter()
    idle = 0  # steps in a row that admitted nothing and had nothing to prefill
    while (sched.waiting or sched.prefilling) and idle < 2:
        waiting = len(sched.waiting)
        list(eng.step())
        idle = 0 if sched.prefilling or len(sched.waiting) < waiting else idle + 1
    # what is still waiting does not fit next to the running requests (e.g. dense out of memory)
    fill_s = time.perf_counter() - t0
    for _ in range(warm):
        list(eng.step())
    running = list(eng.scheduler.running)
    log0 = len(eng.sparse.step_log) if eng.sparse is not None else 0
    c0 = compiles.count
    times, tokens, batch_seen = [], 0, []
    for _ in range(steps):
        t = time.perf_counter()
        events = list(eng.step())
        times.append(time.perf_counter() - t)
        tokens += len(events)
        batch_seen.append(len(events))
    compiled = compiles.count - c0
    io = sparse_io_stats(eng, log0, running)
    if profile_dir is not None:
        import jax

        with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
            for _ in range(points.PROFILE_STEPS):
                list(eng.step())
    programs = {"programs_error": ExecutedPrograms.unavailable()}
    if programs["programs_error"] is None:  # the compiled programs of the step (untimed: recording slows dispatch)
        c1 = compiles.count
        with ExecutedPrograms() as executed:
            for _ in range(points.FINGERPRINT_STEPS):
                list(eng.step())
        programs = {"programs": executed.programs(points.FINGERPRINT_STEPS),
                    "programs_compiled": compiles.count - c1}
    meta_bytes = eng.sparse.metadata_bytes if eng.sparse is not None else 0
    p50 = float(np.percentile(times, 50))
    row = {
        "system": system, "config": SYSTEMS[system], "context": prompt_len, "batch_requested": batch,
        "batch_reached": statistics.mean(batch_seen), "placements": {
            p: sum(r.placement == p for r in running) for p in ("dense", "offload")},
        "steps": steps, "step_s_all": times, "tpot_s_p50": p50, "tpot_s_p99": float(np.percentile(times, 99)),
        "decode_tokens_per_s": tokens / sum(times), "fill_s": fill_s, **io,
        "gpu_kv_bytes_allocated": eng.spec.total_bytes + meta_bytes,
        "host_kv_bytes": eng.host_pool.total_bytes if eng.host_pool is not None else 0,
        "host_io": eng.host_io, "layer_loop": eng.layer_loop, "decode_attention": eng.decode_attention,
        "moe_strategy": eng.moe_strategy,
        "h2d_gb_per_s_implied": io["h2d_bytes_per_step"] / p50 / 1e9,
        "compiles_in_timed_steps": compiled,
        "preemptions": eng.scheduler.preemptions,  # (dense KV grows: the youngest waits in host memory when out)
        **programs,
    }
    for r in reqs:
        if r.status is not Status.FINISHED:
            eng.stop_request(r, "length")
    _release(eng, cache)
    return row


def run_mix(model, system: str, lengths: list[tuple[int, int]], base: dict, replay: dict | None,
            cache: dict, compiles: CompileCounter) -> dict:
    """Run a trace-shaped set of requests to completion (after a 4-token run of the same prompts that compiles
    most shapes); per-request TPOT and tokens/s over the run's wall time (synthetic prefills included: they are
    cheap, so this is close to decode throughput), and the XLA compiles that still happened inside it."""

    warm = run_mix_once(model, system, [(p, min(o, 4)) for p, o in lengths], base, replay, cache)
    if "skipped" in warm:
        return warm
    c0 = compiles.count
    row = run_mix_once(model, system, lengths, base, replay, cache)
    return {**row, "compiles_in_run": compiles.count - c0}


def run_mix_once(model, system: str, lengths: list[tuple[int, int]], base: dict, replay: dict | None,
                 cache: dict) -> dict:
    from pulseinfer_jax import SamplingParams

    eng, cfg = engine_for(model, system, base, replay, cache)
    skip = _host_pool_skip(eng, cache, host_bytes_needed(model, cfg, [p + o for p, o in lengths]))
    if skip is not None:
        return skip
    rng = np.random.default_rng(0)
    reqs = [eng.make_request(i, rng.integers(1, model.cfg.vocab_size, p).tolist(),
                             SamplingParams(max_new_tokens=o, ignore_eos=True)) for i, (p, o) in enumerate(lengths)]
    t0 = time.perf_counter()
    n_tokens = sum(1 for _ in eng.run(reqs))
    wall = time.perf_counter() - t0
    tpot = [(r.t_done - r.t_first) / (len(r.output) - 1) for r in reqs if len(r.output) > 1]
    row = {"system": system, "config": SYSTEMS[system], "requests": len(reqs), "tokens": n_tokens, "wall_s": wall,
           "tokens_per_s": n_tokens / wall, "tpot_s_p50": float(np.percentile(tpot, 50)),
           "tpot_s_p99": float(np.percentile(tpot, 99)),
           "placements": {p: sum(r.placement == p for r in reqs) for p in ("dense", "offload")},
           "engine_steps": eng.steps, "preemptions": eng.scheduler.preemptions}
    _release(eng, cache)
    return row


def load_replay(name: str | None, budget: int) -> dict | None:
    """Traces (one per selection mode) named NAME_{solohead,headwise}_b{budget}.npz under bench/results/traces
    (or a directory/prefix path)."""
    if name is None:
        return None
    from bench.traces import load_trace

    prefix = pathlib.Path(name) if ("/" in name) else RESULTS / "traces" / name
    out = {}
    for sel in ("solohead", "headwise"):
        path = pathlib.Path(f"{prefix}_{sel}_b{budget}.npz")
        if not path.is_file():
            have = sorted(p.name for p in path.parent.glob("*.npz")) if path.parent.is_dir() else []
            raise SystemExit(f"no trace {path} (record it with bench/selection_trace.py --budgets {budget}); "
                             f"found: {have}")
        out[sel] = load_trace(path)
    return out


def describe(row: dict) -> str:
    """One console line per measured point."""
    if "tpot_s_p50" not in row:
        return str(row.get("skipped") or row.get("error"))
    hit = row["slot_hit_rate"]
    return (f"reached {row['batch_reached']:5.1f} {row['placements']}: {row['decode_tokens_per_s']:8.1f} tok/s, "
            f"TPOT p50 {row['tpot_s_p50'] * 1e3:7.1f} ms p99 {row['tpot_s_p99'] * 1e3:7.1f} ms, "
            f"H2D {row['h2d_bytes_per_step'] / 1e6:7.1f} MB/step in {row['h2d_copies_per_step']:6.0f} copies "
            f"({row['h2d_gb_per_s_implied']:5.1f} GB/s), wait {row['recall_wait_s_per_step'] * 1e3:5.2f} ms, "
            f"hit {'-' if hit is None else round(hit, 3)}, GPU KV {row['gpu_kv_bytes_in_use'] / 2**30:.2f} GiB, "
            f"compiles {row['compiles_in_timed_steps']}")


# the options a --point sets (bench/points.py), and their defaults without one
POINT_OPTIONS = {"model": "random:llama-3.1-8b", "dtype": "bfloat16", "contexts": "32768", "batches": "1,4",
                 "steps": 16, "warm": 6, "budget_tokens": 2048, "gpu_kv_budget": None, "kv_dtype": "auto",
                 "replay": None}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", default=None, choices=sorted(points.POINTS),
                    help="a GPU-suite point (bench/points.py): sets the options marked [point]")
    ap.add_argument("--model", default=None, help="[point] default random:llama-3.1-8b")
    ap.add_argument("--dtype", default=None, help="[point] default bfloat16")
    ap.add_argument("--contexts", default=None, help="[point] prompt tokens per request (comma list; prompt + "
                    "generated tokens must stay below the model's max positions, e.g. 130816 for a 128K point on "
                    "Llama-3.1; default 32768)")
    ap.add_argument("--batches", default=None, help="[point] requests per point (comma list; default 1,4)")
    ap.add_argument("--steps", type=int, default=None, help="[point] timed decode steps per point (default 16)")
    ap.add_argument("--warm", type=int, default=None, help="[point] untimed decode steps first (compiles; default 6)")
    ap.add_argument("--systems", default=None, help=f"comma list of {', '.join(SYSTEMS)} (default: the point's, "
                    f"else {DEFAULT_SYSTEMS})")
    ap.add_argument("--budget-tokens", type=int, default=None, help="[point] default 2048")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dense-layers", type=int, default=2)
    ap.add_argument("--gpu-kv-budget", type=parse_bytes, default=None,
                    help="[point] e.g. 24GiB (emulates a smaller GPU)")
    ap.add_argument("--kv-dtype", default=None, help="[point] KV cache dtype: auto (the model's, default) or "
                    "float8_e4m3fn")
    ap.add_argument("--host-io", default="auto", choices=("auto", "xla", "numpy", "numpy-pinned"),
                    help="host KV pool backend of every system (EngineConfig.host_io; default auto)")
    ap.add_argument("--replay", default=None, help="[point] trace name (e.g. smollm2) or path prefix; see "
                    "bench/traces.py")
    ap.add_argument("--mix", default=None, choices=["mooncake"], help="also run a trace-shaped request mix")
    ap.add_argument("--mix-only", action="store_true", help="skip the fixed (context, batch) points")
    ap.add_argument("--mix-requests", type=int, default=8)
    ap.add_argument("--mix-scale", type=float, default=4.0, help="prompt lengths x this (long-context shift)")
    ap.add_argument("--max-context", type=int, default=131072, help="mix prompts are capped here")
    ap.add_argument("--mix-max-output", type=int, default=256, help="mix outputs are capped here (GPU time)")
    ap.add_argument("--name", default=None, help="result file name (default decode_throughput_<point> or "
                    "decode_throughput_<platform>)")
    ap.add_argument("--profile-system", default=None, help="profile 2 extra decode steps of this system's first "
                    "point (jax.profiler, Perfetto trace) into --profile-dir")
    ap.add_argument("--profile-dir", default=None, help="default: OUT/profile")
    ap.add_argument("--layer-loop", default=None, choices=("auto", "scan", "layerwise"),
                    help="EngineConfig.layer_loop of every system but dense-scan (default: the engine's auto; "
                         "layerwise on CPU rehearses the GPU's path)")
    ap.add_argument("--moe-strategy", default="auto",
                    choices=("auto", "dense", "gather", "grouped", "grouped-pallas"),
                    help="EngineConfig.moe_strategy of every system (mixture-of-experts models; default auto)")
    ap.add_argument("--smoke", action="store_true", help="tiny random model and sizes (CPU check of the script)")
    ap.add_argument("--out", default=None)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's settings: a --point's (bench/points.py), or the options given over their defaults."""
    ap = build_parser()
    args = ap.parse_args(argv)
    given = [k for k in POINT_OPTIONS if getattr(args, k) is not None]
    if args.point is not None:
        clash = [f"--{k.replace('_', '-')}" for k in given] + (["--smoke"] if args.smoke else [])
        if clash:
            ap.error(f"--point {args.point} sets what {', '.join(clash)} would (bench/points.py)")
        p = points.POINTS[args.point]
        args.model, args.dtype, args.contexts, args.batches = p.model, p.dtype, str(p.context), str(p.batch)
        args.steps, args.warm, args.budget_tokens = p.steps, p.warm, p.budget_tokens
        args.gpu_kv_budget, args.kv_dtype, args.replay = p.gpu_kv_budget, p.kv_dtype, p.replay
        args.systems = args.systems or ",".join(p.systems)
        args.name = args.name or f"decode_throughput_{args.point.lower()}"
    else:
        for k, v in POINT_OPTIONS.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
        args.systems = args.systems or DEFAULT_SYSTEMS
    if args.smoke:
        # SmolLM2's shape with random weights: 30 layers make offloading cheaper than dense on the GPU (a
        # 2-layer model would keep half its KV in the dense-layer packs); 200 MiB holds 2 dense 2K requests
        args.model, args.dtype, args.contexts, args.batches = "random:smollm2-135m", "float32", "2000", "1,3"
        args.steps, args.warm, args.budget_tokens = 3, 2, 256
        args.gpu_kv_budget = args.gpu_kv_budget or 200 * 2**20
        args.mix_requests, args.mix_scale, args.max_context, args.mix_max_output = 4, 0.3, 2500, 12
    unknown = [s for s in args.systems.split(",") if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    if args.mix_only and not args.mix:
        ap.error("--mix-only needs --mix")
    if args.profile_system is not None and args.profile_system not in args.systems.split(","):
        ap.error(f"--profile-system {args.profile_system} is not among --systems")
    return args


def engine_base(args: argparse.Namespace) -> dict:
    """The EngineConfig settings every system runs over (`system_config`)."""
    batches = [int(x) for x in args.batches.split(",")]
    return dict(block_size=args.block_size, budget_tokens=args.budget_tokens, dense_layers=args.dense_layers,
                max_batch=max(batches + ([args.mix_requests] if args.mix else [])), gpu_kv_budget=args.gpu_kv_budget,
                progress=False, prefill_chunk=max(512, args.block_size), host_io=args.host_io,
                moe_strategy=args.moe_strategy, kv_dtype=args.kv_dtype,
                **({} if args.layer_loop is None else {"layer_loop": args.layer_loop}))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    systems = args.systems.split(",")
    from bench.fingerprint import portable_locations

    portable_locations()  # (before anything is traced: fingerprints as the compile-only check makes them)

    import jax
    from pulseinfer_jax.models.loading import load_model

    compiles = CompileCounter()
    cache: dict = {}
    from pulseinfer_jax.backends import plan_backends
    from pulseinfer_jax.config import EngineConfig

    # loaded as the (layer-wise on a GPU) engines read the weights; dense-scan stacks its own copy
    loop = EngineConfig.of(layer_loop=args.layer_loop or "auto")
    model = load_model(args.model, dtype=args.dtype,
                       layout=plan_backends(loop, jax.devices()[0].platform).weights_layout)
    replay = load_replay(args.replay, args.budget_tokens)
    contexts = [] if args.mix_only else [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    base = engine_base(args)
    name = args.name or ("decode_throughput_smoke" if args.smoke else f"decode_throughput_{jax.devices()[0].platform}")
    meta = {"kind": "decode_throughput", "point": args.point, "model": args.model, "dtype": args.dtype, "engine": base,
            "kv": "synthetic random KV (not prefilled)",
            "selection_source": f"replayed traces {args.replay}" if replay else "the engine's own (over random KV)",
            "gpu_kv_budget_note": "GPU KV capped by gpu_kv_budget (an emulated smaller GPU)" if args.gpu_kv_budget
            else "GPU KV: 85% of free device memory", "points": [], "mix": None}
    profiled = False
    for ctx in contexts:
        for b in batches:
            for system in systems:
                try:
                    prof = None
                    if system == args.profile_system and not profiled:
                        prof = args.profile_dir or str(pathlib.Path(args.out or RESULTS) / "profile")
                        profiled = True
                    row = run_point(model, system, ctx, b, args.steps, args.warm, base, replay, compiles, cache,
                                    profile_dir=prof)
                    if prof is not None:
                        row["profile_dir"] = prof
                except Exception as e:  # noqa: BLE001 - record and go on: GPU time is scarce
                    row = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
                    gc.collect()
                row = {"system": system, "context": ctx, "batch_requested": b, **row}
                meta["points"].append(row)
                write_result(name, {**meta, "complete": False}, args.out)
                print(f"ctx {ctx:6d} batch {b:3d} {system:25s} {describe(row)}", flush=True)
    if args.mix:
        from bench.workload import mooncake_mix

        lengths, source = mooncake_mix(args.mix_requests, scale=args.mix_scale, max_prompt=args.max_context,
                                       max_output=args.mix_max_output, seed=0)
        meta["mix"] = {"source": source, "scale": args.mix_scale, "lengths": lengths, "rows": []}
        for system in systems:
            try:
                row = run_mix(model, system, lengths, base, replay, cache, compiles)
            except Exception as e:  # noqa: BLE001
                row = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
                gc.collect()
            meta["mix"]["rows"].append({"system": system, **row})
            write_result(name, {**meta, "complete": False}, args.out)
            print(f"mix {system:25s} " + (f"{row['tokens_per_s']:8.1f} tok/s, TPOT p50 {row['tpot_s_p50'] * 1e3:7.1f} "
                                          f"ms p99 {row['tpot_s_p99'] * 1e3:7.1f} ms {row['placements']}"
                                          if "tokens_per_s" in row else str(row.get("skipped") or row.get("error"))),
                  flush=True)
    path = write_result(name, {**meta, "complete": True}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
