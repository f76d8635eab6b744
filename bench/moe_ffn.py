"""Time one mixture-of-experts layer's expert matmuls by strategy across token counts (models/moe.py): "dense"
(every expert on every token), "gather" (the picked experts' weights gathered per token), "grouped" (pairs sorted
by expert into tiles, jnp tile loop) and, on a GPU, "grouped-pallas" (the same tiles through
pallas_kernels/grouped_matmul.py), at a real config's shapes with random weights.

    python bench/moe_ffn.py                                  # Qwen3-30B-A3B, bf16, 1..4096 tokens
    python bench/moe_ffn.py --tokens 1,4,16 --repeats 5 --out bench/results

Reports the median time per call, the expert-weight bytes each strategy reads, and which strategy
`moe_strategy` picks: the point is where they cross and whether the automatic choice sits on the fastest side.
A strategy is skipped (null) where its scratch would pass --max-scratch-gb (gather copies n*k expert slices).
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from pulseinfer_jax.models.config import ModelConfig  # noqa: E402
from pulseinfer_jax.models.moe import MoEOptions, experts_ffn, grouped_tile_m, grouped_tiles, route  # noqa: E402
from pulseinfer_jax.models.presets import PRESETS  # noqa: E402

from bench.common import write_result  # noqa: E402

STRATEGIES = ("dense", "gather", "grouped", "grouped-pallas")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", help="a mixture-of-experts preset (models/presets.py)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,256,1024,4096")
    ap.add_argument("--strategies", default=None,
                    help="comma list of " + ", ".join(STRATEGIES) + " (default: all but grouped-pallas off a GPU)")
    ap.add_argument("--max-scratch-gb", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = ModelConfig.from_hf_dict(PRESETS[args.model], name=args.model)
    if not cfg.is_moe:
        ap.error(f"{args.model} is not a mixture of experts")
    dtype = jnp.dtype(args.dtype)
    d, e, f, k = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    keys = jax.random.split(jax.random.key(0), 4)
    router = (jax.random.normal(keys[0], (d, e), jnp.float32) * 0.02).astype(dtype)
    gate_up = (jax.random.normal(keys[1], (d, e, 2 * f), jnp.float32) * 0.02).astype(dtype)
    down = (jax.random.normal(keys[2], (e, f, d), jnp.float32) * 0.02).astype(dtype)
    slice_bytes = 3 * d * f * dtype.itemsize  # one expert's gate, up and down
    strategies = args.strategies.split(",") if args.strategies else (
        ["dense", "gather", "grouped"] + (["grouped-pallas"] if jax.default_backend() == "gpu" else []))
    unknown = set(strategies) - set(STRATEGIES)
    if unknown:
        ap.error(f"unknown strategies {sorted(unknown)}; use {', '.join(STRATEGIES)}")
    calls = {s: jax.jit(functools.partial(experts_ffn, strategy=s.split("-")[0],
                                          grouped_kernel="pallas" if s.endswith("pallas") else "jnp"))
             for s in strategies}
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        x = jax.random.normal(jax.random.fold_in(keys[3], n), (n, d), jnp.float32).astype(dtype)
        idx, w = route(x, router, k, cfg.norm_topk_prob)
        distinct = int(np.unique(np.asarray(idx)).size)
        tile_m = grouped_tile_m(n * k, e)
        row = {"tokens": n, "picked_pairs": n * k, "distinct_experts": distinct, "auto": MoEOptions().resolve(n, k, e),
               "grouped_tile_m": tile_m}
        scratch = {"dense": n * e * 3 * f, "gather": n * k * 3 * d * f}  # elements of the biggest temporaries
        tiles = grouped_tiles(n * k, e, tile_m)
        weight_reads = {"dense": e, "gather": n * k, "grouped": tiles, "grouped-pallas": tiles}  # expert slices
        for s, fn in calls.items():
            row[f"{s}_weight_bytes"] = weight_reads[s] * slice_bytes
            if scratch.get(s, 0) * dtype.itemsize > args.max_scratch_gb * 2**30:
                row[f"{s}_ms"] = None
                continue
            fn(x, idx, w, gate_up, down).block_until_ready()  # compile
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn(x, idx, w, gate_up, down).block_until_ready()
                times.append(time.perf_counter() - t0)
            row[f"{s}_ms"] = round(1e3 * float(np.median(times)), 3)
        timed = [s for s in calls if row[f"{s}_ms"] is not None]
        row["faster"] = min(timed, key=lambda s: row[f"{s}_ms"])
        rows.append(row)
        print(f"n {n:4d} (n*k {n * k:5d}, {distinct:3d} experts): "
              + ", ".join(f"{s} {row[f'{s}_ms'] if row[f'{s}_ms'] is not None else '-'} ms" for s in calls)
              + f" -> fastest {row['faster']}, auto {row['auto']}", flush=True)
    result = {
        "bench": "moe_ffn", "model": args.model, "dtype": args.dtype, "experts": e, "top_k": k,
        "hidden": d, "expert_width": f, "rows": rows, "device": str(jax.devices()[0].device_kind),
        "platform": jax.devices()[0].platform, "jax": jax.__version__,
    }
    if args.out:
        path = write_result(f"moe_ffn_{result['platform']}", result, args.out)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
