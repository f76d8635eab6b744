"""Real attention behaviour of sparse decode on SmolLM2 (CPU): recall volume, slot-cache reuse, head disagreement.

    python bench/selection_trace.py                       # SmolLM2, 4 real texts of 4K-7K tokens, 64 steps
    python bench/selection_trace.py --budgets 1024,2048 --steps 64 --out DIR
    python bench/selection_trace.py --smoke               # tiny random model, script check

For each budget and each selection (SoloHead normalized_sum, headwise), one offloaded engine decodes the
requests together, greedily, and records every selection (`bench/traces.py`): which middle blocks each
sparse layer chose at each step, and the slot-cache hits and misses. From that it reports
  - recall volume (blocks recalled over PCIe) per layer, step and request: mean, coefficient of variation
    across layers / steps / requests, p50/p99/max of one (request, step, layer), max/mean of a step's total;
  - slot-cache hit rate, overall and per layer, and step-to-step overlap of the selection (Jaccard);
  - how much the heads' own selections differ (headwise): mean pairwise Jaccard of two heads' sets at the
    same (request, step, layer), and the union of all heads' sets relative to one set (what per-head
    selection recalls in the worst case);
  - the same hit rate with synthetic random KV (`bench/synthetic.py`) in place of the real prompt's KV, same
    model and lengths: what the throughput bench would see without a replayed trace.
The traces are saved (`--trace-dir`, .npz) for `bench/decode_throughput.py --replay`. Texts: real English
documents found offline (the GPL-3, GFDL-1.3 and MPL-2.0 licence texts under /usr/share/common-licenses and
CPython's idlelib/NEWS.txt), each cut to its prompt length; the JSON names them.
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys
import sysconfig
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.common import RESULTS, write_result  # noqa: E402
from bench.traces import RecordingSelector, Trace  # noqa: E402
from pulseinfer_jax.config import EngineConfig  # noqa: E402

LICENSES = pathlib.Path("/usr/share/common-licenses")
TEXTS = [LICENSES / "GPL-3", pathlib.Path(sysconfig.get_paths()["stdlib"]) / "idlelib" / "NEWS.txt",
         LICENSES / "GFDL-1.3", LICENSES / "MPL-2.0"]


def load_prompts(model, lengths: list[int]) -> tuple[list[list[int]], list[str]]:
    """Real text prompts (token ids) of the given lengths; random ids for a model without a tokenizer."""
    if model.tokenizer is None:
        rng = np.random.default_rng(0)
        return [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in lengths], ["random token ids"] * len(lengths)
    found = [p for p in TEXTS if p.is_file()]
    if not found:
        raise SystemExit(f"no offline text found (looked for {', '.join(map(str, TEXTS))})")
    prompts, names = [], []
    for n, path in zip(lengths, itertools.cycle(found)):
        ids = model.tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=True)
        while len(ids) < n:  # a short text is repeated (said in the name)
            ids = ids + ids
            path = pathlib.Path(f"{path} (repeated)")
        prompts.append(ids[:n])
        names.append(str(path))
    return prompts, names


def record(model, prompts: list[list[int]], steps: int, base: dict, selection: str, synthetic: bool):
    """Decode all prompts together for `steps` tokens in an offloaded engine that records its selections: (the
    recorder, the engine's sparse pipeline)."""
    from bench.synthetic import SyntheticKVEngine
    from pulseinfer_jax import Engine, SamplingParams

    cls = SyntheticKVEngine if synthetic else Engine
    recorder = RecordingSelector()
    eng = cls(model, EngineConfig.of(**base, mode="offload", selection=selection), selector=recorder)
    sp = SamplingParams(max_new_tokens=steps + 1, ignore_eos=True)
    reqs = [eng.make_request(i, p, sp) for i, p in enumerate(prompts)]
    list(eng.run(reqs))
    return recorder, eng.sparse


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    sa, sb = set(a[a >= 0].tolist()), set(b[b >= 0].tolist())
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0


def cv(x) -> float:
    x = np.asarray(x, np.float64)
    return float(x.std() / x.mean()) if x.mean() else 0.0


def analyse(tr: Trace, unit_bytes: int) -> dict:
    """Recall volume / reuse / head-disagreement statistics of one trace (see the module docstring). The first
    decode step starts with an empty slot cache and recalls its whole selection: it is reported apart
    (`cold_step_recall_blocks`), everything else is over the warm steps 1..T-1."""
    cold = float(tr.misses[:, 0].sum())
    miss, hit = tr.misses[:, 1:].astype(np.float64), tr.hits[:, 1:].astype(np.float64)  # [R, T-1, Ls]
    r_count, t_count, ls, lanes, _ = tr.sel.shape
    step_total = miss.sum(-1)  # [R, T-1]
    churn = [jaccard(tr.sel[r, t, sl, s], tr.sel[r, t - 1, sl, s])
             for r in range(r_count) for t in range(1, t_count) for sl in range(ls) for s in range(lanes)]
    out = {
        "cold_step_recall_blocks": cold,
        "recall_blocks_per_step_mean": float(step_total.sum(0).mean()),  # all requests of a step
        "recall_bytes_per_step_mean": float(step_total.sum(0).mean() * unit_bytes),
        "recall_per_layer_mean": miss.mean((0, 1)).tolist(),
        "recall_cv_across_layers": cv(miss.mean((0, 1))),
        "recall_cv_across_steps": cv(step_total.sum(0)),
        "recall_cv_across_requests": cv(miss.sum((1, 2))),
        "recall_one_layer_step_p50": float(np.percentile(miss, 50)),
        "recall_one_layer_step_p99": float(np.percentile(miss, 99)),
        "recall_one_layer_step_max": float(miss.max()),
        "recall_step_total_max_over_mean": float(step_total.max() / step_total.mean()) if step_total.mean() else 0.0,
        "hit_rate": float(hit.sum() / (hit.sum() + miss.sum())) if hit.sum() + miss.sum() else None,
        "hit_rate_per_layer": (hit.sum((0, 1)) / np.maximum(1, hit.sum((0, 1)) + miss.sum((0, 1)))).tolist(),
        "selection_jaccard_step_to_step": float(np.mean(churn)) if churn else None,
    }
    if lanes > 1:
        pair, union = [], []
        for r, t, sl in itertools.product(range(r_count), range(t_count), range(ls)):
            sets = tr.sel[r, t, sl]
            pair += [jaccard(sets[a], sets[b]) for a, b in itertools.combinations(range(lanes), 2)]
            per = [set(s[s >= 0].tolist()) for s in sets]
            size = max(1, max(len(s) for s in per))
            union.append(len(set().union(*per)) / size)
        out["head_pairwise_jaccard"] = float(np.mean(pair))
        out["head_union_over_one_set"] = float(np.mean(union))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--lengths", default="7000,6000,5000,4000", help="prompt tokens of each request")
    ap.add_argument("--steps", type=int, default=64, help="decode steps recorded")
    ap.add_argument("--budgets", default="1024,2048")
    ap.add_argument("--selections", default="solohead,headwise")
    ap.add_argument("--no-synthetic", action="store_true", help="skip the synthetic-KV comparison runs")
    ap.add_argument("--trace-dir", default=str(RESULTS / "traces"))
    ap.add_argument("--score-per-kv-head", action="store_true", help="EngineConfig.score_per_query_head=False")
    ap.add_argument("--score-sub-blocks", type=int, default=1, help="EngineConfig.score_sub_blocks (default 1)")
    ap.add_argument("--no-score-kept-blocks", action="store_true", help="EngineConfig.score_kept_blocks=False")
    ap.add_argument("--resident-bonus", type=float, default=None,
                    help="EngineConfig.resident_bonus (default: the engine's)")
    ap.add_argument("--score-bounds-dtype", default=None,
                    help="EngineConfig.score_bounds_dtype (default: the engine's)")
    ap.add_argument("--name", default=None, help="result file name (default selection_trace_cpu)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        # SmolLM2's shape with random weights and random token ids; traces usable by decode_throughput --smoke
        args.model, args.lengths, args.steps, args.budgets = "random:smollm2-135m", "600,500", 6, "256"
    from pulseinfer_jax.models.loading import load_model

    from pulseinfer_jax.selection.policy import BlockScoring

    model = load_model(args.model)
    default = BlockScoring()  # the engine's scoring defaults, recorded with the trace
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts, names = load_prompts(model, lengths)
    name = "selection_trace_smoke" if args.smoke else (args.name or "selection_trace_cpu")
    scoring = dict(score_per_query_head=not args.score_per_kv_head, score_sub_blocks=args.score_sub_blocks,
                   score_kept_blocks=not args.no_score_kept_blocks,
                   resident_bonus=default.resident_bonus if args.resident_bonus is None else args.resident_bonus,
                   score_bounds_dtype=args.score_bounds_dtype or default.bounds_dtype)
    rows = []
    for budget, selection in itertools.product([int(b) for b in args.budgets.split(",")],
                                               args.selections.split(",")):
        base = dict(block_size=16, sink_blocks=1, window_tokens=64, dense_layers=2,
                    budget_tokens=budget, max_batch=len(prompts), progress=False, **scoring)
        for synthetic in ([False] if args.no_synthetic else [False, True]):
            t0 = time.perf_counter()
            recorder, dec = record(model, prompts, args.steps, base, selection, synthetic)
            meta = {"model": args.model or "SmolLM2-135M-Instruct (GGUF)", "prompts": names,
                    "prompt_tokens": lengths, "kv": "synthetic random" if synthetic else "real prefill",
                    "scoring": scoring}
            tr = recorder.trace(list(range(len(prompts))), args.steps, meta)
            unit = dec.pool.layer_block_bytes if selection == "solohead" else dec.pool.unit_bytes
            row = {"budget_tokens": budget, "selection": selection, "kv": meta["kv"], **analyse(tr, unit),
                   "seconds": time.perf_counter() - t0}
            stem = f"{'smoke' if args.smoke else 'smollm2'}_{selection}_b{budget}" + ("_synthetic" if synthetic else "")
            path = tr.save(pathlib.Path(args.trace_dir) / f"{stem}.npz")
            row["trace"] = str(path.relative_to(RESULTS.parent.parent) if path.is_relative_to(
                RESULTS.parent.parent) else path)
            rows.append(row)
            print(f"budget {budget:5d} {selection:9s} {meta['kv']:16s}: hit {row['hit_rate']:.3f}, recall "
                  f"{row['recall_blocks_per_step_mean']:.1f} blocks/step "
                  f"(CV layers {row['recall_cv_across_layers']:.2f}, steps {row['recall_cv_across_steps']:.2f}, "
                  f"requests {row['recall_cv_across_requests']:.2f}; cold step {row['cold_step_recall_blocks']:.0f}; "
                  f"max/mean step {row['recall_step_total_max_over_mean']:.2f}), step-to-step Jaccard "
                  f"{row['selection_jaccard_step_to_step']:.3f}"
                  + (f", heads: pairwise Jaccard {row['head_pairwise_jaccard']:.3f}, union "
                     f"{row['head_union_over_one_set']:.2f}x one set" if "head_pairwise_jaccard" in row else "")
                  + f" ({row['seconds']:.0f} s)", flush=True)
            write_result(name, {"kind": "selection_trace", "model": meta["model"], "prompts": names,
                                "prompt_tokens": lengths, "steps": args.steps, "scoring": scoring, "rows": rows},
                         args.out)
    print("summary: " + "; ".join(f"{r['selection']}@{r['budget_tokens']} {r['kv'][:4]} hit {r['hit_rate']:.2f}"
                                  for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
