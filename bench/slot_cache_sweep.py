"""Slot-cache size against reuse, replayed from recorded selections (no model, seconds on CPU).

    python bench/slot_cache_sweep.py                                   # every trace in bench/results/traces
    python bench/slot_cache_sweep.py bench/results/traces/smollm2_solohead_b1024.npz --sizes 1,1.5,2,4

Without the resident-block bonus (`EngineConfig.resident_bonus=0`) which blocks a step selects does not depend on
the slot cache (selection scores every middle block; the cache only decides what must be recalled), so a trace
recorded that way (`bench/selection_trace.py --resident-bonus 0`, `bench/traces.py`) replays exactly through the
engine's own LRU (`host_offload.slot_cache.SlotCache`) at any capacity. A trace recorded with the bonus (the
engine's default; its meta says) selected with its own cache's contents, so at another capacity the replay only
approximates what the engine would do (each row says `resident_bonus`). For each trace and
capacity (a multiple of the selection's middle blocks, capped like the engine at the request's middle blocks)
it reports the hit rate and the blocks recalled per step over the warm steps (the first step starts cold and is
excluded, as in selection_trace), and the GPU cost of the cache: capacity x one block of every sparse layer.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import RESULTS, write_result  # noqa: E402
from bench.traces import Trace, load_trace  # noqa: E402
from pulseinfer_jax.selection.slot_table import SlotCache  # noqa: E402


def replay_lru(tr: Trace, multiple: float) -> dict:
    """Hit rate and recalls per step of trace `tr` under an LRU slot cache of `multiple` x the middle blocks."""
    m = tr.meta
    r_count, t_count, ls, lanes, _ = tr.sel.shape
    middle = tr.middle_blocks
    hits = misses = 0
    for r in range(r_count):
        n_mid = int(tr.num_blocks[r, 0]) - m["sink_blocks"] - m["window_blocks"]
        cap = max(middle, min(round(multiple * middle), n_mid)) if multiple >= 1 else middle
        caches = [[SlotCache(cap) for _ in range(lanes)] for _ in range(ls)]
        for t in range(t_count):
            for sl in range(ls):
                for lane in range(lanes):
                    want = [int(j) for j in tr.sel[r, t, sl, lane] if j >= 0]
                    h, miss = caches[sl][lane].plan(want)
                    if t > 0:
                        hits += len(h)
                        misses += len(miss)
    return {"multiple": multiple, "hit_rate": hits / (hits + misses) if hits + misses else None,
            "recalled_per_step": misses / max(1, t_count - 1)}


def trace_bonus(tr: Trace) -> float:
    """The resident-block bonus a trace was recorded with (0 for traces from before it existed: no "scoring" meta
    or no "resident_bonus" in it)."""
    return float(tr.meta.get("scoring", {}).get("resident_bonus", 0.0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*", type=pathlib.Path)
    ap.add_argument("--sizes", default="1,1.25,1.5,2,3,4", help="capacities as multiples of the middle blocks")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    paths = args.traces or sorted((RESULTS / "traces").glob("*.npz"))
    if not paths:
        raise SystemExit("no traces: record some with bench/selection_trace.py or pass .npz paths")
    sizes = [float(x) for x in args.sizes.split(",")]
    rows = []
    for path in paths:
        tr = load_trace(path)
        for mult in sizes:
            row = {"trace": path.name, "selection": tr.meta["selection"], "budget_blocks": tr.meta["budget_blocks"],
                   "resident_bonus": trace_bonus(tr), **replay_lru(tr, mult)}
            rows.append(row)
            print(f"{path.name:32s} x{mult:<5} hit {row['hit_rate']:.3f}, recalled {row['recalled_per_step']:7.1f} "
                  "per step (all requests, layers, lanes)", flush=True)
    path = write_result("slot_cache_sweep_cpu", {"kind": "slot_cache_sweep", "rows": rows}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
