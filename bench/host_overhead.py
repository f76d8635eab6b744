"""Host-side cost of a sparse decode step: what the Python driver spends per step, without a GPU.

    python bench/host_overhead.py                  # 1 and 8 requests of 8K tokens, budget 2,048, two systems
    python bench/host_overhead.py --smoke          # tiny sizes (script check)

The layer-wise pipeline drives every layer from Python: per sparse layer it dispatches the selection call, reads
the layer's recall list back, issues the recall and dispatches the attention calls. On a GPU the host must do all
of that faster than the GPU computes the layer, or the GPU idles. This bench runs whole decode steps of the engine
(`bench/decode_throughput.py`'s engines, the SmolLM2 selections replayed) on a model with Llama-3.1-8B's layer
count and KV heads but tiny widths, so that the device work is small, and reports the main thread's CPU time per
step (`time.thread_time`: the driver's Python, numpy and JAX dispatch; XLA's compute threads are not counted) and
the wall time. On a 2-core CPU XLA:CPU still runs some work inline and competes for the cores: compare versions of
the driver on the same machine with it, not with a GPU.

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


def step_point(system: str, *, batch: int, context: int, budget: int, steps: int, warm: int, trace_name: str,
               host_io: str = "auto", breakdown: bool = False, recall: str | None = None,
               isolated: bool = False) -> dict:
    """Main-thread CPU time of whole decode steps of a compute-free Llama-3.1-8B skeleton (see the docstring)."""
    from pulseinfer_jax.models.loading import load_model
    from pulseinfer_jax.models.presets import PRESETS

    from bench import decode_throughput as dt
    from pulseinfer_jax import SamplingParams

    skeleton = "llama-3.1-8b-skeleton"  # 32 layers, 8 KV heads as Llama-3.1-8B; everything else tiny
    PRESETS.setdefault(skeleton, {**PRESETS["llama-3.1-8b"], "vocab_size": 512, "hidden_size": 64,
                                  "intermediate_size": 64, "num_attention_heads": 8, "head_dim": 16})
    model = load_model(f"random:{skeleton}", dtype="float32", layout="layers")
    replay = dt.load_replay(trace_name, budget)
    base = dict(block_size=16, budget_tokens=budget, dense_layers=2, max_batch=batch, progress=False,
                prefill_chunk=512, layer_loop="layerwise", host_io=host_io)
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
    cpu, wall = [], []
    split = Breakdown() if breakdown else None
    with split or contextlib.nullcontext(), Isolated() if isolated else contextlib.nullcontext():
        for _ in range(steps):
            t, c = time.perf_counter(), time.thread_time()
            list(eng.step())
            cpu.append(time.thread_time() - c)
            wall.append(time.perf_counter() - t)
    extra = {"breakdown": split.rows(steps)} if split else {}
    return {"system": system, "recall": eng.config.ablation.recall, "host_io": eng.host_io, "isolated": isolated,
            "batch": batch,
            "context": context, "budget_tokens": budget,
            "main_thread_cpu_ms_per_step_p50": statistics.median(cpu) * 1e3,
            "main_thread_cpu_ms_per_step_min": min(cpu) * 1e3,
            "wall_ms_per_step_p50": statistics.median(wall) * 1e3, "compiles_in_timed_steps": compiles.count, **extra}


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
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the script)")
    ap.add_argument("--name", default="host_overhead_cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.batches, args.steps, args.warm = "2", 3, 3
    meta = {"kind": "host_overhead", "machine": f"{platform.node()} {platform.processor() or platform.machine()}",
            "python": platform.python_version(), "args": vars(args), "rows": []}
    for system in args.systems.split(","):
        for b in (int(x) for x in args.batches.split(",")):
            row = step_point(system, batch=b, context=args.context, budget=args.budget_tokens, steps=args.steps,
                             warm=args.warm, trace_name=args.replay, host_io=args.host_io,
                             breakdown=args.breakdown, recall=args.recall, isolated=args.isolated)
            meta["rows"].append(row)
            cpu, low = row["main_thread_cpu_ms_per_step_p50"], row["main_thread_cpu_ms_per_step_min"]
            print(f"{system:20s} {row['host_io']:5s} batch {b:3d}: main-thread CPU {cpu:7.1f} ms/step (min {low:6.1f}),"
                  f" wall {row['wall_ms_per_step_p50']:7.1f} ms, compiles {row['compiles_in_timed_steps']}", flush=True)
            for part in row.get("breakdown", []):
                print(f"    {part['call']:30s} {part['cpu_ms_per_step']:7.2f} ms/step {part['calls_per_step']:6.1f} "
                      f"calls {part['cpu_us_per_call']:7.1f} us/call", flush=True)
    path = write_result(args.name, meta, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
