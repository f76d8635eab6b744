"""Time one mixture-of-experts layer's expert matmuls by strategy ("dense": every expert, "gather": the picked
ones; models/moe.py) across token counts, at a real config's shapes with random weights.

    python bench/moe_ffn.py                                  # Qwen3-30B-A3B, bf16, 1..64 tokens
    python bench/moe_ffn.py --tokens 1,4,16 --repeats 5 --out bench/results

Reports the median time per call and the expert-weight bytes each strategy reads (dense: all E experts; gather:
the n * k picked slices, repeats included), and which strategy `moe_strategy` picks: the point is where the two
cross (n * k = E in bytes read) and whether the automatic choice sits on the faster side.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.moe import experts_ffn, moe_strategy, route
from models.presets import PRESETS


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", help="a mixture-of-experts preset (models/presets.py)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
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
    calls = {s: jax.jit(lambda x, i, w, gu, dn, s=s: experts_ffn(x, i, w, gu, dn, s)) for s in ("dense", "gather")}
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        x = jax.random.normal(jax.random.fold_in(keys[3], n), (n, d), jnp.float32).astype(dtype)
        idx, w = route(x, router, k, cfg.norm_topk_prob)
        row = {"tokens": n, "picked_pairs": n * k, "distinct_experts": int(np.unique(np.asarray(idx)).size),
               "auto": moe_strategy(n, k, e)}
        for s, fn in calls.items():
            fn(x, idx, w, gate_up, down).block_until_ready()  # compile
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                fn(x, idx, w, gate_up, down).block_until_ready()
                times.append(time.perf_counter() - t0)
            row[f"{s}_ms"] = round(1e3 * float(np.median(times)), 3)
            row[f"{s}_weight_bytes"] = (e if s == "dense" else n * k) * slice_bytes
        row["faster"] = min(calls, key=lambda s: row[f"{s}_ms"])
        rows.append(row)
        print(f"n {n:3d} (n*k {n * k:4d}, {row['distinct_experts']:3d} experts): dense {row['dense_ms']:9.3f} ms, "
              f"gather {row['gather_ms']:9.3f} ms -> faster {row['faster']}, auto {row['auto']}")
    result = {
        "bench": "moe_ffn", "model": args.model, "dtype": args.dtype, "experts": e, "top_k": k,
        "hidden": d, "expert_width": f, "rows": rows, "device": str(jax.devices()[0].device_kind),
        "platform": jax.devices()[0].platform, "host": platform.node(), "jax": jax.__version__,
        "date": datetime.date.today().isoformat(),
        "command": "python bench/moe_ffn.py " + " ".join(f"--{k_} {v}" for k_, v in vars(args).items()
                                                         if v is not None and k_ != "out"),
    }
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"moe_ffn_{result['platform']}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
