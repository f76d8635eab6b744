"""Stress of the sparse decode kernel's split-K merge inside the kernel (memory ordering of its arrival counters).

    python bench/merge_stress.py --out DIR_OR_JSON           # GPU: many splits, sequences and heads, 200 iterations
    python bench/merge_stress.py --smoke --out DIR_OR_JSON   # CPU, Pallas interpret mode, tiny shapes: the script only

Each case (split count x list layout x launch order) runs `sparse_decode_attention` with the merge inside the kernel
(`_merge_last`: the last program of each (sequence, KV head) to count itself in an atomic arrival counter merges
every split) `--iters` times in a row, the counters handed from call to call in one donated buffer as the sparse
decoder does, so thousands of programs race on reused counters. The queries cycle through `--variants` sets, so a
merge that read another call's stale partial would differ. Every iteration is checked on the device: its attention
against the jnp reference (`sparse_decode_attention_reference`, float32) within the dtype's tolerance, bit for bit
against the first output of the same queries (the merge is deterministic: splits joined in split order whoever
merges), and its counters all 0 again. A case fails on any bad iteration or counter left set; the script exits 1
then. Lists: "solohead" lists every block of each sequence (every program the same work, arrivals close together),
"headwise" a random ~70% of them per KV head with padding between (uneven work, arrivals shuffled). Launch orders:
"identity" (the engine's), "reversed" / "strided" (`program_order`: which program computes which split; interpret
mode, which runs programs in launch order, needs them to make a split other than the last arrive last).
The JSON (through bench.common.write_result) has every case's shape, iterations, bad iterations, counters left and
the largest error; the rows are printed as a table.
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jaxtyping import Array, Float, Int  # noqa: E402
from pulseinfer_jax.pallas_kernels.sparse_decode_attention import (  # noqa: E402
    MAX_SPLIT_K,
    sparse_decode_attention,
    sparse_decode_attention_reference,
)

from bench.common import write_result  # noqa: E402

TOL = {"float32": 1e-4, "bfloat16": 2e-2}  # max |o - reference| (values of order 1)
LAYOUTS = ("solohead", "headwise")
ORDERS = ("identity", "reversed", "strided")


def program_order(name: str, programs: int) -> tuple[int, int] | None:
    """`sparse_decode_attention`'s program_order for a launch order name over `programs` programs."""
    if name == "identity":
        return None
    if name == "reversed":
        return (programs - 1, programs - 1)
    # a stride near N / 3, coprime to N: consecutive launches compute far-apart programs of different rows
    stride = next(s for s in range(programs // 3 + 1, programs + 1) if math.gcd(s, programs) == 1)
    return (stride % programs or 1, 3 % programs)


def make_inputs(rng: np.random.Generator, *, batch: int, kv_heads: int, group: int, head_dim: int, block_size: int,
                blocks: int, layout: str, variants: int, dtype) -> tuple[list[Array], Array, Array, Array]:
    """`variants` query sets [B, Hq, hd] and one pool [NB, 2, bs, Hkv, hd] (NaN in block 0, never listed) with
    `blocks` shuffled blocks per sequence, listed whole (solohead: [B, 1, K]) or a random ~70% per KV head with -1
    padding between (headwise: [B, Hkv, K]); every block full."""
    nb = 1 + batch * blocks
    pool = rng.standard_normal((nb, 2, block_size, kv_heads, head_dim)).astype(np.float32)
    pool[0] = np.nan
    tables = 1 + rng.permutation(batch * blocks).reshape(batch, blocks).astype(np.int32)
    lens = np.full((batch, 1, blocks), block_size, np.int32)
    ids = tables[:, None, :]
    if layout == "headwise":
        keep = rng.random((batch, kv_heads, blocks)) < 0.7
        keep[..., 0] = True  # (every list attends something)
        ids = np.where(keep, np.broadcast_to(ids, keep.shape), -1).astype(np.int32)
        lens = np.where(keep, block_size, 0).astype(np.int32)
    qs = [jnp.asarray(rng.standard_normal((batch, kv_heads * group, head_dim)), dtype) for _ in range(variants)]
    return qs, jnp.asarray(pool, dtype), jnp.asarray(ids), jnp.asarray(lens)


@functools.partial(jax.jit, static_argnames=("split_k", "blocks_per_step", "order", "interpret"),
                   donate_argnames=("counters",))
def stress_step(
    counters: Int[Array, " N"],
    q: Float[Array, "B Hq hd"],
    pool: Float[Array, "NB 2 bs Hkv hd"],
    ids: Int[Array, "B S K"],
    lens: Int[Array, "B S K"],
    ref: Float[Array, "B Hq hd"],
    first: Float[Array, "B Hq hd"],
    *,
    split_k: int,
    blocks_per_step: int | None,
    order: tuple[int, int] | None,
    interpret: bool | None,
) -> tuple[Array, Array, Array, Array, Array]:
    """One call of the kernel with the counters donated, checked on the device: (counters, o, max |o - ref| (inf
    where o is not finite), counters not 0, whether o differs bit for bit from `first`)."""
    o, _, _, counters = sparse_decode_attention(q, pool, ids, lens, counters, split_k=split_k,
                                                blocks_per_step=blocks_per_step, program_order=order,
                                                interpret=interpret)
    o32 = o.astype(jnp.float32)
    err = jnp.max(jnp.where(jnp.isfinite(o32), jnp.abs(o32 - ref), jnp.inf))
    bits = jnp.uint16 if o.dtype.itemsize == 2 else jnp.uint32
    differs = jnp.any(jax.lax.bitcast_convert_type(o, bits) != jax.lax.bitcast_convert_type(first, bits))
    return counters, o, err, jnp.count_nonzero(counters), differs


def run_case(args, rng: np.random.Generator, *, split_k: int, layout: str, order_name: str) -> dict:
    dtype = jnp.dtype(args.dtype)
    bps = args.blocks_per_step
    per_step = bps or max(1, 64 // args.block_size)  # (the kernel's default: about 64 tokens a step)
    blocks = split_k * args.steps_per_split * per_step
    qs, pool, ids, lens = make_inputs(rng, batch=args.batch, kv_heads=args.kv_heads, group=args.group,
                                      head_dim=args.head_dim, block_size=args.block_size, blocks=blocks,
                                      layout=layout, variants=args.variants, dtype=dtype)
    programs = args.batch * args.kv_heads * split_k
    order = program_order(order_name, programs)
    refs = [sparse_decode_attention_reference(q.astype(jnp.float32), pool.astype(jnp.float32), ids, lens)[0]
            for q in qs]
    interpret = True if args.smoke else None
    step = functools.partial(stress_step, split_k=split_k, blocks_per_step=bps, order=order, interpret=interpret)
    counters = jnp.zeros((args.batch * args.kv_heads,), jnp.int32)
    t0 = time.perf_counter()
    firsts, checks = [], []
    for i in range(args.iters):
        v = i % len(qs)
        first = firsts[v] if v < len(firsts) else jnp.zeros(qs[v].shape, dtype)
        counters, o, err, left, differs = step(counters, qs[v], pool, ids, lens, refs[v], first)
        if v == len(firsts):  # (the first output of these queries: the later ones must equal it bit for bit)
            firsts.append(o)
            differs = jnp.bool_(False)
        checks.append((err, left, differs))
    errs, lefts, diffs = (np.asarray(jnp.stack(c)) for c in zip(*checks, strict=True))
    seconds = time.perf_counter() - t0
    tol = TOL[dtype.name]
    bad = (errs > tol) | (lefts != 0) | diffs
    return {"split_k": split_k, "layout": layout, "order": order_name, "program_order": order, "batch": args.batch,
            "kv_heads": args.kv_heads, "group": args.group, "head_dim": args.head_dim,
            "block_size": args.block_size, "blocks_per_list": blocks, "programs": programs, "dtype": dtype.name,
            "iterations": args.iters, "variants": len(qs), "bad_iterations": int(bad.sum()),
            "nondeterministic_iterations": int(diffs.sum()), "iterations_with_counters_set": int((lefts != 0).sum()),
            "counters_left": int(np.count_nonzero(np.asarray(counters))), "max_abs_err": float(errs.max()),
            "tol": tol, "seconds": round(seconds, 3)}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="result JSON file, or a directory for merge_stress.json (default bench/results/)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in Pallas interpret mode (CPU): the script only")
    ap.add_argument("--splits", type=_ints, default=None,
                    help=f"split counts (default 2,4,8,{MAX_SPLIT_K},{2 * MAX_SPLIT_K}; smoke 2,{MAX_SPLIT_K})")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="solohead,headwise")
    ap.add_argument("--orders", default=None, help="launch orders: identity,reversed,strided (default identity,"
                    "reversed on a GPU; smoke strided)")
    ap.add_argument("--iters", type=int, default=None, help="calls per case (default 200; smoke 3)")
    ap.add_argument("--variants", type=int, default=None,
                    help="query sets the calls cycle through (default 4; smoke 2)")
    ap.add_argument("--batch", type=int, default=None, help="sequences (default 16; smoke 2)")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 8; smoke 2)")
    ap.add_argument("--group", type=int, default=None, help="query heads per KV head (default 4; smoke 2)")
    ap.add_argument("--head-dim", type=int, default=None, help="default 128; smoke 16")
    ap.add_argument("--block-size", type=int, default=None, help="default 16; smoke 8")
    ap.add_argument("--blocks-per-step", type=int, default=None, help="the kernel's (default its own; smoke 2)")
    ap.add_argument("--steps-per-split", type=int, default=1, help="online-softmax steps each split holds")
    ap.add_argument("--dtype", default=None, choices=sorted(TOL), help="q and pool dtype (default bfloat16; smoke "
                    "float32)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    smoke = args.smoke
    defaults = dict(splits=[2, MAX_SPLIT_K] if smoke else [2, 4, 8, MAX_SPLIT_K, 2 * MAX_SPLIT_K],
                    orders="strided" if smoke else "identity,reversed", iters=3 if smoke else 200,
                    variants=2 if smoke else 4,
                    batch=2 if smoke else 16, kv_heads=2 if smoke else 8, group=2 if smoke else 4,
                    head_dim=16 if smoke else 128, block_size=8 if smoke else 16, blocks_per_step=2 if smoke else None,
                    dtype="float32" if smoke else "bfloat16")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.layouts = [x for x in args.layouts.split(",") if x]
    args.orders = [x for x in args.orders.split(",") if x]
    if not args.splits or min(args.splits) < 2:
        ap.error(f"--splits {args.splits}: every split count must be >= 2 (one split merges nothing)")
    if not set(args.layouts) <= set(LAYOUTS) or not args.layouts:
        ap.error(f"--layouts {args.layouts}: pick from {LAYOUTS}")
    if not set(args.orders) <= set(ORDERS) or not args.orders:
        ap.error(f"--orders {args.orders}: pick from {ORDERS}")
    for name in ("iters", "variants", "batch", "kv_heads", "group", "steps_per_split"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)
    out = args.out
    name, out_dir = "merge_stress", None
    if out is not None:
        name, out_dir = (out.stem, out.parent) if out.suffix == ".json" else ("merge_stress", out)
    cases: list[dict] = []
    payload = {"backend": jax.default_backend(), "smoke": args.smoke, "cases": cases, "ok": False}
    print(f"{'split_k':>7} {'layout':>9} {'order':>9} {'programs':>8} {'iters':>5} {'bad':>4} {'max err':>9} {'s':>7}")
    for split_k in args.splits:
        for layout in args.layouts:
            for order_name in args.orders:
                try:
                    c = run_case(args, rng, split_k=split_k, layout=layout, order_name=order_name)
                except Exception as e:  # (recorded: a case that does not run is a failed case)
                    c = {"split_k": split_k, "layout": layout, "order": order_name, "error": f"{type(e).__name__}: "
                         f"{e}"[:2000], "bad_iterations": -1, "counters_left": -1}
                    print(f"{split_k:>7} {layout:>9} {order_name:>9} error: {c['error'][:200]}")
                else:
                    print(f"{split_k:>7} {layout:>9} {order_name:>9} {c['programs']:>8} {c['iterations']:>5} "
                          f"{c['bad_iterations']:>4} {c['max_abs_err']:>9.2e} {c['seconds']:>7.2f}")
                cases.append(c)
                payload["ok"] = all(x["bad_iterations"] == 0 and x["counters_left"] == 0 for x in cases)
                write_result(name, payload, out_dir)  # (after every case: a timeout keeps what ran)
    print("merge stress:", "every iteration agreed, counters 0" if payload["ok"] else "FAILED")
    return 0 if payload["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
