"""Host-side cost of a sparse decode step (what the Python driver does between GPU work), at a GPU point's shape.

    python bench/host_overhead.py                  # Llama-3.1-8B point A: 8 requests x 32K, budget 2,048 tokens
    python bench/host_overhead.py --smoke          # tiny sizes (script check)
    python bench/host_overhead.py --mode step      # also: whole decode steps of a compute-free model (see below)

The layer-wise pipeline plans every sparse layer on the host: after a layer's selection reaches the host it plans
the micro-batch's slot caches, builds the layer's entry lists, issues the recall and packs the index arrays of the
attention calls. On a GPU that work sits between the layer's selection and its attention, so it bounds the step
time from below; this bench measures it without a GPU.

`--mode plan` (the default): exactly that host planning, per decode step (every sparse layer), on real `SparseKV`s
and the engine's `SlotTable` at the point's shape, with a real model's selections (the SmolLM2 trace the throughput
bench replays, `bench/traces.py`, so hits and misses mix as they do there) and the host pool's transfers stubbed
out (no JAX at all). Reported separately: the replay's own mapping (a bench-only cost that the throughput bench's
sparse systems also pay). Configurations: pulseinfer (SoloHead, coalesced) and offload-headwise (per-head,
fragmented).

`--mode step`: whole decode steps of the engine (`bench/decode_throughput.py`'s engines, replayed selections) on a
model with Llama-3.1-8B's layer count and KV heads but tiny widths, so that the step is mostly host work; reports the
main thread's CPU time per step (`time.thread_time`: the driver's Python and JAX dispatch, not XLA's compute
threads). On a 2-core CPU, XLA:CPU still runs some work inline and competes for the cores: a rough upper bound, for
comparing versions of the driver on the same machine, not a GPU number.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import sys
import time
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.common import write_result  # noqa: E402

CONFIGS = {"pulseinfer": dict(selection="solohead", io="coalesced"),
           "offload-headwise": dict(selection="headwise", io="fragmented")}


class _StubPool:
    """The host pool's interface as `SparseDecoder._issue_recall` uses it, without transfers."""

    def __init__(self, layer_block_bytes: int, num_kv_heads: int):
        self.layer_block_bytes = layer_block_bytes
        self.unit_bytes = layer_block_bytes // num_kv_heads

    @staticmethod
    def _staged(rows) -> np.ndarray:
        from pulseinfer_jax.kv_cache import bucket

        return np.empty((bucket(len(rows)), 0), np.uint8)

    def gather_blocks(self, layer, rows):
        return self._staged(rows)

    def gather_units(self, layer, rows, heads):
        return self._staged(rows)

    def fragment_units(self, layer, rows, heads):
        return self._staged(rows)


def plan_point(name: str, *, layers: int, dense_layers: int, kv_heads: int, head_dim: int, batch: int,
               context: int, budget: int, block_size: int, steps: int, warm: int, trace_name: str) -> dict:
    """Host planning per decode step for one configuration (see the module docstring)."""
    from bench.decode_throughput import load_replay
    from bench.traces import BlockMap, replay_decoder
    from host_offload.placement import SparseKV
    from host_offload.slot_cache import SlotTable
    from pulseinfer_jax import EngineConfig, offload
    from pulseinfer_jax.kept_scores import kept_logical
    from pulseinfer_jax.kv_cache import blocks_for, bucket
    from pulseinfer_jax.pipeline import PipelineConfig, SparseDecoder, StepTables

    cfg = EngineConfig(mode="offload", budget_tokens=budget, block_size=block_size, dense_layers=dense_layers,
                       **CONFIGS[name])
    plan = offload.sparse_plan(cfg, layers, kv_heads)
    total = context + warm + steps + 1
    n_max = blocks_for(total, block_size)
    table = SlotTable(plan.sparse_layers, plan.lanes, plan.slot_blocks, key_rows=1 + batch * n_max)
    sparse, next_gpu = [], 1
    for i in range(batch):
        need = plan.gpu_blocks(total)
        s = SparseKV(plan, i, total, list(range(next_gpu, next_gpu + need)),
                     list(range(1 + i * n_max, 1 + (i + 1) * n_max)), table)
        next_gpu += need
        s.prefill_table(list(range(next_gpu, next_gpu + n_max)), context)
        s.prefill_done(context)
        sparse.append(s)
    nb = next_gpu + n_max
    trace = load_replay(trace_name, budget)[plan.selection]
    dec = SparseDecoder.__new__(replay_decoder(trace))
    dec.plan, dec.nb = plan, nb
    dec.config = PipelineConfig(io=cfg.io, scoring=cfg.scoring)
    dec.model = types.SimpleNamespace(cfg=types.SimpleNamespace(num_kv_heads=kv_heads))
    dec.pool = _StubPool(2 * block_size * kv_heads * head_dim * 2, kv_heads)  # bf16 KV
    dec.replayed_steps, dec.maps = {}, {}
    n0 = blocks_for(context + 1, block_size)
    for s in sparse:
        t0 = int(trace.num_blocks[s.owner % trace.sel.shape[0], 0])
        dec.maps[s.owner] = BlockMap(plan.sink_blocks, t0 - plan.sink_blocks - plan.window_blocks,
                                     n0 - plan.sink_blocks - plan.window_blocks)
    # time the replay's mapping apart from the engine's planning (the base class's _plan_layer and what follows)
    engine_s = [0.0]
    base_plan = SparseDecoder._plan_layer

    def timed_plan(self, *a):
        t = time.perf_counter()
        out = base_plan(self, *a)
        engine_s[0] += time.perf_counter() - t
        return out

    per_step, replay_per_step, hits, recalled = [], [], 0, 0
    for step in range(warm + steps):
        length = context + 1 + step
        for s in sparse:
            s.advance(length)
        lengths = np.full(batch, length, np.int64)
        t_all = time.perf_counter()
        tables = StepTables.of(sparse, lengths, block_size, nb)
        bp = bucket(batch)
        nblk = np.zeros(bp, np.int32)
        nblk[:batch] = blocks_for(length, block_size)
        fixed = kept_logical(nblk, plan.sink_blocks, plan.window_blocks)  # the device's sinks + window
        sel = np.full((bp, plan.lanes, budget // block_size), -1, np.int32)
        sel[:batch, :, : fixed.shape[1]] = fixed[:batch, None, :]
        engine_s[0] = 0.0
        reused0 = sum(s.counters.reused_blocks for s in sparse)
        rec0 = sum(s.counters.recalled_blocks for s in sparse)
        SparseDecoder._plan_layer = timed_plan
        try:
            replay_s = 0.0
            for sl in range(plan.sparse_layers):
                layer = dense_layers + sl
                t = time.perf_counter()
                e0 = engine_s[0]
                lp = dec._plan_layer(sel, sparse, tables, layer, sl)
                replay_s += time.perf_counter() - t - (engine_s[0] - e0)
                staging = dec._issue_recall(sl, lp, sparse)
                if staging is None:
                    lp.pack("all", None)
                else:
                    lp.entries("early")
                    lp.pack("late", staging[1])
        finally:
            SparseDecoder._plan_layer = base_plan
        wall = time.perf_counter() - t_all
        for s in sparse:
            dec.replayed_steps[s.owner] = dec.replayed_steps.get(s.owner, 0) + 1
        if step >= warm:
            per_step.append(wall - replay_s)
            replay_per_step.append(replay_s)
            hits += sum(s.counters.reused_blocks for s in sparse) - reused0
            recalled += sum(s.counters.recalled_blocks for s in sparse) - rec0
    p50 = statistics.median(per_step)
    return {"config": name, **CONFIGS[name], "batch": batch, "context": context, "budget_tokens": budget,
            "sparse_layers": plan.sparse_layers, "lanes": plan.lanes, "slot_blocks": plan.slot_blocks,
            "host_plan_ms_per_step_p50": p50 * 1e3, "host_plan_us_per_layer": p50 / plan.sparse_layers * 1e6,
            "host_plan_ms_per_step_all": [t * 1e3 for t in per_step],
            "replay_mapping_ms_per_step_p50": statistics.median(replay_per_step) * 1e3,
            "slot_hit_rate": hits / max(1, hits + recalled), "recalled_entries_per_step": recalled / steps}


def step_point(system: str, *, batch: int, context: int, budget: int, steps: int, trace_name: str) -> dict:
    """Main-thread CPU time of whole decode steps of a compute-free Llama-3.1-8B skeleton (see the docstring)."""
    from bench import decode_throughput as dt
    from models.loading import load_model
    from models.presets import PRESETS
    from pulseinfer_jax import SamplingParams

    skeleton = "llama-3.1-8b-skeleton"  # 32 layers, 8 KV heads as Llama-3.1-8B; everything else tiny
    PRESETS.setdefault(skeleton, {**PRESETS["llama-3.1-8b"], "vocab_size": 512, "hidden_size": 64,
                                  "intermediate_size": 64, "num_attention_heads": 8, "head_dim": 16})
    model = load_model(f"random:{skeleton}", dtype="float32", layout="layers")
    replay = dt.load_replay(trace_name, budget)
    base = dict(block_size=16, budget_tokens=budget, dense_layers=2, max_batch=batch, progress=False,
                prefill_chunk=512, layer_loop="layerwise")
    eng, _ = dt.engine_for(model, system, base, replay, {})
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_new_tokens=2 * batch + 12 + steps, ignore_eos=True)
    reqs = [eng.make_request(i, rng.integers(1, 500, context).tolist(), sp) for i in range(batch)]
    eng.ensure_pool(reqs)
    for r in reqs:
        eng.scheduler.add(r)
    for _ in range(batch + 10):  # prefills, then warm decode steps (compiles)
        list(eng.step())
    cpu, wall = [], []
    for _ in range(steps):
        t, c = time.perf_counter(), time.thread_time()
        list(eng.step())
        cpu.append(time.thread_time() - c)
        wall.append(time.perf_counter() - t)
    return {"system": system, "batch": batch, "context": context, "budget_tokens": budget,
            "main_thread_cpu_ms_per_step_p50": statistics.median(cpu) * 1e3,
            "wall_ms_per_step_p50": statistics.median(wall) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="plan", choices=("plan", "step", "both"))
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dense-layers", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batches", default="1,8", help="micro-batch sizes (comma list)")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--budget-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--replay", default="smollm2", help="trace name (bench/results/traces) or path prefix")
    ap.add_argument("--step-context", type=int, default=8192, help="--mode step: prompt tokens per request")
    ap.add_argument("--step-systems", default="pulseinfer-no-ioaa,offload-headwise")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the script)")
    ap.add_argument("--name", default="host_overhead_cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.context, args.batches, args.steps, args.warm, args.step_context = 8192, "2", 3, 1, 8192
    rows, step_rows = [], []
    meta = {"kind": "host_overhead", "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
            "python": platform.python_version(), "args": vars(args)}
    if args.mode in ("plan", "both"):
        for name in args.configs.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                row = plan_point(name, layers=args.layers, dense_layers=args.dense_layers, kv_heads=args.kv_heads,
                                 head_dim=args.head_dim, batch=b, context=args.context, budget=args.budget_tokens,
                                 block_size=args.block_size, steps=args.steps, warm=args.warm,
                                 trace_name=args.replay)
                rows.append(row)
                print(f"plan {name:17s} batch {b:3d}: {row['host_plan_ms_per_step_p50']:7.2f} ms/step "
                      f"({row['host_plan_us_per_layer']:6.1f} us/layer), replay mapping "
                      f"{row['replay_mapping_ms_per_step_p50']:6.2f} ms/step, hit {row['slot_hit_rate']:.3f}, "
                      f"{row['recalled_entries_per_step']:.0f} recalled/step", flush=True)
    if args.mode in ("step", "both"):
        for system in args.step_systems.split(","):
            for b in (int(x) for x in args.batches.split(",")):
                row = step_point(system, batch=b, context=args.step_context, budget=args.budget_tokens,
                                 steps=args.steps, trace_name=args.replay)
                step_rows.append(row)
                print(f"step {system:17s} batch {b:3d}: main-thread CPU {row['main_thread_cpu_ms_per_step_p50']:7.1f}"
                      f" ms/step, wall {row['wall_ms_per_step_p50']:7.1f} ms", flush=True)
    path = write_result(args.name, {**meta, "plan": rows, "step": step_rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
