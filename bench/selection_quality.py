"""How much true attention each block selection keeps (CPU, real model): the engine's policies against an oracle.

    python bench/selection_quality.py                                  # SmolLM2, the accuracy bench's text
    python bench/selection_quality.py --budgets 512,1024 --queries 64 --smoke

One dense forward over real text (`bench/accuracy.py`'s teacher-forced sequence: the last `--context` +
`--queries` tokens of the GPL-3) captures every layer's keys and the queries of the last `--queries` positions
(`pulseinfer_jax.calibration.capture_queries_and_keys`). For each sparse layer, query position and budget it
computes the true softmax attention of every query head over the blocks its position can see, and the
fraction of it ("attention recall") that the blocks each policy selects would keep:
  - quest-solohead / quest-headwise: the engine's selection itself (`pallas_kernels.block_scoring`'s Quest
    bounds from per-block key min / max, the sink / window blocks scored from their keys where the engine does,
    `selection.kept_blocks`; `selection.policy.select_blocks` with the same sinks / window;
    SoloHead normalized_sum: one set for all heads; headwise: each KV head its own set; without the resident-block
    bonus, which needs the decode history of a slot cache: `bench/accuracy.py` measures it);
  - oracle-solohead / oracle-headwise: the same budget filled by the true attention mass (the best a
    selection of that size could keep: SoloHead by the mass summed over heads, headwise per KV head).
Sparse attention renormalises over what it keeps, so 1 - recall is the softmax mass it drops; the gap between
quest and oracle is what a better scorer could win, the gap between oracle and 1 is the budget's. Reported per
policy and budget: mean recall over (layer, position, head) and its 5th percentile.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from bench.common import add_block_layout_args, write_result  # noqa: E402

POLICIES = ("quest-solohead", "quest-headwise", "oracle-solohead", "oracle-headwise")


def oracle_select(mass: np.ndarray, n_blocks: np.ndarray, budget: int, sink: int, window: int) -> np.ndarray:
    """Top blocks by `mass` [P, S, NB] per row and lane, sinks and window always in: bool [P, S, NB]."""
    p, s, nb = mass.shape
    keep = np.zeros((p, s, nb), bool)
    for i in range(p):
        n = int(n_blocks[i])
        fixed = [j for j in range(n) if j < sink or j >= n - window]
        middle = np.arange(sink, max(sink, n - window))
        k = max(0, min(budget - len(fixed), len(middle)))
        for lane in range(s):
            keep[i, lane, fixed] = True
            if k:
                top = middle[np.argsort(-mass[i, lane, middle], kind="stable")[:k]]
                keep[i, lane, top] = True
    return keep


def quest_select(q: np.ndarray, keys: np.ndarray, positions: np.ndarray, budget: int, sink: int, window: int,
                 bs: int, mode: str, scoring=None) -> np.ndarray:
    """The engine's selection for queries q [P, Hq, hd] at token `positions` [P] over keys [T, Hkv, hd] (block
    scores from key bounds as `scoring` (a sparse.BlockScoring, default EngineConfig's) says: middle blocks from
    their bounds, sink / window blocks from their keys up to the position where it scores them; then
    select_blocks) as bool [P, S, NB]."""
    import jax.numpy as jnp
    from pulseinfer_jax.pallas_kernels.block_metadata import round_bounds_outward
    from pulseinfer_jax.pallas_kernels.block_scoring import block_scores_reference, default_scale

    from pulseinfer_jax.selection.kept_blocks import score_kept_from_keys
    from pulseinfer_jax.selection.policy import BlockScoring, select_blocks

    scoring = scoring or BlockScoring()
    p, hq, hd = q.shape
    t, hkv, _ = keys.shape
    nb = -(-t // bs)
    n_blocks = np.asarray(positions) // bs + 1  # blocks each query sees (its own, partial, included)
    m = scoring.sub_blocks
    kb = np.pad(keys, ((0, nb * bs - t), (0, 0), (0, 0))).reshape(nb * m, bs // m, hkv, hd)
    kmin, kmax = kb.min(1), kb.max(1)  # only full middle blocks use these (the partial one is in the window)
    kmin, kmax = (np.asarray(a.astype(jnp.float32)) for a in  # stored as the engine stores them
                  round_bounds_outward(kmin, kmax, scoring.metadata_dtype(keys.dtype)))
    cand = np.full((p, nb), -1, np.int32)
    for i in range(p):
        n = int(n_blocks[i])
        cand[i, sink:max(sink, n - window)] = np.arange(sink, max(sink, n - window))
    per_head = scoring.per_head(mode, "normalized_sum")
    scale = default_scale(hd, hq // hkv, per_head)
    scores = block_scores_reference(jnp.asarray(q), jnp.asarray(kmin), jnp.asarray(kmax), jnp.asarray(cand),
                                    per_head=per_head, beta=scoring.beta, sub_blocks=m, scale=scale)
    if scoring.scores_kept(mode, "normalized_sum"):
        scores = score_kept_from_keys(scores, q, keys, positions, sink=sink, window=window, block_size=bs,
                                      per_head=per_head, beta=scoring.beta, sub_blocks=m, scale=scale,
                                      bounds_dtype=scoring.metadata_dtype(keys.dtype))
    sel = np.asarray(select_blocks(scores, jnp.asarray(n_blocks, jnp.int32), budget_blocks=budget, sink_blocks=sink,
                                   window_blocks=window, mode=mode, score_scale=scale))
    keep = np.zeros((p, sel.shape[1], nb), bool)
    for i, lane, j in zip(*np.nonzero(sel >= 0), strict=True):
        keep[i, lane, sel[i, lane, j]] = True
    return keep


def recall(mass: np.ndarray, keep: np.ndarray, group: int) -> np.ndarray:
    """Mass kept per (position, query head): mass [P, Hq, NB], keep [P, S, NB] (S = 1 or Hkv) -> [P, Hq]."""
    lanes = keep.shape[1]
    per_head = np.repeat(keep, group, axis=1) if lanes > 1 else np.broadcast_to(keep, mass.shape)
    return (mass * per_head).sum(-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--queries", type=int, default=128, help="query positions (the last ones of the sequence)")
    ap.add_argument("--budgets", default="256,512,1024,2048")
    add_block_layout_args(ap)
    ap.add_argument("--score-beta", type=float, default=None,
                    help="block-score range weight of the quest policies (default: EngineConfig's)")
    ap.add_argument("--score-per-kv-head", action="store_true",
                    help="quest-solohead scores per KV head (EngineConfig.score_per_query_head=False)")
    ap.add_argument("--score-sub-blocks", type=int, default=None, help="EngineConfig.score_sub_blocks (default: 1)")
    ap.add_argument("--no-score-kept-blocks", action="store_true", help="EngineConfig.score_kept_blocks=False")
    ap.add_argument("--score-bounds-dtype", default=None,
                    help="EngineConfig.score_bounds_dtype (default: the engine's)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--name", default=None, help="result file name (default selection_quality_cpu)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.model, args.context, args.queries, args.budgets = "random:smollm2-135m", 600, 8, "256"

    from pulseinfer_jax.models.loading import load_model

    from bench.accuracy import TEXTS
    from pulseinfer_jax.calibration import capture_queries_and_keys
    from pulseinfer_jax.config import EngineConfig
    from pulseinfer_jax.selection.policy import block_attention_mass

    scoring = EngineConfig().scoring
    scoring = dataclasses.replace(scoring, beta=scoring.beta if args.score_beta is None else args.score_beta,
                                  per_query_head=not args.score_per_kv_head,
                                  sub_blocks=args.score_sub_blocks or scoring.sub_blocks,
                                  kept_blocks=not args.no_score_kept_blocks,
                                  bounds_dtype=args.score_bounds_dtype or scoring.bounds_dtype)

    model = load_model(args.model)
    c = model.cfg
    need = args.context + args.queries
    if model.tokenizer is not None:
        path = next(p for p in TEXTS if p.is_file())
        ids = model.tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=True)
        ids = (ids * (need // len(ids) + 1))[-need:]
        text = str(path)
    else:
        ids, text = np.random.default_rng(0).integers(0, c.vocab_size, need).tolist(), "random token ids"
    t0 = time.perf_counter()
    qs, ks = capture_queries_and_keys(model, ids, args.queries)
    qs, ks = np.asarray(qs, np.float64), np.asarray(ks, np.float64)
    bs, sink, window = args.block_size, args.sink_blocks, args.window_tokens // args.block_size
    pos = np.arange(need - args.queries, need)
    n_blocks = pos // bs + 1  # blocks each query position sees (its own, partial, included)
    rows = []
    for budget_tokens in [int(b) for b in args.budgets.split(",")]:
        budget = budget_tokens // bs
        vals: dict[str, list[np.ndarray]] = {p: [] for p in POLICIES}
        for layer in range(args.dense_layers, c.num_layers):
            mass = np.asarray(block_attention_mass(qs[layer], ks[layer], bs, q_positions=pos,
                                                   average=False))  # [P, Hq, NB]
            solo_mass = mass.sum(1, keepdims=True)
            kv_mass = mass.reshape(mass.shape[0], c.num_kv_heads, c.group_size, -1).sum(2)
            picks = {
                "quest-solohead": quest_select(qs[layer], ks[layer], pos, budget, sink, window, bs, "solohead",
                                               scoring),
                "quest-headwise": quest_select(qs[layer], ks[layer], pos, budget, sink, window, bs, "headwise",
                                               scoring),
                "oracle-solohead": oracle_select(solo_mass, n_blocks, budget, sink, window),
                "oracle-headwise": oracle_select(kv_mass, n_blocks, budget, sink, window),
            }
            for name, keep in picks.items():
                vals[name].append(recall(mass, keep, c.group_size))
        row = {"budget_tokens": budget_tokens}
        for name, v in vals.items():
            a = np.stack(v)  # [layers, P, Hq]
            row[name] = {"mean": float(a.mean()), "p5": float(np.percentile(a, 5)),
                         "per_layer_mean": a.mean((1, 2)).tolist()}
        rows.append(row)
        print(f"budget {budget_tokens:5d}: " + ", ".join(
            f"{n} {row[n]['mean']:.4f} (p5 {row[n]['p5']:.3f})" for n in POLICIES), flush=True)
    name = "selection_quality_smoke" if args.smoke else (args.name or "selection_quality_cpu")
    path = write_result(name, {"kind": "selection_quality", "model": args.model or "SmolLM2-135M-Instruct (GGUF)",
                               "text": text, "context": args.context, "queries": args.queries,
                               "block_size": bs, "sink_blocks": sink, "window_tokens": args.window_tokens,
                               "dense_layers": args.dense_layers, "score_beta": scoring.beta,
                               "scoring": dataclasses.asdict(scoring), "rows": rows,
                               "seconds": time.perf_counter() - t0}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
