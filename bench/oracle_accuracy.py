"""Teacher-forced agreement with dense when an ORACLE picks the blocks: the ceiling of any block selection.

    python bench/oracle_accuracy.py                          # SmolLM2, the accuracy bench's text and settings
    python bench/oracle_accuracy.py --budgets 1024 --block-size 8
    python bench/oracle_accuracy.py --smoke                  # tiny sizes (CPU check of the script)

`bench/accuracy.py` measures the engine's sparse decoding (Quest bounds) against dense; `bench/selection_quality.py`
how much attention mass its selections keep against an oracle of the same size. This asks the question in
between: if every sparse layer of every decode step attended over the blocks holding the most TRUE attention
mass (same budget, same sinks / window / dense layers), how often would the next-token argmax still equal
dense's? If even that stays under a target (the evaluation issue's 97% top-1 at 1,024 tokens), no scorer
reaches it at that budget and block size; the gap between the oracle and Quest is what a better scorer wins.

Method (one process, no engine: a direct re-implementation checked against the engine). The prompt (the
accuracy bench's teacher-forced context: the last `--context` + `--tokens` tokens of the GPL-3) runs densely
once, keeping every layer's K/V. The `--tokens` targets then run as the rows of one teacher-forced pass: row i
is the decode step that feeds targets[i] at position P + i, attending over the prompt's K/V and the earlier
rows' own (which, like the engine's, come from sparse-attended hidden states). In every sparse layer each row
attends only over the blocks its policy selects (`pulseinfer_jax.selection.policy.select_blocks`, the engine's own
selection code: sinks, window, budget, tie-breaks):
  - quest-solohead / quest-headwise: scored from the blocks' key min / max (the engine's policy: the check that
    this harness reproduces `bench/accuracy.py`);
  - oracle-solohead: scored by the row's true softmax attention mass per block, summed over all query heads;
  - oracle-headwise: per KV head, the mass of its query heads (each KV head its own set);
  - dense: every block (the reference).
Quest variants for exploring better scorers, all computable from the same per-block key min / max (suffixes,
combinable: `quest-solohead:perhead:beta=0.5:temp=2`):
  - `:perhead`: bounds per query head, softmax per query head, summed (the engine sums each KV head's group of
    query heads first);
  - `:beta=B`: score q.mid + B * |q|.half (mid / half = (max +- min) / 2); B = 1 is Quest's bound
    sum_d max(q_d kmax_d, q_d kmin_d), B = 0 the dot product with the block's midpoint;
  - `:temp=T`: the SoloHead softmax at T x the engine's scale (sharper for T > 1);
  - `:sub=M`: bounds per 1/M of a block, a block scored by the log-sum-exp of its slices (the engine's
    `score_sub_blocks`);
  - `:middle`: score only the middle blocks from their bounds (the engine with `score_kept_blocks=False`: the sink
    and window blocks carry no mass in SoloHead's softmax); without it the sink and window blocks are scored too,
    from their keys up to the row's own position, with the engine's code (`pulseinfer_jax.selection.kept_blocks`);
  - `:bounds=D`: the middle blocks' bounds stored as the engine stores them in dtype D (`float8_e4m3fn`, the
    engine's default, rounded outward) or `kv` (exact, as computed from the model's keys);
  - `:coarse=F` (with `:keep=X`, default 2): two-level scoring (the engine's `score_coarse_group` /
    `score_coarse_keep`): groups of F consecutive blocks are scored first from the min / max of their middle
    blocks' bounds, and only the blocks of the best groups (X times the middle budget's worth,
    `policy.top_groups`) are scored from their own bounds and compete for the budget.
An option of every non-dense policy: `:est` (or `:est=mid`) adds every unselected, wholly visible block of a sparse
layer to the attention as one pseudo-token (its mean key, or the midpoint of its key bounds, with log(block size)
added to the logit, and its mean value): the "estimated tail" of centroid-based systems (measured: no gain over the
engine's scorer, bench/RESULTS.md).
The engine's default (EngineConfig: beta 0.5, per query head, 1 slice, kept blocks scored, float8 bounds) is
`quest-solohead:perhead:beta=0.5`, with one difference: the engine's resident-block bonus (`resident_bonus`,
which favours blocks earlier steps recalled) depends on each step's history, which the harness's parallel rows do
not have; the harness is the engine with `resident_bonus=0`.
Rows are compared as `bench/accuracy.py` does: the prompt's last logits (dense in every policy) plus the first
`--tokens` - 1 decode rows; top-1 agreement of the argmax and mean KL(dense || policy).
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

from bench.common import add_block_layout_args, write_result  # noqa: E402
from pulseinfer_jax.selection.policy import BOUNDS_DTYPES, BlockScoring  # noqa: E402

POLICIES = ("quest-solohead", "quest-headwise", "oracle-solohead", "oracle-headwise")


def prompt_pass(model, prompt: list[int]) -> tuple[jax.Array, jax.Array, np.ndarray]:
    """Dense forward over the prompt: (K, V) of every layer [L, P, Hkv, hd] and the last position's logits [V]."""
    m, c = model.transformer, model.cfg
    p = len(prompt)

    @jax.jit
    def run(params, tokens):
        def attend(layer, q, k, v, kv):
            kk, vv = kv
            kv = (kk.at[layer].set(k[0]), vv.at[layer].set(v[0]))
            return m.causal_attention(q, k, v), kv

        zeros = jnp.zeros((c.num_layers, p, c.num_kv_heads, c.head_dim), model.dtype)
        x = m.embed(params, tokens[None])
        x, kv = m.layers(params, x, jnp.arange(p, dtype=jnp.int32)[None], attend, (zeros, zeros))
        return kv, m.logits(params, x[0, -1])

    (k, v), logits = run(model.params, jnp.asarray(prompt, jnp.int32))
    return k, v, np.asarray(logits, np.float32)


def _block_view(a: jax.Array, bs: int) -> jax.Array:
    """[..., T] -> [..., NB, bs] (T padded with zeros to whole blocks)."""
    t = a.shape[-1]
    nb = -(-t // bs)
    pad = [(0, 0)] * (a.ndim - 1) + [(0, nb * bs - t)]
    return jnp.pad(a, pad).reshape(*a.shape[:-1], nb, bs)


def _block_mean(a: jax.Array, bs: int) -> jax.Array:
    """[T, Hkv, hd] -> float32 per-block means [NB, Hkv, hd] (only whole blocks' means are meaningful: the partial
    last block is zero-padded)."""
    return jnp.moveaxis(_block_view(jnp.moveaxis(a.astype(jnp.float32), 0, -1), bs).mean(-1), -1, 0)


def parse_policy(policy: str) -> tuple[str, dict]:
    """'quest-solohead:perhead:beta=0.5:temp=2' -> ('quest-solohead', {'perhead': True, 'beta': 0.5, 'temp': 2.0})."""
    base, *opts = policy.split(":")
    if base not in POLICIES + ("dense",):
        raise ValueError(f"unknown policy {base!r}; choose from {', '.join(POLICIES)}")
    out = {"perhead": False, "beta": 1.0, "temp": 1.0, "sub": 1, "middle": False, "est": "",
           "bounds": BlockScoring().bounds_dtype, "coarse": 1, "keep": 2.0}
    for o in opts:
        key, _, val = o.partition("=")
        if key == "est" and val in ("", "mean", "mid"):
            out[key] = val or "mean"
        elif key in ("perhead", "middle") and not val:
            out[key] = True
        elif key in ("beta", "temp", "keep") and val:
            out[key] = float(val)
        elif key in ("sub", "coarse") and val.isdigit() and int(val) >= 1:
            out[key] = int(val)
        elif key == "bounds" and val in BOUNDS_DTYPES:
            out[key] = val
        else:
            raise ValueError(f"bad policy option {o!r} in {policy!r} (perhead, beta=B, temp=T, sub=M, middle, "
                             f"bounds={'|'.join(BOUNDS_DTYPES)}, coarse=F, keep=X)")
    if any(not o.startswith("est") for o in opts) and not base.startswith("quest"):
        raise ValueError(f"options apply to the quest policies only, got {policy!r}")
    BlockScoring(coarse_group=out["coarse"], coarse_keep=out["keep"])  # (the engine's checks of F and X)
    if out["perhead"] and base.endswith("headwise"):
        raise ValueError(f"perhead applies to SoloHead (headwise selects per KV head already), got {policy!r}")
    return base, out


def _bounds(keys: jax.Array, bs: int) -> tuple[jax.Array, jax.Array]:
    """Per-block element-wise key min / max [NB, Hkv, hd] of keys [T, Hkv, hd] (the partial last block from its
    own tokens only: padded by repeating its last key)."""
    t = keys.shape[0]
    nb = -(-t // bs)
    padded = jnp.concatenate([keys, jnp.repeat(keys[-1:], nb * bs - t, axis=0)])
    blocks = padded.reshape(nb, bs, *keys.shape[1:])
    return blocks.min(axis=1), blocks.max(axis=1)


def _coarse_keep(qf: jax.Array, kmin: jax.Array, kmax: jax.Array, mid: jax.Array, opt: dict, scale: float, *,
                 kept_groups: int) -> jax.Array:
    """Two-level scoring's first level, per row: qf [R, Hq, hd], bounds [NB * m, Hkv, hd] (m rows per block), mid
    [R, NB] the row's middle blocks -> [R, NB] bool, the blocks of its `kept_groups` best groups."""
    from pulseinfer_jax.pallas_kernels.block_scoring import block_scores_reference

    from pulseinfer_jax.selection.policy import membership_mask, top_groups

    f, m = opt["coarse"], opt["sub"]
    r, nb = mid.shape
    ng = -(-nb // f)
    hkv, hd = kmin.shape[1:]
    member = jnp.pad(mid, ((0, 0), (0, ng * f - nb)))  # [R, NG * F]
    rows = jnp.repeat(member, m, axis=1)[:, :, None, None]  # [R, NG * F * m, 1, 1]
    pad = ((0, ng * f * m - kmin.shape[0]), (0, 0), (0, 0))
    lo = jnp.where(rows, jnp.pad(kmin, pad)[None], jnp.inf).reshape(r, ng, f * m, hkv, hd).min(2)
    hi = jnp.where(rows, jnp.pad(kmax, pad)[None], -jnp.inf).reshape(r, ng, f * m, hkv, hd).max(2)
    live = member.reshape(r, ng, f).any(-1)  # [R, NG] groups holding a middle block
    ids = jnp.where(live, jnp.arange(r)[:, None] * ng + jnp.arange(ng)[None], -1).astype(jnp.int32)
    cs = block_scores_reference(qf, lo.reshape(r * ng, hkv, hd), hi.reshape(r * ng, hkv, hd), ids,
                                per_head=opt["perhead"], beta=opt["beta"], scale=scale)  # [R, S, NG]
    return jnp.repeat(membership_mask(top_groups(cs, kept_groups, scale), ng), f, axis=1)[:, :nb]


@functools.partial(jax.jit, static_argnames=("model", "policy", "budget", "bs", "sink", "window", "dense_layers"))
def rows_pass(model, params, k_prompt, v_prompt, tokens, *, policy: str, budget: int, bs: int, sink: int,
              window: int, dense_layers: int) -> jax.Array:
    """Logits [R, V] of the teacher-forced rows (tokens [R] at positions P..P+R-1) under `policy` (see module)."""
    from pulseinfer_jax.pallas_kernels.block_metadata import round_bounds_outward
    from pulseinfer_jax.pallas_kernels.block_scoring import block_scores_reference, default_scale

    from pulseinfer_jax.selection.kept_blocks import score_kept_from_keys
    from pulseinfer_jax.selection.policy import select_blocks

    c = model.cfg
    policy, opt = parse_policy(policy)
    p, r = k_prompt.shape[1], tokens.shape[0]
    t = p + r
    g, hd = c.group_size, c.head_dim
    nbk = -(-t // bs)
    pos = p + jnp.arange(r, dtype=jnp.int32)  # [R]
    causal = jnp.arange(t)[None, :] <= pos[:, None]  # [R, T]
    nb_row = pos // bs + 1  # blocks each row sees (its partial block included)

    def attend(layer, q, k, v, state):
        keys = jnp.concatenate([k_prompt[layer], k[0]])  # [T, Hkv, hd]
        vals = jnp.concatenate([v_prompt[layer], v[0]])
        qf = q[0].astype(jnp.float32)  # [R, Hq, hd]
        kq = jnp.repeat(keys.astype(jnp.float32), g, axis=1)  # [T, Hq, hd]
        hi = jax.lax.Precision.HIGHEST
        s = jnp.einsum("rhd,thd->rht", qf, kq, precision=hi) * hd ** -0.5  # [R, Hq, T]
        s = jnp.where(causal[:, None], s, -jnp.inf)
        if policy != "dense":
            solo = policy.endswith("solohead")
            if policy.startswith("oracle"):
                mass = _block_view(jax.nn.softmax(s, axis=-1), bs).sum(-1)  # [R, Hq, NB]
                mass = mass.reshape(r, c.num_kv_heads, g, nbk).sum(2)  # per KV head (its query heads' mass)
                scores, scale = jnp.log(mass), 1.0  # normalized_sum: softmax(log mass) = the mass shares
            else:
                m = opt["sub"]
                kmin, kmax = _bounds(keys.astype(jnp.float32), bs // m)  # m rows per block, in order
                kmin, kmax = (jnp.pad(a, ((0, nbk * m - a.shape[0]), (0, 0), (0, 0))) for a in (kmin, kmax))
                dt = None
                if opt["bounds"] != "kv":  # stored as the engine stores them (rounded outward), read back
                    dt = BlockScoring(bounds_dtype=opt["bounds"]).metadata_dtype(keys.dtype)
                    kmin, kmax = (a.astype(jnp.float32) for a in round_bounds_outward(kmin, kmax, dt))
                j = jnp.arange(nbk)[None, :]
                mid = (j >= sink) & (j < nb_row[:, None] - window)  # [R, NB]: the engine's metadata candidates
                scale = opt["temp"] * default_scale(hd, g, opt["perhead"])
                kept_groups = BlockScoring(coarse_group=opt["coarse"], coarse_keep=opt["keep"]).coarse_groups(
                    budget, sink, window, nbk)
                if kept_groups:  # first level: only the best groups' middle blocks stay candidates
                    mid = mid & _coarse_keep(qf, kmin, kmax, mid, opt, scale, kept_groups=kept_groups)
                scores = block_scores_reference(qf, kmin, kmax, jnp.where(mid, j, -1).astype(jnp.int32),
                                                per_head=opt["perhead"], beta=opt["beta"], sub_blocks=m,
                                                scale=scale)  # engine's code: [R, S, NB]
                if not opt["middle"]:  # the always-kept blocks' bounds, causally, stored as the engine's (its code)
                    scores = score_kept_from_keys(scores, qf, keys, pos, sink=sink, window=window, block_size=bs,
                                                  per_head=opt["perhead"], beta=opt["beta"], sub_blocks=m,
                                                  scale=scale, bounds_dtype=dt)
            sel = select_blocks(scores, nb_row, budget_blocks=budget, sink_blocks=sink, window_blocks=window,
                                mode="solohead" if solo else "headwise", score_scale=scale)  # [R, S, N]
            keep = jnp.zeros((r, sel.shape[1], nbk + 1), bool)
            rows = jnp.arange(r)[:, None, None]
            heads = jnp.arange(sel.shape[1])[None, :, None]
            keep = keep.at[rows, heads, jnp.where(sel >= 0, sel, nbk)].set(True)[..., :nbk]
            keep_blocks = keep if solo else jnp.repeat(keep, g, axis=1)  # [R, S or Hq, NB]
            keep = jnp.repeat(keep, bs, axis=-1)[..., :t]  # [R, S, T]
            keep = keep if solo else jnp.repeat(keep, g, axis=1)  # per query head
            sparse = jnp.where(keep, s, -jnp.inf)
            s = jnp.where(layer < dense_layers, s, sparse)
        vq = jnp.repeat(vals.astype(jnp.float32), g, axis=1)  # [T, Hq, hd]
        if policy != "dense" and opt["est"]:
            # every unselected, fully visible block as one pseudo-token: its mean key (or the midpoint of its
            # bounds) with log(bs) added to the logit (bs tokens) and its mean value
            if opt["est"] == "mid":
                lo, hi_ = _bounds(keys.astype(jnp.float32), bs)
                kbar = jnp.pad((lo + hi_) / 2, ((0, nbk - lo.shape[0]), (0, 0), (0, 0)))
            else:
                kbar = _block_mean(keys, bs)
            vbar = _block_mean(vals, bs)
            e = jnp.einsum("rhd,nhd->rhn", qf, jnp.repeat(kbar, g, axis=1), precision=hi) * hd ** -0.5
            full = (jnp.arange(nbk)[None, :] + 1) * bs <= pos[:, None] + 1  # [R, NB] wholly visible
            est_ok = full[:, None, :] & ~keep_blocks & (layer >= dense_layers)
            e = jnp.where(est_ok, e + jnp.log(float(bs)), -jnp.inf)
            s = jnp.concatenate([s, e], axis=-1)
            vq = jnp.concatenate([vq, jnp.repeat(vbar, g, axis=1)], axis=0)
        pr = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("rht,thd->rhd", pr, vq, precision=hi)
        return o[None].astype(q.dtype), state

    x = model.embed(params, tokens[None])
    x, _ = model.layers(params, x, pos[None], attend, None)
    return model.logits(params, x[0])


def main(argv: list[str] | None = None) -> int:
    from bench.accuracy import TEXTS, agreement

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--text", default=None, help="evaluation text (default: as bench/accuracy.py)")
    ap.add_argument("--context", type=int, default=4000, help="prompt tokens before the teacher-forced rows")
    ap.add_argument("--tokens", type=int, default=256, help="teacher-forced tokens (compared rows)")
    ap.add_argument("--budgets", default="256,512,1024,2048")
    ap.add_argument("--policies", default=",".join(POLICIES))
    add_block_layout_args(ap)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the script)")
    ap.add_argument("--name", default=None, help="result file name (default oracle_accuracy_<platform>)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.context, args.tokens, args.budgets = 300, 8, "128"

    from pulseinfer_jax.models.loading import load_model

    model = load_model(args.model)
    text_path = pathlib.Path(args.text) if args.text else next((p for p in TEXTS if p.is_file()), None)
    if text_path is None or model.tokenizer is None:
        raise SystemExit("needs a model with a tokenizer and an evaluation text (--text)")
    ids = model.tokenizer.encode(text_path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=True)
    need = args.context + args.tokens
    if len(ids) < need:
        raise SystemExit(f"{text_path} has {len(ids)} tokens, fewer than --context + --tokens = {need}")
    prefix, targets = ids[-need:-args.tokens], ids[-args.tokens:]
    bs = args.block_size
    if args.window_tokens % bs:
        raise SystemExit(f"--window-tokens {args.window_tokens} must be a multiple of --block-size {bs}")
    kw = dict(bs=bs, sink=args.sink_blocks, window=args.window_tokens // bs, dense_layers=args.dense_layers)

    t0 = time.perf_counter()
    k, v, first = prompt_pass(model, prefix)
    rows = jnp.asarray(targets[:-1], jnp.int32)  # decode steps feed targets[0 .. n-2]

    def logits(policy: str, budget: int) -> np.ndarray:
        out = rows_pass(model.transformer, model.params, k, v, rows, policy=policy, budget=budget, **kw)
        return np.concatenate([first[None], np.asarray(out, np.float32)])  # [tokens, V]

    dense = logits("dense", 1)
    print(f"prompt + dense rows: {time.perf_counter() - t0:.1f} s", flush=True)
    results = []
    meta = {"model": model.source, "text": str(text_path), "context": args.context, "tokens": args.tokens,
            "block_size": bs, "sink_blocks": args.sink_blocks, "window_tokens": args.window_tokens,
            "dense_layers": args.dense_layers, "dtype": str(jnp.dtype(model.dtype))}
    name = args.name or ("oracle_accuracy_smoke" if args.smoke else f"oracle_accuracy_{jax.devices()[0].platform}")
    for budget in map(int, args.budgets.split(",")):
        for policy in args.policies.split(","):
            try:
                _, opt = parse_policy(policy)
            except ValueError as e:
                raise SystemExit(str(e)) from None
            if bs % opt["sub"]:
                raise SystemExit(f"{policy}: sub={opt['sub']} must divide --block-size {bs}")
            t1 = time.perf_counter()
            top1, kl = agreement(dense, logits(policy, -(-budget // bs)))
            results.append({"policy": policy, "budget_tokens": budget, "top1": top1, "kl": kl})
            print(f"budget {budget:5d} {policy:16s} top-1 {top1 * 100:6.2f}%  KL {kl:.4f}  "
                  f"({time.perf_counter() - t1:.1f} s)", flush=True)
            write_result(name, {**meta, "results": results, "complete": False}, args.out)
    path = write_result(name, {**meta, "results": results, "complete": True}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
