"""Predicted H200 decode throughput of bench/decode_throughput.py's systems, read from their compiled programs.

    ./run.sh gpu-python bench/predict.py [--points A,B] [--h2d 50e9] [--out DIR]

No GPU runs. Each system's decode step at the GPU suite's points (bench/points.py, which bench/gpu_suite.sh times:
A = 8 requests of 32K tokens under a 16 GiB GPU KV budget, B = 4 of 128K under 33 GiB, C = 24 of 32K, D = 12 of 128K
in float8; random Llama-3.1-8B, bf16, budget 2,048), configured as bench/decode_throughput.py --point configures it
(the same functions) with every "auto" resolved as a GPU engine resolves it, is built as the engine builds it
(bench/aot/catalogue.py: pool sizes, the IOAA admission of every request at once as Scheduler.admit makes it, the
dense requests' step and the offloaded ones' micro-batches), compiled for the compile-only H200 and costed
(bench/aot/cost.py: HBM bytes, kernel launches, host syncs). Recall per sparse layer is the replayed SmolLM2
trace's (bench/results/traces, as the bench replays it: each engine layer the trace layer at its relative depth)
through the system's slot caches (LRU, selection/slot_table.py).
Each prediction lists its programs with their fingerprints (bench/fingerprint.py), as the measured rows do.

Time model (stated, not measured; each term printed):
  GPU time of a program        bytes / bandwidth + launches x t_launch   (t_launch, t_sync calibrated below)
  host sync                    t_sync per read of a layer's plan (one per sparse layer and micro-batch)
  recall of a layer            host gather (bytes / gather rate) [+ bytes / copy rate: host_io="numpy", PJRT copies
                               pageable memory into its pinned bounce buffer; host_io="numpy-pinned" gathers into
                               pinned staging, no bounce] + bytes / h2d + t_copy per copy; the
                               per-head baseline (io="fragmented"): one copy per (block, head) at t_copy each, no
                               gather (what a per-head engine issues; this engine's XLA loop costs more: 6 launches
                               per unit)
  the XLA host gather (host_io="xla") holds the GPU: XLA's HostExecute thunks start it only after every GPU program
                               queued before it and launch none of the device's later work until it ends, so its
                               seconds add to the GPU's in every schedule; the numpy gather (host_io="numpy", on the
                               recall thread with recall ahead) is host code the GPU never waits on
  a sparse layer, 1 micro-batch   pre + sync + recall + land              (recall="sync")
                                  pre + sync + max(recall, early) + land  (interruptible: early attention hides it)
                                  pre + max(sync + recall, early) + land  (eager: queued before the plan is read)
  a sparse layer, k micro-batches max(GPU time of all k [+ k XLA gathers], one micro-batch's chain, pre + sync + k x
                                  recall + land): their recalls share one host gather and one link, so they run one
                                  after the other
  recall="ahead" (one micro-batch)  the step is ONE program (sparse_step.ahead_step), no sync on its critical path;
                                  the step's plan is read once, every layer's misses gathered and copied as one
                                  recall that lands before the next step's program (sparse_step.land_step): step =
                                  max(GPU time of both [+ its XLA gather], that recall); the per-head baseline
                                  (io="fragmented") keeps one call per sparse layer, each layer's copies one after
                                  the other
Every prediction is made twice: at the calibrated t_launch and at T_LAUNCH_LOW (1 us: launches from a command buffer
or CUDA graph may cost that little), so that what depends on the launch cost shows.
The host gather rate (`--gather-rate`) defaults to bench/host_gather.py's measurement on the CPU machine (2 cores):
the GPU host's is not measured, and the output names where the rate came from. The driver's host time per step
(bench/host_overhead.py on the CPU machine, HOST_TIME_FILES) is a floor of each offloaded step: tokens/s = batch /
max(GPU step, host step), the GPU step holding its recall's floor (`gpu_tokens_per_s`: the GPU side alone; the dense
system's driver time is not measured, so its figures are the GPU's). That max holds only for a driver that dispatches
step t+1 before it reads step t's tokens; the engine's driver reads them first, and `serial_tokens_per_s` (batch /
(GPU step + host step)) is what that costs.
Calibration (`calibrate`): bench/dense_decode.py's measured configuration (scan + jnp attention, its KV pool and
tables, 8 steps each ending in a host sync) compiled at the six rows of bench/results/gpu_h200_run1; t_launch and
t_sync fitted by least squares of measured - bytes / bandwidth on (launches, 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench import points as suite_points  # noqa: E402
from bench.common import RESULTS, write_result  # noqa: E402

POINTS = {name: p.as_dict() for name, p in suite_points.POINTS.items()}  # (the JSON form)
TRACE = suite_points.TRACE
MEASURED = RESULTS / "gpu_h200_run1" / "dense_decode_gpu.json"
DEFAULT_H2D = 50e9  # pinned host -> H200 over PCIe Gen5 (DESIGN.md: ~50-55 GB/s for large copies)
T_COPY = 5e-6  # fixed cost of one host-to-device copy (DESIGN.md: ~5-7 us per call)
# the GPU idles from a layer's plan being ready until the host has read it and issued the work that follows: a
# small device-to-host read and a few dispatches; on this project's CPU machine, isolated, a read of the plan was
# ~40 us and a jitted call's dispatch 7-50 us (bench/RESULTS.md "Host side of the sparse decode step"). Assumed,
# not measured on a GPU: the predictions are also given at half and twice it
T_SYNC = 100e-6
T_LAUNCH_LOW = 1e-6  # the second launch cost every prediction is given at
GATHER_RATE_FILE = RESULTS / "host_gather_cpu.json"
# the driver's main-thread time per step (bench/host_overhead.py on the CPU machine, per recall schedule): a step whose
# host time exceeds its predicted GPU time is host-bound, and the prediction says so
HOST_TIME_FILES = {"ahead": RESULTS / "host_overhead_cpu_ahead.json",
                   "same-layer": RESULTS / "host_overhead_cpu_same_layer.json"}
CALIBRATION = RESULTS / "h200_calibration.json"


# ---- the programs ------------------------------------------------------------------------------
def point_args(point: str):
    """bench/decode_throughput.py's settings at GPU-suite point `point` (`--point`)."""
    from bench.decode_throughput import parse_args

    return parse_args(["--point", point])


def _engine_config(system: str, point: str):
    """(EngineConfig, backends, tokens each request may generate) of `system` at `point`, as
    bench/decode_throughput.py --point runs it on a GPU."""
    from bench.decode_throughput import engine_base, system_config
    from pulseinfer_jax.backends import plan_backends

    a = point_args(point)
    cfg = system_config(engine_base(a), system)
    r = plan_backends(cfg, "gpu")  # each "auto" as a GPU engine resolves it (its start-up checks assumed to pass)
    backends = {"attention": r.decode_attention, "layer_loop": r.layer_loop, "host_io": r.host_io or "xla"}
    return cfg, backends, suite_points.max_new_tokens(a.warm, a.steps, int(a.batches))


def admission(cfg, model_cfg, prompts: list[int], new: int, h2d: float) -> tuple[list[str], object]:
    """How the engine places requests submitted together (Scheduler.admit at the first step, everything waiting):
    the placement per request ("dense" / "offload" / "wait") and the pool sizes."""
    from bench.aot.catalogue import _Request
    from pulseinfer_jax.kv.blocks import blocks_for
    from pulseinfer_jax.sched.admission import Candidate, IOAAConfig, admit_batch
    from pulseinfer_jax.sched.pools import offload_blocks, pool_sizes
    from pulseinfer_jax.sched.scheduler import FixedStepTime

    reqs = [_Request(n, new) for n in prompts]
    from pulseinfer_jax.kv.quant import block_rows, resolve_kv_dtype, storage_dtype

    kv_dtype = resolve_kv_dtype(cfg.kv_dtype, "bfloat16")
    meta_item = cfg.scoring.metadata_dtype("bfloat16").itemsize
    sizes = pool_sizes(cfg, model_cfg, storage_dtype(kv_dtype), meta_item, reqs, cfg.gpu_kv_budget)
    capacity = sizes.num_blocks - 1
    cands = []
    for i, r in enumerate(reqs):
        dense = blocks_for(r.need_tokens, cfg.block_size)
        if sizes.plan is None:
            cands.append(Candidate(i, dense, capacity + 1, 0.0))
        else:
            p = sizes.plan
            rows = block_rows(cfg.block_size, model_cfg.head_dim, kv_dtype)
            block_bytes = 2 * rows * model_cfg.num_kv_heads * model_cfg.head_dim * storage_dtype(kv_dtype).itemsize
            cands.append(Candidate(i, dense, offload_blocks(p, r), float(p.middle_blocks * block_bytes
                                                                        * p.sparse_layers)))
    decisions = dict(admit_batch(cands, mode=cfg.mode, free_blocks=capacity, running=0, offloaded_recall_bytes=0.0,
                                 observed_step_time_s=None, cost=FixedStepTime(cfg.offload.ioaa_step_time_s),
                                 config=IOAAConfig(h2d_bytes_per_s=h2d, slack=cfg.offload.ioaa_slack),
                                 max_batch=cfg.max_batch,
                                 queued_dense_blocks=sum(c.dense_blocks for c in cands)))
    return [decisions.get(i, "wait") for i in range(len(reqs))], sizes


def lru_misses(cfg, plan, trace, point: dict) -> np.ndarray:
    """Mean misses per engine sparse layer and request over the bench's timed steps, replaying `trace` through
    LRU slot caches of the engine's capacity (per lane; headwise lanes replay trace lane h % S)."""
    from pulseinfer_jax.selection.slot_table import SlotCache

    r_count, t_count, ls_t, s_t, _ = trace.sel.shape
    tl = np.round(np.arange(plan.sparse_layers) * (ls_t - 1) / max(1, plan.sparse_layers - 1)).astype(int)
    lanes = [h % s_t for h in range(plan.lanes)]
    steps = range(point["warm"] + point["steps"])
    per_lane = np.zeros((r_count, ls_t, s_t))
    for r in range(r_count):
        for layer in sorted(set(tl)):
            for lane in sorted(set(lanes)):
                cache = SlotCache(plan.slot_blocks)
                counted = 0
                for t in steps:
                    want = [int(j) for j in trace.sel[r, t % t_count, layer, lane] if j >= 0]
                    _, missed = cache.plan(want)
                    if t >= point["warm"]:
                        per_lane[r, layer, lane] += len(missed)
                        counted += 1
                per_lane[r, layer, lane] /= max(1, counted)
    per_request = per_lane[:, :, lanes].sum(axis=2)  # [R, Ls_t]: every engine lane's misses
    return per_request.mean(axis=0)[tl]  # [SL]: a request's mean misses per engine sparse layer


@dataclasses.dataclass
class SystemStep:
    """One system's decode step at one point: which programs run how often, and the recall of each layer."""

    system: str
    point: str
    placements: list[str]
    dense: list  # Calls of the dense requests' step
    sparse: dict  # recall bucket -> Calls of the offloaded step at that recall (per layer and micro-batch)
    misses: list[float]  # per sparse layer: misses per micro-batch (mean over the timed steps)
    micro_batches: int
    config: object
    backends: dict
    unit_bytes: int  # bytes of one recalled entry (a block of every head, or one head's)
    copies_per_miss: int  # host-to-device copies per recalled entry (0: coalesced, one copy per layer)
    layout: object = None  # the offloaded requests' catalogue.SparseLayout (None: none offloaded)


def system_step(system: str, point_name: str, h2d: float, shardings) -> SystemStep:
    from pulseinfer_jax.models.config import ModelConfig
    from pulseinfer_jax.models.presets import PRESETS

    from bench.aot import catalogue as cat
    from bench.traces import load_trace
    from pulseinfer_jax.backends import plan_backends

    point = POINTS[point_name]
    model_cfg = ModelConfig.from_hf_dict(PRESETS[point["model"].removeprefix("random:")],
                                         name=point["model"].removeprefix("random:"))
    cfg, backends, new = _engine_config(system, point_name)
    prompts = [point["prompt"]] * point["batch"]
    placements, sizes = admission(cfg, model_cfg, prompts, new, h2d)
    dense_idx = [i for i, p in enumerate(placements) if p == "dense"]
    off_idx = [i for i, p in enumerate(placements) if p == "offload"]
    nb = sizes.num_blocks
    dense_calls, sparse_calls, misses, mbs = [], {}, [], 1
    if dense_idx:
        es = cat.EngineShapes.of(model_cfg, "bfloat16", cfg.with_settings(mode="dense"), **backends)
        dense_calls = cat.dense_decode(es, [prompts[i] for i in dense_idx], new, num_blocks=nb)
    unit, copies, layout = 0, 1, None
    if off_idx:
        es = cat.EngineShapes.of(model_cfg, "bfloat16", cfg, **backends)
        layout = cat.SparseLayout.of(es, prompts, new, offloaded=off_idx, cap_bytes=cfg.gpu_kv_budget)
        mbs = max(1, min(plan_backends(cfg, "gpu").micro_batches, len(off_idx)))  # as a GPU engine resolves it
        trace = load_trace(RESULTS / "traces" / f"{point['replay']}_{cfg.ablation.selection}_b"
                                              f"{cfg.offload.budget_tokens}.npz")
        per_request = lru_misses(cfg, layout.plan, trace, point)
        if cfg.ablation.placement == "device":  # every block stays on the GPU: nothing is recalled
            per_request = np.zeros_like(per_request)
        misses = [float(m) * len(off_idx) / mbs for m in per_request]
        from pulseinfer_jax.kv.blocks import bucket

        # with recall ahead the dense-placed requests decode in the offloaded requests' layer pass (their own step
        # only in an offloaded request's first step: compiled, not counted)
        joined = bool(dense_idx) and cfg.ablation.recall == "ahead"
        placed = [prompts[i] for i in dense_idx] if joined else None
        if joined:
            dense_calls = [dataclasses.replace(c, count=0.0) for c in dense_calls]
        for r in sorted({bucket(max(1, round(m))) if m else 0 for m in misses}):
            sparse_calls[r] = cat.sparse_decode(es, layout, r, shardings=shardings, micro_batches=mbs, placed=placed)
        c = model_cfg
        block = 2 * es.kv_rows * c.num_kv_heads * c.head_dim * es.kv_dtype.itemsize
        unit = block if cfg.ablation.selection == "solohead" else block // c.num_kv_heads  # one recalled entry
        # host-to-device copies per recalled entry: coalesced one per layer and micro-batch (0 here), fragmented one
        # per (block, head)
        ab = cfg.ablation
        copies = 0 if ab.io == "coalesced" else (c.num_kv_heads if ab.selection == "solohead" else 1)
    return SystemStep(system, point_name, placements, dense_calls, sparse_calls, misses, mbs, cfg, backends, unit,
                      copies, layout)


def steps_for(target, points: list[str], h2d: float, systems: list[str]) -> list[SystemStep]:
    return [system_step(s, p, h2d, target.sharding) for p in points for s in systems]


def calibration_programs(target) -> dict:
    """The calibration's programs, for check.compile_programs' workers."""
    return {c.program.key: c.program for calls in calibration_steps().values() for c in calls}


def predict_programs(target, points: str = "A,B,C,D", h2d: float = DEFAULT_H2D, systems: str = "") -> dict:
    """Every program of the prediction, for check.compile_programs' workers."""
    from bench.decode_throughput import SYSTEMS

    out = {}
    for st in steps_for(target, points.split(","), h2d, systems.split(",") if systems else list(SYSTEMS)):
        for c in st.dense + [c for calls in st.sparse.values() for c in calls]:
            out.setdefault(c.program.key, c.program)
    return out


# ---- the time model ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Model:
    bandwidth: float
    t_launch: float
    t_sync: float
    h2d: float
    t_copy: float
    gather_rate: float  # host gather bytes/s (XLA host computation)
    numpy_gather_rate: float  # the same by numpy fancy indexing (host_io="numpy")
    copy_rate: float  # contiguous host copy bytes/s (host_io="numpy": PJRT's copy into its pinned bounce buffer)
    staging_gather_rate: float = 0.0  # numpy's gather into a preallocated (pinned) staging buffer ("numpy-pinned")
    gather_source: str = ""  # where the host rates come from

    def gpu(self, cost: dict, count: float = 1.0) -> float:
        return count * (cost["bytes"] / self.bandwidth + cost["launches"] * self.t_launch)


def calibrate(rows: dict, bandwidth: float) -> dict:
    """t_launch from the measured dense rows: least squares of (measured - bytes / bandwidth) on launches. Each row
    is one step with ~1,000 launches and exactly one host sync, so a sync's cost is not separable from the launches
    here: it is folded into t_launch (t_sync is set apart, `T_SYNC`). Also the fit with the bandwidth free, to show
    how much of the error a different bandwidth would explain."""
    measured = json.loads(MEASURED.read_text())["grid"]
    pts = []
    for m in measured:
        name = f"calibration/{m['context']}x{m['batch']}"
        calls = calibration_steps()[name]
        b = sum(rows[c.program.key]["cost"]["bytes"] * c.count for c in calls)
        n = sum(rows[c.program.key]["cost"]["launches"] * c.count for c in calls)
        pts.append((name, m["step_s_median"], b, n))
    meas = np.array([p[1] for p in pts])
    nbytes = np.array([p[2] for p in pts], float)
    launches = np.array([p[3] for p in pts], float)
    resid = meas - nbytes / bandwidth
    t_launch = float(resid @ launches / (launches @ launches))
    free, *_ = np.linalg.lstsq(np.stack([nbytes, launches], 1), meas, rcond=None)
    fit = []
    for (name, m, b, n) in pts:
        pred = b / bandwidth + n * t_launch
        pred_free = b * free[0] + n * free[1]
        fit.append({"point": name, "measured_s": m, "predicted_s": pred, "ratio": pred / m, "bytes": b,
                    "launches": n, "predicted_free_bw_s": pred_free})
    return {"t_launch": t_launch, "bandwidth": bandwidth, "rows": fit, "measured": str(MEASURED.relative_to(RESULTS)),
            "max_error": max(abs(f["ratio"] - 1) for f in fit),
            "free_fit": {"bandwidth": float(1 / free[0]), "t_launch": float(free[1]),
                         "max_error": float(max(abs(f["predicted_free_bw_s"] / f["measured_s"] - 1) for f in fit))}}


def calibration_steps() -> dict:
    from bench.aot import suite

    s = suite.Suite({}, {})
    suite.calibration_points(s)
    return s.steps


def predict_step(st: SystemStep, rows: dict, m: Model) -> dict:
    """Predicted seconds of one decode step (module docstring), with its terms."""
    from pulseinfer_jax.kv.blocks import bucket

    cost = {k: r["cost"] for k, r in rows.items()}
    dense_s = sum(m.gpu(cost[c.program.key], c.count) for c in st.dense)
    dense_bytes = sum(cost[c.program.key]["bytes"] * c.count for c in st.dense)
    out = {"system": st.system, "point": st.point, "placements": {p: st.placements.count(p) for p in
                                                                  ("dense", "offload", "wait")},
           "dense_s": dense_s, "dense_bytes": dense_bytes}
    # the step's GPU programs (host I/O programs aside): HBM bytes and kernel launches
    gpu_calls = [(c, c.count) for c in st.dense]
    if not st.sparse:
        out.update(step_s=dense_s, sparse_s=0.0, recall_bytes=0.0, **_step_totals(gpu_calls, cost))
        return out
    cfg = st.config
    if cfg.ablation.recall == "ahead" and not st.copies_per_miss:
        return _predict_one_program(st, cost, m, out, gpu_calls)
    per_layer_fn = {"sparse_pre", "attend", "land_attend_finish", "ahead_layer", "stage_blocks_outer",
                    "stage_units_outer", "fragment"}
    sl = len(st.misses)
    ahead = cfg.ablation.recall == "ahead"
    layers_s, recall_bytes, host_s, syncs, recall_s, held_s = 0.0, 0.0, 0.0, 0, 0.0, 0.0
    fixed_s = None
    for miss in st.misses:
        calls = st.sparse[bucket(max(1, round(miss))) if miss else 0]
        # (a per-layer program's count covers every layer, a once-per-step one's the step: 1 / sl of each here)
        gpu_calls += [(c, c.count / sl) for c in calls if c.program.group != "host_io"]
        by = {}
        for c in calls:
            if c.program.function in per_layer_fn:
                by[c.program.function] = by.get(c.program.function, 0.0) + m.gpu(cost[c.program.key], c.count / sl)
        if fixed_s is None:  # embed, dense layers, logits, write-back, key bounds, sampling: once per step
            fixed_s = sum(m.gpu(cost[c.program.key], c.count) for c in calls if c.program.function not in per_layer_fn)
        k = st.micro_batches
        pre, early, land = by.get("sparse_pre", 0.0) / k, by.get("attend", 0.0) / k, by.get("land_attend_finish",
                                                                                              0.0) / k
        host = (by.get("stage_blocks_outer", 0.0) + by.get("stage_units_outer", 0.0)) / k  # host programs, if any
        nbytes = miss * st.unit_bytes
        hold = 0.0  # seconds of the recall the GPU waits through (the XLA host gather: see the module docstring)
        if st.copies_per_miss:  # one copy per unit straight from the pool: no host gather
            recall = nbytes / m.h2d + miss * st.copies_per_miss * m.t_copy if miss else 0.0
        else:
            recall, hold = _recall_seconds(st, m, nbytes)
        recall_bytes += nbytes * k
        host_s += host * k
        held_s += hold * k
        if ahead:  # one call; its recall runs while the GPU goes on, landing by the layer's next call
            layers_s += by.get("ahead_layer", 0.0) + hold
            recall_s += recall
            continue
        syncs += k
        chain = {"sync": pre + m.t_sync + recall + early + land,
                 "interruptible": pre + m.t_sync + max(recall, early) + land,
                 "eager": pre + max(m.t_sync + recall, early) + land}[cfg.ablation.recall]
        # k micro-batches: the GPU runs all their work (and waits through each XLA gather); each recall waits for
        # the one before it (one host gather, one link), the last one then lands
        layers_s += max(k * (pre + early + land + hold), chain, pre + m.t_sync + k * recall + land)
    sparse_s = layers_s + (fixed_s or 0.0)
    out.update(gpu_held_by_gather_s=held_s)
    if ahead:  # the step's recalls share one gather and one link, each with a step to land: the slower side bounds
        out.update(recall_chain_s=recall_s, recall_bound=recall_s > sparse_s)
        sparse_s = max(sparse_s, recall_s)
    out.update(_step_totals(gpu_calls, cost))
    out.update(sparse_s=sparse_s, step_s=dense_s + sparse_s, recall_bytes=recall_bytes,
               recall_s_per_layer=recall_bytes / sl / m.h2d, plan_syncs=syncs, micro_batches=st.micro_batches,
               misses_per_layer_mean=float(np.mean(st.misses)))
    return out


def _recall_seconds(st: SystemStep, m: Model, nbytes: float) -> tuple[float, float]:
    """(seconds of one coalesced recall of `nbytes`: gather + copy, of them the seconds the GPU is held by an XLA
    host gather)."""
    if not nbytes:
        return 0.0, 0.0
    io = st.backends["host_io"]
    if io == "numpy":  # numpy gather, PJRT's bounce copy, one copy
        return nbytes / m.numpy_gather_rate + nbytes / m.copy_rate + nbytes / m.h2d + m.t_copy, 0.0
    if io == "numpy-pinned":  # numpy gather into pinned staging, one copy from it
        return nbytes / m.staging_gather_rate + nbytes / m.h2d + m.t_copy, 0.0
    hold = nbytes / m.gather_rate  # an XLA host gather into one pinned staging buffer, then one copy
    return hold + nbytes / m.h2d + m.t_copy, hold


def _predict_one_program(st: SystemStep, cost: dict, m: Model, out: dict, gpu_calls: list) -> dict:
    """Recall ahead as the engine runs it: the step is one program (sparse_step.ahead_step) after the landing of the
    previous step's recall (sparse_step.land_step: `bucket(max misses of a layer)` entries a layer); the step's misses
    of every layer are one gather and one copy, landing a step later: step = max(GPU time of the two programs [+ its
    XLA gather], that recall)."""
    from pulseinfer_jax.kv.blocks import bucket

    worst = max(st.misses)
    calls = st.sparse[bucket(max(1, round(worst))) if worst else 0]
    gpu_calls += [(c, c.count) for c in calls if c.program.group != "host_io"]
    step_s = sum(m.gpu(cost[c.program.key], c.count) for c in calls if c.program.group != "host_io")
    recall_bytes = float(sum(st.misses)) * st.unit_bytes
    recall_s, hold = _recall_seconds(st, m, recall_bytes)
    sparse_s = step_s + hold
    out.update(gpu_held_by_gather_s=hold, recall_chain_s=recall_s, recall_bound=recall_s > sparse_s)
    out.update(_step_totals(gpu_calls, cost))
    sparse_s = max(sparse_s, recall_s)
    sl = len(st.misses)
    out.update(sparse_s=sparse_s, step_s=out["dense_s"] + sparse_s, recall_bytes=recall_bytes,
               recall_s_per_layer=recall_bytes / sl / m.h2d, plan_syncs=0, micro_batches=st.micro_batches,
               misses_per_layer_mean=float(np.mean(st.misses)))
    return out


def step_programs(st: SystemStep) -> dict[str, float]:
    """Program key -> runs per decode step (the step's recall buckets weighted by their layers), those that run."""
    from pulseinfer_jax.kv.blocks import bucket

    runs: dict[str, float] = {}
    for c in st.dense:
        runs[c.program.key] = runs.get(c.program.key, 0.0) + c.count
    if st.config.ablation.recall == "ahead" and not st.copies_per_miss and st.misses:  # one program per step
        worst = max(st.misses)
        for c in st.sparse[bucket(max(1, round(worst))) if worst else 0]:
            runs[c.program.key] = runs.get(c.program.key, 0.0) + c.count
        return {k: n for k, n in runs.items() if n > 0}
    for miss in st.misses:  # (a per-layer program's count covers every layer: 1 / sl of it per layer)
        for c in st.sparse[bucket(max(1, round(miss))) if miss else 0]:
            runs[c.program.key] = runs.get(c.program.key, 0.0) + c.count / len(st.misses)
    return {k: n for k, n in runs.items() if n > 0}


def _step_totals(calls: list, cost: dict) -> dict:
    """HBM bytes and kernel launches of a step's GPU programs [(Call, times per step)]."""
    return {"step_hbm_bytes": float(sum(cost[c.program.key]["bytes"] * n for c, n in calls)),
            "step_launches": float(sum(cost[c.program.key]["launches"] * n for c, n in calls))}


def main() -> int:
    from bench.aot import check
    from bench.aot.cost import H200_STREAM_BW
    from bench.aot.target import CompileTarget, use_cpu_backend
    from bench.decode_throughput import SYSTEMS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=",".join(POINTS), help="GPU-suite points (bench/points.py)")
    ap.add_argument("--systems", default="", help=f"comma list (default all: {', '.join(SYSTEMS)})")
    ap.add_argument("--h2d", type=float, default=DEFAULT_H2D, help="host-to-device bytes/s (IOAA and the model)")
    ap.add_argument("--gather-rate", type=float, default=None,
                    help="host gather bytes/s (default: bench/results/host_gather_cpu.json's XLA rate)")
    ap.add_argument("--t-sync", type=float, default=T_SYNC, help="seconds the GPU idles per host read of a plan")
    ap.add_argument("--t-launch", type=float, default=None,
                    help="seconds per kernel launch instead of the calibrated value (sensitivity)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--target", default=None)
    ap.add_argument("--reuse", default=None, help="an earlier h200_predict.json: compile only programs it lacks")
    ap.add_argument("--calibrate", action="store_true", help=f"compile the calibration's programs and refit "
                    f"(default: the fit in {CALIBRATION.name}, made when the measured configuration's code was "
                    "what the H200 ran)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    use_cpu_backend()
    target = CompileTarget.load(a.target)
    systems = a.systems.split(",") if a.systems else list(SYSTEMS)
    opts = {"points": a.points, "h2d": a.h2d, "systems": ",".join(systems)}
    programs = predict_programs(target, **opts)
    have = json.loads(pathlib.Path(a.reuse).read_text())["programs"] if a.reuse else {}
    have = {k: r for k, r in have.items() if r.get("fingerprint")}  # (older reports: compiled again)
    todo = [k for k in programs if k not in have]
    rows = check.compile_programs(a.target, "bench.predict:predict_programs", opts, todo, a.workers,
                                  programs) if todo else []
    bad = [r for r in rows if r["status"] != "compiled"]
    if bad:
        raise SystemExit(f"{len(bad)} programs did not compile: {bad[0]['key'][:200]}: {bad[0].get('error')}")
    rows = {**{k: v for k, v in have.items() if k in programs}, **{r["key"]: r for r in rows}}
    if a.calibrate or not CALIBRATION.is_file():
        cal_rows = check.compile_programs(a.target, "bench.predict:calibration_programs", {},
                                          list(calibration_programs(target)), a.workers)
        cal = calibrate({r["key"]: r for r in cal_rows}, H200_STREAM_BW)
        write_result(CALIBRATION.stem, cal, CALIBRATION.parent)
    cal = json.loads(CALIBRATION.read_text())
    gather, numpy_gather, copy, staging = _gather_rates()
    source = (f"measured on the CPU machine (2 cores; {GATHER_RATE_FILE.relative_to(RESULTS.parent)}), not on the GPU "
              "host")
    if a.gather_rate:
        gather = numpy_gather = staging = a.gather_rate
        source = f"--gather-rate; the copy rate {source}"
    print(f"host gather: {gather / 1e9:.1f} GB/s (numpy {numpy_gather / 1e9:.1f} GB/s, into staging "
          f"{staging / 1e9:.1f} GB/s, contiguous copy {copy / 1e9:.1f} GB/s), {source}")
    free = cal["free_fit"]
    print(f"calibration ({CALIBRATION.name}, git {cal.get('git')}): t_launch {free['t_launch'] * 1e6:.2f} us at "
          f"{free['bandwidth'] / 1e12:.2f} TB/s, max error {free['max_error']:.3f}; at {cal['bandwidth'] / 1e12:.1f} "
          f"TB/s fixed: t_launch {cal['t_launch'] * 1e6:.2f} us, max error {cal['max_error']:.3f}")
    t_launch = free["t_launch"] if a.t_launch is None else a.t_launch
    model = Model(free["bandwidth"], t_launch, a.t_sync, a.h2d, T_COPY, gather, numpy_gather, copy, staging, source)
    low = dataclasses.replace(model, t_launch=T_LAUNCH_LOW)
    preds = []
    for st in steps_for(target, a.points.split(","), a.h2d, systems):
        p = predict_step(st, rows, model)
        batch = p["placements"]["dense"] + p["placements"]["offload"]
        p["step_s_at_1us"] = predict_step(st, rows, low)["step_s"]
        p["programs"] = [{"key": k, "function": programs[k].function, "runs_per_step": n, **rows[k]["fingerprint"]}
                         for k, n in sorted(step_programs(st).items(), key=lambda kv: -kv[1])]
        host = host_seconds(st.config.ablation.recall, p["placements"]["offload"], st.point) if st.sparse else None
        if host is not None:  # the driver's own time per step (measured on the CPU machine): a floor of the step
            p.update(host_s=host, host_bound=host > p["step_s"], host_bound_at_1us=host > p["step_s_at_1us"])
        # tokens/s = batch / max(GPU step (its recall floor inside), host step): the headline; the GPU side alone
        # too, and the two in series (a driver that reads a step's tokens before it dispatches the next: the host's
        # work then waits for the GPU and the GPU for the host)
        for suffix in ("", "_at_1us"):
            gpu = p[f"step_s{suffix}"]
            p[f"gpu_tokens_per_s{suffix}"] = batch / gpu
            p[f"tokens_per_s{suffix}"] = batch / max(gpu, host or 0.0)
            p[f"serial_tokens_per_s{suffix}"] = batch / (gpu + (host or 0.0))
        preds.append(p)
        print(f"{p['point']} {p['system']:26s} {p['placements']} step {p['step_s'] * 1e3:8.2f} ms "
              f"({p['tokens_per_s']:7.1f} tok/s; at 1 us launches {p['step_s_at_1us'] * 1e3:8.2f} ms, "
              f"{p['tokens_per_s_at_1us']:7.1f} tok/s)", flush=True)
    ratios = {}
    for point in a.points.split(","):
        for key, label in (("tokens_per_s", "calibrated t_launch"), ("tokens_per_s_at_1us", "t_launch 1 us")):
            tps = {p["system"]: p[key] for p in preds if p["point"] == point}
            if "pulseinfer" in tps:
                ratios.setdefault(point, {})[label] = {f"pulseinfer/{s}": tps["pulseinfer"] / tps[s]
                                                       for s in ("dense", "offload-headwise") if s in tps}
    print("ratios", ratios)
    for r in cal["rows"]:
        pred = r["predicted_free_bw_s"]
        print(f"  {r['point']}: measured {r['measured_s'] * 1e3:.2f} ms, predicted {pred * 1e3:.2f} "
              f"ms ({pred / r['measured_s']:.3f}x; {r['ratio']:.2f}x at the fixed bandwidth), "
              f"{r['bytes'] / 1e9:.1f} GB, {r['launches']} launches")
    path = write_result("h200_predict", {"model": dataclasses.asdict(model), "calibration": cal, "points": POINTS,
                                         "trace": TRACE, "predictions": preds, "ratios": ratios,
                                         "programs": {k: {"cost": r["cost"], "compile_s": r.get("compile_s"),
                                                          "fingerprint": r.get("fingerprint")}
                                                      for k, r in rows.items()}}, a.out)
    print(f"wrote {path}")
    return 0


def host_seconds(recall: str, batch: int, point: str | None = None, files: dict = HOST_TIME_FILES) -> float | None:
    """The driver's main-thread seconds per step for `batch` offloaded requests under recall schedule `recall`: the
    row bench/host_overhead.py measured at `point` (--points: its own shapes) if there is one, else interpolated
    linearly between the batches it measured (clamped at their ends); None if that schedule was not measured."""
    path = files["ahead" if recall == "ahead" else "same-layer"]
    if not path.is_file():
        return None
    measured = json.loads(path.read_text())["rows"]
    # (the driver's own time where the run timed the replayed selector apart, else the main thread's)
    def ms(r: dict) -> float:
        return r.get("driver_cpu_ms_per_step_p50", r["main_thread_cpu_ms_per_step_p50"])

    at_point = [r for r in measured if point is not None and r.get("point") == point and r["batch"] == batch]
    if at_point:
        return ms(at_point[0]) / 1e3
    rows = sorted((r["batch"], ms(r) / 1e3) for r in measured)
    xs, ys = zip(*rows, strict=True)
    return float(np.interp(batch, xs, ys))


def _gather_rates() -> tuple[float, float, float, float]:
    """(XLA host gather, numpy gather, contiguous copy, numpy gather into staging) bytes/s: the medians over sizes of
    bench/host_gather.py's measurement."""
    if not GATHER_RATE_FILE.is_file():
        raise SystemExit(f"no {GATHER_RATE_FILE}: run bench/host_gather.py first, or pass --gather-rate")
    grid = json.loads(GATHER_RATE_FILE.read_text())["grid"]
    med = lambda name: float(np.median([r["gb_per_s"][name] for r in grid])) * 1e9  # noqa: E731
    return (med("xla host gather (engine)"), med("numpy fancy index (numpy io)"), med("contiguous copy (ceiling)"),
            med("numpy into staging (numpy-pinned io)"))


if __name__ == "__main__":
    sys.exit(main())
