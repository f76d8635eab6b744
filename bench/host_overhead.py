"""Host-side cost of a sparse decode step: what the Python driver spends per step, without a GPU.

    python bench/host_overhead.py                  # 1 and 8 requests of 8K tokens, budget 2,048, two systems
    python bench/host_overhead.py --smoke          # tiny sizes (script check)

Per decode step the driver builds the step's inputs, dispatches the step's program (`runner/sparse_step.py`; the
same-layer ablations: a few calls per layer), reads the step's plan back and issues its recall. On a GPU the host
must do that faster than the GPU computes the step, or the GPU idles. This bench runs whole decode steps of the
engine (`bench/decode_throughput.py`'s engines, the SmolLM2 selections replayed) on a model with Llama-3.1-8B's
layer count and KV heads but tiny widths, so that the device work is small, and reports the main thread's CPU time
per step (`time.thread_time`: the driver's Python, numpy and JAX dispatch; XLA's compute threads are not counted)
and the wall time. `--points` runs the GPU suite's points at their own batch, prompt length, budget, KV dtype and
vocabulary. Steps that compiled are not timed; the replayed selector's own host work (building each step's replayed
selection) is timed apart and left out of `driver_cpu_ms_per_step_p50`, which bench/predict.py reads. On a 2-core
CPU XLA:CPU still runs some work inline and competes for the cores: compare versions of the driver on the same
machine with it, not with a GPU.

History: until commit 9efdaf0 the slot caches were planned on the host (numpy over the micro-batch, the
reference `selection.slot_table.SlotTable`); `git checkout 9efdaf0 && python bench/host_overhead.py` measures
that planner alone (its `--mode plan`). The plan now runs on the device (`pulseinfer_jax/selection/slot_plan.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import platform
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.common import write_result  # noqa: E402


class Isolated:
    """During a `with` block every layer call of the step (sparse_layer) waits for its outputs, and every recall for its
    gather and copy, before the driver goes on. Waiting costs the main thread no CPU, so its CPU time is then the
    driver's own (Python, numpy, JAX dispatch, and XLA:CPU's start of each program) without this 2-core machine's
    cores shared with the device work and the recall thread: what a GPU host's driver thread spends, whose device work
    runs on the GPU and whose recall thread has a core of its own (a GPU launch costs the host less than XLA:CPU's start
    of a program)."""

    CALLS = ("ahead_layer", "dense_layer", "embed", "logits", "sparse_pre", "attend", "land_attend_finish", "land")
    STEP_CALLS = ("ahead_step", "land_step")  # (runner/sparse_step.py: the one-program step)

    def __enter__(self):
        import jax
        from pulseinfer_jax.host_offload.host_pool import HostKVPool

        from pulseinfer_jax.runner import sparse_layer, sparse_step

        def waiting(fn):
            def call(*args, **kwargs):
                return jax.block_until_ready(fn(*args, **kwargs))
            return call

        def submit(pool, stage, _submit=HostKVPool._submit):
            recall = _submit(pool, stage)
            recall.result()[0].block_until_ready()  # (on the recall thread: its CPU is not the driver's)
            return recall

        self._saved = [(sparse_layer, n, getattr(sparse_layer, n)) for n in self.CALLS]
        self._saved += [(sparse_step, n, getattr(sparse_step, n)) for n in self.STEP_CALLS]
        self._saved.append((HostKVPool, "_submit", HostKVPool._submit))
        for owner, name, fn in self._saved[:-1]:
            setattr(owner, name, waiting(fn))
        HostKVPool._submit = submit
        return self

    def __exit__(self, *exc):
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)


class Breakdown:
    """Main-thread CPU time per call of the driver's per-layer work during a `with` block: the layer calls
    (sparse_layer), the decoder's host steps and the host pool's transfers, wrapped (and restored on exit). Nested:
    the pool's calls run inside `_issue_recall` (and stage_blocks inside gather_blocks); every call includes
    whatever XLA:CPU ran on the calling thread."""

    TARGETS = (("sparse_layer", ("sparse_pre", "attend", "land_attend_finish", "ahead_layer", "dense_layer", "embed",
                                 "logits")),
               ("sparse_step", ("ahead_step", "land_step")),
               ("SparseDecoder", ("decode", "_issue_recall", "_issue_step_recall", "_read_plan", "_step_inputs",
                                  "_prepare_slots", "_refresh_meta")),
               ("HostKVPool", ("gather_blocks", "stage_blocks", "recall_step", "write_back")))

    def __init__(self):
        from pulseinfer_jax.host_offload.host_pool import HostKVPool

        from pulseinfer_jax.runner import sparse_layer, sparse_step
        from pulseinfer_jax.runner.sparse_decoder import SparseDecoder

        owners = {"sparse_layer": sparse_layer, "sparse_step": sparse_step, "SparseDecoder": SparseDecoder,
                  "HostKVPool": HostKVPool}
        self.sites = [(owners[o], o, n) for o, names in self.TARGETS for n in names]
        self.cpu_s: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def _wrap(self, fn, label: str):
        def timed(*args, **kwargs):
            c = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu_s[label] = self.cpu_s.get(label, 0.0) + time.thread_time() - c
                self.calls[label] = self.calls.get(label, 0) + 1
        return timed

    def __enter__(self):
        self._saved = [(owner, name, getattr(owner, name)) for owner, _, name in self.sites]
        for owner, label, name in self.sites:
            setattr(owner, name, self._wrap(getattr(owner, name), f"{label}.{name}"))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)

    def rows(self, steps: int) -> list[dict]:
        order = sorted(self.cpu_s.items(), key=lambda kv: -kv[1])
        return [{"call": k, "cpu_ms_per_step": v / steps * 1e3, "calls_per_step": self.calls[k] / steps,
                 "cpu_us_per_call": v / self.calls[k] * 1e6} for k, v in order]


def skeleton_model(vocab: int, head_dim: int, dtype: str):
    """Llama-3.1-8B's 32 layers, 8 KV heads and (`vocab`) vocabulary with every width tiny (`head_dim`): the driver
    handles the same arrays per step (block tables, plans, token ids) while the device work is small."""
    from pulseinfer_jax.models.loading import load_model
    from pulseinfer_jax.models.presets import PRESETS

    name = f"llama-3.1-8b-skeleton-v{vocab}-hd{head_dim}"
    PRESETS.setdefault(name, {**PRESETS["llama-3.1-8b"], "vocab_size": vocab, "hidden_size": 64,
                              "intermediate_size": 64, "num_attention_heads": 8, "head_dim": head_dim})
    return load_model(f"random:{name}", dtype=dtype, layout="layers")


def step_point(system: str, *, batch: int, context: int, budget: int, steps: int, warm: int, trace_name: str,
               host_io: str = "auto", breakdown: bool = False, recall: str | None = None,
               isolated: bool = False, vocab: int = 512, head_dim: int = 16, dtype: str = "float32",
               kv_dtype: str = "auto") -> dict:
    """Main-thread CPU time of whole decode steps of a compute-free Llama-3.1-8B skeleton (see the docstring)."""
    from bench import decode_throughput as dt
    from pulseinfer_jax import SamplingParams
    from pulseinfer_jax.engine.compile_clock import compile_seconds

    model = skeleton_model(vocab, head_dim, dtype)
    replay = dt.load_replay(trace_name, budget)
    base = dict(block_size=16, budget_tokens=budget, dense_layers=2, max_batch=batch, progress=False,
                prefill_chunk=512, layer_loop="layerwise", host_io=host_io, kv_dtype=kv_dtype)
    eng, _ = dt.engine_for(model, system, base, replay, {}, overrides=None if recall is None else {"recall": recall})
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_new_tokens=batch + warm + steps + 2, ignore_eos=True)
    reqs = [eng.make_request(i, rng.integers(1, 500, context).tolist(), sp) for i in range(batch)]
    eng.ensure_pool(reqs)
    for r in reqs:
        eng.scheduler.add(r)
    for _ in range(batch + warm):  # prefills, then warm decode steps (compiles)
        list(eng.step())
    compiles = dt.CompileCounter()
    cpu, wall, replay_cpu, compiled = [], [], [], 0
    split = Breakdown() if breakdown else None
    replay_clock = ReplayClock(eng.selector)
    with split or contextlib.nullcontext(), Isolated() if isolated else contextlib.nullcontext():
        while len(cpu) < steps and compiled < steps:  # a step that compiled is not timed (another one runs)
            t, c, c0, r0 = time.perf_counter(), time.thread_time(), compile_seconds(), replay_clock.cpu_s
            list(eng.step())
            if compile_seconds() > c0:
                compiled += 1
                continue
            cpu.append(time.thread_time() - c)
            wall.append(time.perf_counter() - t)
            replay_cpu.append(replay_clock.cpu_s - r0)
    extra = {"breakdown": split.rows(len(cpu) + compiled)} if split else {}
    driver = [a - b for a, b in zip(cpu, replay_cpu, strict=True)]
    return {"system": system, "recall": eng.config.ablation.recall, "host_io": eng.host_io, "isolated": isolated,
            "batch": batch, "vocab": vocab, "head_dim": head_dim, "kv_dtype": kv_dtype,
            "context": context, "budget_tokens": budget,
            "main_thread_cpu_ms_per_step_p50": statistics.median(cpu) * 1e3,
            "main_thread_cpu_ms_per_step_min": min(cpu) * 1e3,
            "replay_cpu_ms_per_step_p50": statistics.median(replay_cpu) * 1e3,
            "driver_cpu_ms_per_step_p50": statistics.median(driver) * 1e3,
            "wall_ms_per_step_p50": statistics.median(wall) * 1e3, "timed_steps": len(cpu),
            "compiled_steps_skipped": compiled, "compiles_in_timed_steps": compiles.count, **extra}


class ReplayClock:
    """Main-thread CPU time spent in the replayed selector's hooks (bench/traces.py: building each step's replayed
    selection on the host), which an engine selecting on the device does not spend: `driver_cpu_ms_per_step` leaves
    it out."""

    HOOKS = ("begin_step", "override", "observe", "end_step")

    def __init__(self, selector):
        self.cpu_s = 0.0
        for name in self.HOOKS if selector is not None else ():
            setattr(selector, name, self._timed(getattr(selector, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            c = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu_s += time.thread_time() - c
        return timed


def point_shapes(name: str) -> dict:
    """`step_point`'s shapes at GPU-suite point `name`: PulseInfer's offloaded batch there (IOAA's placement on the
    H200, as bench/predict.py computes it), the prompt, budget and KV dtype, Llama-3.1's vocabulary, bfloat16."""
    from pulseinfer_jax.models.config import ModelConfig
    from pulseinfer_jax.models.presets import PRESETS

    from bench import predict
    from bench.points import POINTS

    p = POINTS[name]
    cfg, _, new = predict._engine_config("pulseinfer", name)
    model_cfg = ModelConfig.from_hf_dict(PRESETS["llama-3.1-8b"], name="llama-3.1-8b")
    placements, _ = predict.admission(cfg, model_cfg, [p.context] * p.batch, new, predict.DEFAULT_H2D)
    return dict(batch=placements.count("offload"), context=p.context, budget=p.budget_tokens, vocab=128256,
                head_dim=16, dtype=p.dtype, kv_dtype=p.kv_dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default="pulseinfer-no-ioaa,offload-headwise",
                    help="bench/decode_throughput.py systems (comma list)")
    ap.add_argument("--batches", default="1,8", help="requests per point (comma list)")
    ap.add_argument("--context", type=int, default=8192, help="prompt tokens per request (synthetic KV)")
    ap.add_argument("--budget-tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warm", type=int, default=16, help="untimed decode steps first (they compile)")
    ap.add_argument("--host-io", default="auto", choices=("auto", "xla", "numpy", "numpy-pinned"),
                    help="host KV pool backend (EngineConfig.host_io)")
    ap.add_argument("--replay", default="smollm2", help="trace name (bench/results/traces) or path prefix")
    ap.add_argument("--recall", default=None, choices=("ahead", "interruptible", "eager", "sync"),
                    help="EngineConfig.recall for every system (default: each system's own)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time each per-layer call (Breakdown: wrapped calls, a little slower)")
    ap.add_argument("--isolated", action="store_true",
                    help="each layer call and recall waited for before the driver goes on (Isolated): the driver's own "
                    "CPU, without the device work and the recall thread competing for this machine's cores")
    ap.add_argument("--points", default=None,
                    help="GPU-suite points (bench/points.py, comma list) instead of --batches/--context: each point's "
                    "offloaded batch, prompt length, budget and KV dtype, the real vocabulary (128,256), head_dim 16 "
                    "(the smallest the kernels take); rows carry the point. C and D take 15-22 GiB of RAM and a "
                    "process keeps some of each point's: on a 24 GiB machine run them apart from A and B")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the script)")
    ap.add_argument("--name", default="host_overhead_cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.batches, args.steps, args.warm = "2", 3, 3
    meta = {"kind": "host_overhead", "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
            "python": platform.python_version(), "args": vars(args), "rows": []}
    runs = [(None, dict(batch=int(b), context=args.context, budget=args.budget_tokens))
            for b in args.batches.split(",")]
    if args.points:
        runs = [(name, point_shapes(name)) for name in args.points.split(",")]
    for system in args.systems.split(","):
        for point, shape in runs:
            b = shape["batch"]
            row = step_point(system, steps=args.steps, warm=args.warm, trace_name=args.replay, host_io=args.host_io,
                             breakdown=args.breakdown, recall=args.recall, isolated=args.isolated, **shape)
            if point is not None:
                row["point"] = point
            meta["rows"].append(row)
            path = write_result(args.name, meta, args.out)  # (after each row: a run killed later keeps these)
            cpu, low = row["main_thread_cpu_ms_per_step_p50"], row["main_thread_cpu_ms_per_step_min"]
            print(f"{system:20s} {row['host_io']:5s} batch {b:3d}: main-thread CPU {cpu:7.1f} ms/step (min {low:6.1f};"
                  f" driver {row['driver_cpu_ms_per_step_p50']:7.1f} ms without the replay's"
                  f" {row['replay_cpu_ms_per_step_p50']:5.1f}), wall {row['wall_ms_per_step_p50']:7.1f} ms,"
                  f" {row['timed_steps']} timed ({row['compiled_steps_skipped']} compiled)", flush=True)
            for part in row.get("breakdown", []):
                print(f"    {part['call']:30s} {part['cpu_ms_per_step']:7.2f} ms/step {part['calls_per_step']:6.1f} "
                      f"calls {part['cpu_us_per_call']:7.1f} us/call", flush=True)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
