"""Kernel micro-benchmarks: copy bandwidth, sparse decode attention, block scoring + top-k, gather/scatter.

    python bench/kernels.py --out DIR            # GPU, Llama-3.1-8B shapes (Hq 32, Hkv 8, hd 128, bs 16, bf16)
    python bench/kernels.py --smoke --out DIR    # CPU, tiny sizes, Pallas interpret mode: checks the script only

Sections (each runs on its own; a failing or missing one is recorded in the JSON and skipped):
- copy: achieved device bandwidth of a large elementwise copy (`x + 1`), bytes read + written / time.
- attention: `pallas_kernels.sparse_decode_attention` at budgets (tokens per sequence) x batches, SoloHead
  (one block list per sequence) and headwise (one list per KV head); against its jnp reference and against
  jax's `pallas.ops.gpu.paged_attention` on the same SoloHead blocks (pages re-laid out to
  [Hkv, pages, page_size, hd] once, outside the timing). Achieved bandwidth = K/V bytes the selected
  blocks hold (B * Hkv * K * bs * hd * 2 * itemsize) / time; q and o are ignored (tiny).
- scoring: `pallas_kernels.block_scoring.block_scores` over every block of a context (Quest min/max
  metadata in the KV dtype, and in float8 as the engine keeps it by default: rows `... f8`) alone: per KV
  head (group sums), per query head (the engine's SoloHead default) and per query head with 2 sub-blocks
  (`score_sub_blocks=2`: twice the rows); then fused in one jit with `pulseinfer_jax.selection.policy.select_blocks`
  as the engine runs them (solohead on per-query-head scores, headwise on group sums; `jax.lax.top_k` on the
  head-summed scores if that module is missing), on float8 bounds. GB/s counts the metadata rows read
  (2 * m * B * K * Hkv * hd * itemsize, m sub-blocks). At the largest batch also two-level scoring
  (`score_coarse_group` / `score_coarse_keep`: every group's row, then only the kept groups' blocks).
- gather: `pallas_kernels.gather_scatter` whole-block and per-(block, head) gathers and scatters (scatter
  in place, cache donated) against their jnp references; GB/s counts bytes read + written.
Data are synthetic (random values, random distinct block ids), seeded. Timing: `--warmup` untimed calls
(compile included), then `--runs` samples; each sample issues `--inner` back-to-back calls (async
dispatch, no sync in between) and waits once with block_until_ready; the reported time is the median
sample / inner. The JSON goes through bench.common.write_result; a short table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import pathlib
import statistics
import sys
import time
import traceback
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from pulseinfer_jax.pallas_kernels.common import pow2_divisor  # noqa: E402

from bench.common import write_result  # noqa: E402

ROWS: list[tuple[str, str, str, float, float | None]] = []  # (section, impl, config, ms, GB/s) for the table


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def timeit(call, *, warmup: int, runs: int, inner: int) -> dict:
    """Median seconds per call of `call()` (see the module docstring for the protocol)."""
    for _ in range(warmup):
        jax.block_until_ready(call())
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = call()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / inner)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "samples_s": samples}


def record(section: str, impl: str, config: str, t: dict, nbytes: int | None) -> dict:
    gbps = nbytes / t["median_s"] / 1e9 if nbytes else None
    ROWS.append((section, impl, config, t["median_s"] * 1e3, gbps))
    out = {"impl": impl, "median_ms": t["median_s"] * 1e3, "min_ms": t["min_s"] * 1e3,
           "samples_ms": [s * 1e3 for s in t["samples_s"]]}
    if nbytes:
        out.update(bytes=nbytes, gb_per_s=gbps)
    print(f"  {section:9s} {impl:30s} {config:26s} {t['median_s'] * 1e3:9.3f} ms"
          + (f" {gbps:8.1f} GB/s" if gbps else ""), flush=True)
    return out


def try_timed(section: str, impl: str, config: str, nbytes: int | None, tk: dict, fn, *args, **kw) -> dict:
    """Time `fn(*args, **kw)`; an exception (e.g. a GPU compile failure) is recorded, not raised."""
    try:
        return record(section, impl, config, timeit(lambda: fn(*args, **kw), **tk), nbytes)
    except Exception as e:  # noqa: BLE001 - a benchmark keeps going and reports what failed
        msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
        print(f"  {section:9s} {impl:30s} {config:26s} FAILED {msg}", flush=True)
        ROWS.append((section, impl, config, float("nan"), None))
        return {"impl": impl, "error": msg, "traceback": traceback.format_exc()[-3000:]}


def lazy_import(module: str, attr: str):
    """(object, None) or (None, reason) when the module or attribute is not there (yet)."""
    try:
        return getattr(importlib.import_module(module), attr), None
    except (ImportError, AttributeError) as e:
        return None, f"{module}.{attr} unavailable ({type(e).__name__}: {e})"


def free() -> None:
    gc.collect()


def rand(key: int, shape, dtype) -> jax.Array:
    return jax.jit(lambda k: jax.random.normal(k, shape, jnp.float32).astype(dtype))(jax.random.key(key))


# ------------------------------------------------------------------------------------------------
# sections
# ------------------------------------------------------------------------------------------------


def bench_copy(a, tk) -> dict:
    n = a.copy_mib * (1 << 20) // 2
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda x: x + 1)
    r = try_timed("copy", "xla x+1 (bf16)", f"{a.copy_mib} MiB", 2 * x.nbytes, tk, f, x)
    del x
    free()
    return {"mib": a.copy_mib, **r}


def bench_attention(a, tk) -> dict:
    sda, why = lazy_import("pulseinfer_jax.pallas_kernels.sparse_decode_attention", "sparse_decode_attention")
    if sda is None:
        print(f"attention: SKIPPED, {why}", flush=True)
        return {"skipped": why}
    ref, _ = lazy_import("pulseinfer_jax.pallas_kernels.sparse_decode_attention", "sparse_decode_attention_reference")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        paged, paged_why = lazy_import("jax.experimental.pallas.ops.gpu.paged_attention", "paged_attention")
    from pulseinfer_jax.pallas_kernels.common import resolve_interpret

    interp = resolve_interpret(None)
    hq, hkv, hd, bs, dt = a.hq, a.hkv, a.hd, a.bs, jnp.dtype(a.dtype)
    rng = np.random.default_rng(0)
    out = []
    for budget in a.budgets:
        k = budget // bs
        for b in a.batches:
            cfg = f"budget {budget} B {b}"
            nb = b * k + 1  # block 0 is the null block, never listed
            pool = rand(budget * 1000 + b, (nb, 2, bs, hkv, hd), dt)
            q = rand(7 + b, (b, hq, hd), dt)
            solo = jnp.asarray(rng.permutation(np.arange(1, nb)).reshape(b, 1, k).astype(np.int32))
            head = np.stack([np.stack([rng.choice(nb - 1, k, replace=False) + 1 for _ in range(hkv)])
                             for _ in range(b)]).astype(np.int32)
            head = jnp.asarray(head)
            lens1 = jnp.full((b, 1, k), bs, jnp.int32)
            lensh = jnp.full((b, hkv, k), bs, jnp.int32)
            nbytes = b * hkv * k * bs * hd * 2 * dt.itemsize
            entry = {"budget_tokens": budget, "batch": b, "blocks_per_seq": k, "kv_bytes": nbytes, "impls": []}
            o_solo = None
            for name, ids, lens in (("soloHead", solo, lens1), ("headwise", head, lensh)):
                r = try_timed("attention", f"pallas sparse {name}", cfg, nbytes, tk, sda, q, pool, ids, lens)
                if ref is not None:
                    o_ref = ref(q, pool, ids, lens)[0].astype(jnp.float32)
                    o_solo = o_ref if name == "soloHead" else o_solo
                    if "error" not in r:
                        err = jnp.max(jnp.abs(sda(q, pool, ids, lens)[0].astype(jnp.float32) - o_ref))
                        r["max_abs_err_vs_reference"] = float(err)
                entry["impls"].append(r)
                if ref is not None:
                    entry["impls"].append(try_timed("attention", f"jnp reference {name}", cfg, nbytes, tk,
                                                    ref, q, pool, ids, lens))
            if paged is None:
                entry["impls"].append({"impl": "jax paged_attention", "skipped": paged_why})
            else:
                kp = jnp.transpose(pool[:, 0], (2, 0, 1, 3))  # [Hkv, NB, bs, hd]
                vp = jnp.transpose(pool[:, 1], (2, 0, 1, 3))
                tables = solo[:, 0, :]
                lengths = jnp.full((b,), k * bs, jnp.int32)
                splits = pow2_divisor(k, 16)
                qs = (q.astype(jnp.float32) * hd ** -0.5).astype(dt)  # paged_attention applies no score scale
                r = try_timed("attention", "jax paged_attention", cfg, nbytes, tk, paged, qs, kp, vp, tables, lengths,
                              k_splits=splits, interpret=interp)
                if o_solo is not None and "error" not in r:
                    o = paged(qs, kp, vp, tables, lengths, k_splits=splits, interpret=interp).astype(jnp.float32)
                    r["max_abs_err_vs_reference"] = float(jnp.max(jnp.abs(o - o_solo)))
                r["k_splits"] = splits
                entry["impls"].append(r)
                del kp, vp, qs
            out.append(entry)
            del pool, q, solo, head
            free()
    return {"grid": out}


def _selectors(a, kb: int, g: int, scale_of) -> dict:
    """name -> (per_head, jittable (scores [B, S, K], n_total [B]) -> ids): select_blocks as the engine calls it
    (solohead on per-query-head scores, headwise on group sums, at `scale_of(hd, g, per_head)`), or lax.top_k if
    missing."""
    sel, why = lazy_import("pulseinfer_jax.selection.policy", "select_blocks")
    if sel is None:
        print(f"  scoring: select_blocks unavailable, timing lax.top_k on head-summed scores ({why})", flush=True)
        return {"top_k(sum over heads)": (False, lambda s, n: jax.lax.top_k(jnp.sum(s, axis=1), kb)[1])}
    sink = min(a.sink_blocks, kb // 4)
    window = min(a.window_blocks, kb // 2)
    out = {}
    for mode, per_head in (("solohead", True), ("headwise", False)):
        scale = scale_of(a.hd, g, per_head)
        out[f"select_blocks {mode}"] = (per_head, lambda s, n, m=mode, t=scale: sel(
            s, n, budget_blocks=kb, sink_blocks=sink, window_blocks=window, mode=m, score_scale=t))
    return out


def bench_scoring(a, tk) -> dict:
    scores_fn, why = lazy_import("pulseinfer_jax.pallas_kernels.block_scoring", "block_scores")
    if scores_fn is None:
        print(f"scoring: SKIPPED, {why}", flush=True)
        return {"skipped": why}
    from pulseinfer_jax.pallas_kernels.block_scoring import default_scale  # the module is there: block_scores imported

    hq, hkv, hd, bs = a.hq, a.hkv, a.hd, a.bs
    kv_dt, f8 = jnp.dtype(a.dtype), jnp.dtype(jnp.float8_e4m3fn)
    # (metadata rows per block, bounds dtype) -> {name: per_head}; float8 is the engine's default storage
    # (score_bounds_dtype), the KV dtype its exact alternative; the selectors run on the default
    variants = {(1, kv_dt): {"block_scores": False, "block_scores per_head": True},
                (2, kv_dt): {"block_scores per_head sub2": True},
                (1, f8): {"block_scores per_head f8": True}, (2, f8): {"block_scores per_head sub2 f8": True}}
    out = []
    for ctx in a.contexts:
        kc = ctx // bs
        kb = min(kc, a.select_budget // bs)
        selectors = {name: jax.jit(lambda q, lo, hi, cand, n, f=f, ph=ph: f(scores_fn(q, lo, hi, cand, per_head=ph), n))
                     for name, (ph, f) in _selectors(a, kb, hq // hkv, default_scale).items()}
        for b in a.batches:
            cfg = f"ctx {ctx} B {b} top{kb}"
            nb = b * kc + 1
            q = rand(3 + b, (b, hq, hd), kv_dt)
            cand = jnp.arange(1, nb, dtype=jnp.int32).reshape(b, kc)
            ntot = jnp.full((b,), kc, jnp.int32)
            rows = b * kc * hkv * hd * 2  # both bound rows of every candidate, per metadata row per block
            entry = {"context": ctx, "batch": b, "candidates": kc, "selected": kb, "meta_bytes": rows * kv_dt.itemsize,
                     "meta_bytes_f8": rows * f8.itemsize, "impls": []}
            for (m, mdt), named in variants.items():
                lo = rand(ctx + b, (nb * m, hkv, hd), jnp.float32)
                hi = (lo + jnp.abs(rand(ctx + b + 1, (nb * m, hkv, hd), jnp.float32))).astype(mdt)
                lo = lo.astype(mdt)
                nbytes = rows * m * mdt.itemsize
                for name, ph in named.items():
                    entry["impls"].append(try_timed("scoring", name, cfg, nbytes, tk, scores_fn, q, lo, hi,
                                                    cand, per_head=ph, sub_blocks=m))
                if (m, mdt) == (1, f8):
                    for name, fused in selectors.items():
                        entry["impls"].append(try_timed("scoring", f"scores+{name}"[:30], cfg, nbytes, tk,
                                                        fused, q, lo, hi, cand, ntot))
                    if b == max(a.batches):  # two-level scoring, at the largest batch only (compile time)
                        entry["impls"].append(_two_level_row(a, scores_fn, q, lo, hi, cand, kb, cfg, tk))
                del lo, hi
                free()
            out.append(entry)
            del q, cand
            free()
    return {"sink_blocks": a.sink_blocks, "window_blocks": a.window_blocks, "grid": out}


def _two_level_row(a, scores_fn, q, lo, hi, cand, kb: int, cfg: str, tk) -> dict:
    """`sparse_layer.two_level_scores` (EngineConfig.score_coarse_group / _keep = --coarse-group / --coarse-keep) on the
    float8 bounds: the groups' rows (random, one per group), then the kept groups' blocks. GB/s counts the rows it
    reads: every group's and the kept groups' blocks'."""
    two_level, why = lazy_import("pulseinfer_jax.runner.sparse_layer", "two_level_scores")
    name = f"two-level g{a.coarse_group} k{a.coarse_keep:g} f8"
    if two_level is None:
        return {"impl": name, "config": cfg, "error": why}
    from pulseinfer_jax.pallas_kernels.block_scoring import default_scale

    from pulseinfer_jax.selection.policy import BlockScoring, coarse_groups_kept

    b, kc = cand.shape
    f = a.coarse_group
    ng = -(-kc // f)
    keep = coarse_groups_kept(kb, min(a.sink_blocks, kb // 4), min(a.window_blocks, kb // 2), f, a.coarse_keep)
    glo = rand(kc + b + 7, (b * ng + 1, a.hkv, a.hd), jnp.float32)
    ghi = (glo + jnp.abs(rand(kc + b + 8, glo.shape, jnp.float32))).astype(lo.dtype)
    groups = jnp.arange(1, b * ng + 1, dtype=jnp.int32).reshape(b, ng)
    scoring = BlockScoring(coarse_group=f, coarse_keep=a.coarse_keep)
    fn = jax.jit(lambda q, lo, hi, cand, glo, ghi, groups: two_level(
        scores_fn, q, lo, hi, cand, glo, ghi, groups, keep=keep, scoring=scoring, per_head=True,
        scale=default_scale(a.hd, a.hq // a.hkv, True)))
    nbytes = b * (ng + min(keep, ng) * f) * a.hkv * a.hd * 2 * lo.dtype.itemsize
    return try_timed("scoring", name, cfg, nbytes, tk, fn, q, lo, hi, cand, glo.astype(lo.dtype), ghi, groups)


class _Scatter:
    """Holds the (donated, updated in place) cache across timed scatter calls."""

    def __init__(self, cache: jax.Array):
        self.cache = cache

    def __call__(self, fn, *args) -> jax.Array:
        self.cache = fn(self.cache, *args)
        return self.cache


def bench_gather(a, tk) -> dict:
    from bench import gather_scatter as gs

    hkv, hd, bs, dt = a.hkv, a.hd, a.bs, jnp.dtype(a.dtype)
    block_bytes = 2 * bs * hkv * hd * dt.itemsize
    nmax = max(a.gather_blocks)
    nb = max(a.pool_blocks, nmax + 1)
    ns = 2 * nmax
    pool = rand(11, (nb, 2, bs, hkv, hd), dt)
    cache = jnp.zeros((ns, 2, bs, hkv, hd), dt)
    ref_scatter = jax.jit(gs.scatter_blocks_reference, donate_argnums=0)
    ref_scatter_h = jax.jit(gs.scatter_block_heads_reference, donate_argnums=0)
    rng = np.random.default_rng(1)
    out = []
    sc = _Scatter(cache)
    for n in a.gather_blocks:
        ids = jnp.asarray(rng.choice(nb, n, replace=False).astype(np.int32))
        slots = jnp.asarray(rng.choice(ns, n, replace=False).astype(np.int32))
        moved = 2 * n * block_bytes  # read + write
        cfg = f"{n} blocks ({n * block_bytes / 2**20:.1f} MiB)"
        entry = {"blocks": n, "payload_bytes": n * block_bytes, "impls": []}
        staging = gs.gather_blocks_reference(pool, ids)
        # per-(block, head) units: n * Hkv units carry the same payload as n whole blocks
        pairs = rng.choice(nb * hkv, n * hkv, replace=False)
        hids, heads = jnp.asarray((pairs // hkv).astype(np.int32)), jnp.asarray((pairs % hkv).astype(np.int32))
        spairs = rng.choice(ns * hkv, n * hkv, replace=False)
        hslots, sheads = jnp.asarray((spairs // hkv).astype(np.int32)), jnp.asarray((spairs % hkv).astype(np.int32))
        hstaging = gs.gather_block_heads_reference(pool, hids, heads)
        hcfg = f"{n * hkv} (block, head) units"
        for impl, c, fn, args in (
            ("gather_blocks pallas", cfg, gs.gather_blocks, (pool, ids)),
            ("gather_blocks jnp", cfg, gs.gather_blocks_reference, (pool, ids)),
            ("scatter_blocks pallas", cfg, sc, (gs.scatter_blocks, slots, staging)),
            ("scatter_blocks jnp", cfg, sc, (ref_scatter, slots, staging)),
            ("gather_block_heads pallas", hcfg, gs.gather_block_heads, (pool, hids, heads)),
            ("gather_block_heads jnp", hcfg, gs.gather_block_heads_reference, (pool, hids, heads)),
            ("scatter_block_heads pallas", hcfg, sc, (gs.scatter_block_heads, hslots, sheads, hstaging)),
            ("scatter_block_heads jnp", hcfg, sc, (ref_scatter_h, hslots, sheads, hstaging)),
        ):
            entry["impls"].append(try_timed("gather", impl, c, moved, tk, fn, *args))
        out.append(entry)
        del staging, hstaging
        free()
    del pool, sc
    free()
    return {"pool_blocks": nb, "cache_slots": ns, "block_bytes": block_bytes, "grid": out}


# ------------------------------------------------------------------------------------------------


def ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="copy,attention,scoring,gather")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--budgets", type=ints, default=[1024, 2048, 4096], help="attention tokens per sequence")
    ap.add_argument("--batches", type=ints, default=[1, 4, 16, 64])
    ap.add_argument("--contexts", type=ints, default=[32768, 131072], help="scoring: tokens per sequence")
    ap.add_argument("--select-budget", type=int, default=2048, help="scoring: tokens selected per sequence")
    ap.add_argument("--coarse-group", type=int, default=16, help="scoring: two-level scoring's blocks per group")
    ap.add_argument("--coarse-keep", type=float, default=4.0, help="scoring: two-level groups kept (middle budgets)")
    ap.add_argument("--sink-blocks", type=int, default=1, help="scoring: always-kept leading blocks")
    ap.add_argument("--window-blocks", type=int, default=4, help="scoring: always-kept trailing blocks")
    ap.add_argument("--gather-blocks", type=ints, default=[64, 512, 4096])
    ap.add_argument("--pool-blocks", type=int, default=16384)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the script, interpret mode)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.smoke:
        a.hq, a.hkv, a.hd, a.bs, a.copy_mib = 4, 2, 64, 16, 4
        a.budgets, a.batches, a.contexts, a.select_budget, a.coarse_group = [32, 64], [1, 2], [256], 64, 4
        a.gather_blocks, a.pool_blocks, a.warmup, a.runs, a.inner = [4, 16], 64, 2, 2, 1
    backend = jax.default_backend()
    if backend == "cpu" and not a.smoke:
        print("warning: CPU backend without --smoke: Pallas runs in interpret mode, expect a very long run")
    tk = {"warmup": a.warmup, "runs": a.runs, "inner": a.inner}
    shapes = {k: getattr(a, k) for k in ("hq", "hkv", "hd", "bs", "dtype")}
    print(f"backend {backend} ({jax.devices()[0].device_kind}); shapes {shapes}", flush=True)
    sections = {"copy": bench_copy, "attention": bench_attention, "scoring": bench_scoring, "gather": bench_gather}
    results: dict = {}
    t0 = time.perf_counter()
    for name in a.sections.split(","):
        if name not in sections:
            raise SystemExit(f"unknown section {name!r}; choose from {sorted(sections)}")
        ts = time.perf_counter()
        print(f"== {name}", flush=True)
        try:
            results[name] = sections[name](a, tk)
        except Exception as e:  # noqa: BLE001 - keep the other sections' numbers
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"[:1000]}
        results[name]["section_s"] = time.perf_counter() - ts
    total = time.perf_counter() - t0
    name = "kernels_smoke" if a.smoke else f"kernels_{jax.devices()[0].platform}"
    path = write_result(name, {"shapes": shapes, "timing": {**tk, "protocol": "median over runs of (inner "
                                                            "back-to-back calls, one sync) / inner"},
                               "data": "synthetic random values, random distinct block ids (seeded)",
                               "total_s": total, **results}, a.out)
    print(f"wrote {path} ({total:.1f} s)")
    print(f"\n{'section':9s} {'implementation':30s} {'config':26s} {'ms':>9s} {'GB/s':>8s}")
    for sec, impl, cfg, ms, gbps in ROWS:
        print(f"{sec:9s} {impl:30s} {cfg:26s} {ms:9.3f} " + (f"{gbps:8.1f}" if gbps else f"{'-':>8s}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
