"""Accuracy of sparse decoding against dense on a real model: passkey retrieval and teacher-forced agreement.

    python bench/accuracy.py                                   # CPU, SmolLM2, the full grid (slow: ~1 h)
    python bench/accuracy.py --lengths 2000,4000 --depths 0.1,0.5,0.9 --budgets 256,1024   # a reduced grid
    python bench/accuracy.py --smoke                           # tiny sizes, script check

Variants: dense, `headwise`, SoloHead `normalized_sum` and SoloHead `retrieval_head` (heads calibrated with
`pulseinfer_jax.calibration` on the evaluation text before its teacher-forced window, which comes from its
end), each sparse one at every budget. All sparse runs are offloaded
(the I/O path is exact, tests/test_offload.py), by default block size 16, 1 sink block, 64-token window, 2 dense
layers (`--block-size`, `--sink-blocks`, `--window-tokens`, `--dense-layers`, `--score-beta` for the block
scores' key-range weight; `--no-passkey` runs the teacher-forced part only, `--no-teacher-forced` the passkeys
only). `--kv-dtypes auto,float8_e4m3fn` runs the grid once per KV cache dtype; agreement is always against the first
dtype's dense run.
- passkey: the haystack of `pulseinfer_jax.demo.passkey_prompt` at each length and depth, greedy, 12 new
  tokens; found = the passkey's digits appear in the answer.
- teacher-forced: `--tf-context` tokens of real text as the prompt, then the next `--tf-tokens` tokens fed
  one by one (not sampled); per position, top-1 agreement of the sparse logits with dense and KL(dense ||
  sparse). Text: `--text`, default /usr/share/common-licenses/GPL-3 (if present), else CPython's
  idlelib/NEWS.txt (both real English; say which in the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import sysconfig
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import RESULTS, add_block_layout_args, write_result  # noqa: E402

TEXTS = [pathlib.Path("/usr/share/common-licenses/GPL-3"), pathlib.Path(sysconfig.get_paths()["stdlib"]) / "idlelib"
         / "NEWS.txt"]


def engine_config(variant: str, budget: int | None, heads: tuple[int, ...] | None, base: dict):
    from pulseinfer_jax import EngineConfig

    if variant == "dense":
        return EngineConfig.of(**base)
    kw = dict(base, mode="offload", budget_tokens=budget)
    if variant == "headwise":
        return EngineConfig.of(**kw, selection="headwise")
    if variant == "normalized_sum":
        return EngineConfig.of(**kw)
    return EngineConfig.of(**kw, solohead="retrieval_head", retrieval_heads=heads)


def passkey(model, cfg, lengths, depths) -> dict:
    from pulseinfer_jax import generate_long
    from pulseinfer_jax.demo import passkey_prompt

    out = {}
    for n in lengths:
        keys = [10000 + 7919 * i for i in range(len(depths))]
        prompts = [passkey_prompt(model.tokenizer, n, d, k) for d, k in zip(depths, keys, strict=True)]
        # a completion prompt ("... The pass key is"), not a chat turn (as pulseinfer_jax.demo runs it)
        res = generate_long(prompts, model, max_new_tokens=12, chat=False, engine_config=cfg)
        out[n] = [str(k) in r.text for k, r in zip(keys, res, strict=True)]
    return out


def teacher_forced_logits(model, cfg, prefix: list[int], targets: list[int]) -> np.ndarray:
    from pulseinfer_jax import Engine, SamplingParams
    from pulseinfer_jax.engine.core import Sampled

    rec: list[np.ndarray] = []

    class Forced(Engine):  # every step's logits recorded, and the target taken whatever was sampled
        keep_logits = True

        def observe_logits(self, logits, reqs):
            rec.extend(np.asarray(logits, np.float32)[: len(reqs)])

        def _postprocess(self, outputs):
            return super()._postprocess([Sampled(rs, [targets[len(r.output)] if len(r.output) < len(targets) else 0
                                                      for r in rs]) for rs, _ in outputs])

    eng = Forced(model, cfg)
    req = eng.make_request(0, prefix, SamplingParams(max_new_tokens=len(targets), ignore_eos=True))
    list(eng.run([req]))
    return np.stack(rec)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def agreement(dense: np.ndarray, sparse: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement, mean KL(dense || sparse)) over positions; dense / sparse: logits [P, V]."""
    top1 = float(np.mean(dense.argmax(-1) == sparse.argmax(-1)))
    lp, lq = log_softmax(dense), log_softmax(sparse)
    kl = float(np.mean(np.sum(np.exp(lp) * (lp - lq), -1)))
    return top1, kl


def disagreement_margins(dense: np.ndarray, sparse: np.ndarray) -> list[float]:
    """Where the argmaxes differ: dense's probability of its own top-1 minus its probability of the token sparse
    chose (small = dense itself nearly tied between the two)."""
    p = np.exp(log_softmax(dense))
    a, b = dense.argmax(-1), sparse.argmax(-1)
    idx = np.nonzero(a != b)[0]
    return [float(p[i, a[i]] - p[i, b[i]]) for i in idx]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", default="2000,4000,7000")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--budgets", default="256,512,1024,2048")
    ap.add_argument("--variants", default="headwise,normalized_sum,retrieval_head")
    ap.add_argument("--tf-context", type=int, default=4000)
    ap.add_argument("--tf-tokens", type=int, default=128)
    ap.add_argument("--text", default=None)
    add_block_layout_args(ap)
    ap.add_argument("--score-beta", type=float, default=None, help="EngineConfig.score_beta (default: the engine's)")
    ap.add_argument("--score-per-kv-head", action="store_true",
                    help="EngineConfig.score_per_query_head=False (SoloHead scores per KV head, the old default)")
    ap.add_argument("--score-sub-blocks", type=int, default=None, help="EngineConfig.score_sub_blocks (default: 1)")
    ap.add_argument("--no-score-kept-blocks", action="store_true",
                    help="EngineConfig.score_kept_blocks=False (SoloHead scores the middle blocks only)")
    ap.add_argument("--resident-bonus", type=float, default=None,
                    help="EngineConfig.resident_bonus (default: the engine's)")
    ap.add_argument("--score-bounds-dtype", default=None,
                    help="EngineConfig.score_bounds_dtype: float8_e4m3fn | kv (default: the engine's)")
    ap.add_argument("--score-coarse-group", type=int, default=None,
                    help="EngineConfig.score_coarse_group (two-level scoring; default: 1 = off)")
    ap.add_argument("--score-coarse-keep", type=float, default=None,
                    help="EngineConfig.score_coarse_keep (default: the engine's)")
    ap.add_argument("--kv-dtypes", default="auto",
                    help="EngineConfig.kv_dtype values, each a dense run plus the sparse grid (default: auto)")
    ap.add_argument("--recall", default=None, choices=("ahead", "interruptible", "eager", "sync"),
                    help="EngineConfig.recall (default: the engine's, recall one step ahead)")
    ap.add_argument("--no-passkey", action="store_true", help="teacher-forced agreement only (quick exploration)")
    ap.add_argument("--no-teacher-forced", action="store_true", help="the passkey grid only")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows of an unfinished bench/results/NAME.json run with the same arguments and run "
                         "only the rest (the dense reference's logits are recomputed)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--name", default="accuracy_cpu", help="result file name (bench/results/NAME.json)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.lengths, args.depths, args.budgets, args.tf_context, args.tf_tokens = "300", "0.5", "256", 300, 8

    from pulseinfer_jax.models.loading import load_model

    from pulseinfer_jax.calibration import MAX_CALIBRATION_TOKENS, calibrate_retrieval_heads

    model = load_model(args.model)
    if model.tokenizer is None:
        raise SystemExit("the accuracy bench needs a model with a tokenizer")
    text_path = pathlib.Path(args.text) if args.text else next((p for p in TEXTS if p.is_file()), None)
    if text_path is None:
        raise SystemExit(f"no evaluation text: pass --text (looked for {', '.join(map(str, TEXTS))})")
    ids = model.tokenizer.encode(text_path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=True)
    need = args.tf_context + args.tf_tokens
    if len(ids) < need:
        ids = ids * (need // len(ids) + 1)  # repeat a short text (labelled in the JSON)
    prefix, targets = ids[-need:-args.tf_tokens], ids[-args.tf_tokens:]
    # calibration text: everything before the teacher-forced window (never the evaluated tokens), and it must
    # be longer than the budget (calibrate_retrieval_heads refuses otherwise)
    calib = ids[: min(MAX_CALIBRATION_TOKENS, len(ids) - need)] if len(ids) - need >= 256 else ids[:512]
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    base = dict(block_size=args.block_size, sink_blocks=args.sink_blocks, window_tokens=args.window_tokens,
                dense_layers=args.dense_layers, max_batch=8)
    if args.score_beta is not None:
        base["score_beta"] = args.score_beta
    if args.score_per_kv_head:
        base["score_per_query_head"] = False
    if args.score_sub_blocks is not None:
        base["score_sub_blocks"] = args.score_sub_blocks
    if args.no_score_kept_blocks:
        base["score_kept_blocks"] = False
    if args.resident_bonus is not None:
        base["resident_bonus"] = args.resident_bonus
    if args.score_bounds_dtype is not None:
        base["score_bounds_dtype"] = args.score_bounds_dtype
    if args.score_coarse_group is not None:
        base["score_coarse_group"] = args.score_coarse_group
    if args.score_coarse_keep is not None:
        base["score_coarse_keep"] = args.score_coarse_keep
    if args.recall is not None:
        base["recall"] = args.recall

    grid = [("dense", None)] + [(v, int(b)) for b in args.budgets.split(",") for v in args.variants.split(",")]
    runs = [(kv, v, b) for kv in args.kv_dtypes.split(",") for v, b in grid]
    name = "accuracy_smoke" if args.smoke else args.name
    rows, dense_logits, resumed = [], None, None
    if args.resume:
        rows, resumed = _resumable_rows(pathlib.Path(args.out or RESULTS) / f"{name}.json", runs, base)
    if rows and not args.no_teacher_forced:  # the kept rows' reference: the first run's teacher-forced logits
        ref_kv, ref_variant, ref_budget = runs[0]
        dense_logits = teacher_forced_logits(model, engine_config(ref_variant, ref_budget, None,
                                                                  dict(base, kv_dtype=ref_kv)), prefix, targets)
    for kv_dtype, variant, budget in runs[len(rows):]:
        jax.clear_caches()  # (each configuration compiles its own programs: XLA:CPU ran out of memory for code)
        t0 = time.perf_counter()
        heads = None
        kv_base = dict(base, kv_dtype=kv_dtype)
        if variant == "retrieval_head":
            heads = calibrate_retrieval_heads(model, calib, engine_config("normalized_sum", budget, None, kv_base))
        cfg = engine_config(variant, budget, heads, kv_base)
        pk = {} if args.no_passkey else passkey(model, cfg, lengths, depths)
        top1 = kl = margins = None
        if not args.no_teacher_forced:
            logits = teacher_forced_logits(model, cfg, prefix, targets)
            if dense_logits is None:  # the first dtype's dense run is the reference
                dense_logits = logits
            top1, kl = agreement(dense_logits, logits)
            margins = disagreement_margins(dense_logits, logits)
        row = {"variant": variant, "kv_dtype": kv_dtype, "budget_tokens": budget, "retrieval_heads": heads,
               "passkey": {str(n): found for n, found in pk.items()},
               "passkey_accuracy": statistics.mean(x for v in pk.values() for x in v) if pk else None,
               "tf_top1_agreement": top1, "tf_mean_kl": kl,
               "tf_disagreement_dense_margins": margins,
               "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"{variant:15s} kv {kv_dtype:13s} budget {budget or '-':>5}: passkey {row['passkey_accuracy'] or 0:.2f} "
              f"{ {n: sum(f) for n, f in pk.items()} }, teacher-forced top-1 {top1 or 0:.4f}, KL {kl or 0:.5f} "
              f"({row['seconds']:.0f} s)", flush=True)
        write_result(name, {"model": args.model or "SmolLM2-135M-Instruct (GGUF)", "text": str(text_path),
                            "text_tokens": len(ids), "tf_context": args.tf_context, "tf_tokens": args.tf_tokens,
                            "lengths": lengths, "depths": depths, "engine": base,
                            "scoring": dataclasses.asdict(engine_config("dense", None, None, base).scoring),
                            "rows": rows, **({"resumed": resumed} if resumed else {}),
                            "complete": len(rows) == len(runs)}, args.out)
    return 0


def _resumable_rows(path: pathlib.Path, runs: list[tuple], base: dict) -> tuple[list[dict], dict | None]:
    """The rows an unfinished run left in `path`, if they are the first of `runs` under the same engine settings,
    and where they came from; nothing to resume: ([], None)."""
    import json

    if not path.is_file():
        return [], None
    old = json.loads(path.read_text())
    kept = old.get("rows", [])
    if old.get("complete") or old.get("engine") != base or len(kept) >= len(runs):
        raise SystemExit(f"--resume: {path} is complete or was run with other settings; run without --resume")
    for row, (kv, variant, budget) in zip(kept, runs, strict=False):
        if (row["kv_dtype"], row["variant"], row["budget_tokens"]) != (kv, variant, budget):
            raise SystemExit(f"--resume: {path}'s rows are not the first runs of these arguments")
    prior = old.get("resumed") or {"rows": len(kept), "git": old.get("git"), "date": old.get("date")}
    return kept, prior


if __name__ == "__main__":
    sys.exit(main())
