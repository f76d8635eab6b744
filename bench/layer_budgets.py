"""Would a per-layer budget beat the engine's uniform one? Attention concentration by layer, and the best split.

    python bench/layer_budgets.py             # SmolLM2, the GPL-3 and NEWS.txt windows of oracle_accuracy
    python bench/layer_budgets.py --smoke     # tiny sizes (CPU check of the script)

The engine gives every sparse layer the same budget (sinks + window + the same number of selected middle blocks).
Layers differ in how concentrated their attention is, so a split that gives flat layers more blocks and peaked
ones fewer (PyramidKV / Ada-KV style, here for query-aware selection) could keep more attention mass for the same
total. This measures the ceiling of that idea with an oracle: for each text, a dense teacher-forced pass (the
oracle harness's windows: `--context` prompt tokens, then `--tokens` rows) records, per layer, the mean over rows of
the true attention mass (averaged over query heads, SoloHead) that the always-kept blocks plus the k best middle
blocks hold, for every k. The greedy split of (sparse layers x k) middle blocks by marginal mass (optimal: the
curves are concave) is then compared with the uniform split, on the text it was fitted on (in-sample: the most it
could win) and on the other text (a split fitted once and deployed: what it would win). Reported: the mean
attention mass dropped per sparse layer, uniform vs split, per budget. No engine code involved; the oracle ranks
by true attention, so this bounds what any scorer would gain from the split.
"""

from __future__ import annotations

import argparse
import heapq
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.accuracy import TEXTS  # noqa: E402
from bench.common import add_block_layout_args, write_result  # noqa: E402
from bench.oracle_accuracy import _block_view, prompt_pass  # noqa: E402


def mass_curves(model, prompt: list[int], rows: list[int], *, bs: int, sink: int, window: int) -> np.ndarray:
    """[L, K + 1] float64: per layer, the mean over the teacher-forced rows of the attention mass (mean over query
    heads) held by the sink / window blocks plus the k middle blocks of most mass, k = 0..K (K = the most middle
    blocks a row has)."""
    m, c = model.transformer, model.cfg
    k_prompt, v_prompt, _ = prompt_pass(model, prompt)
    tokens = jnp.asarray(rows, jnp.int32)

    @jax.jit
    def run(params, kp, vp, tokens):
        p, r = kp.shape[1], tokens.shape[0]
        t, g, hd = p + r, c.group_size, c.head_dim
        nbk = -(-t // bs)
        pos = p + jnp.arange(r, dtype=jnp.int32)
        causal = jnp.arange(t)[None, :] <= pos[:, None]  # [R, T]
        nb_row = pos // bs + 1
        j = jnp.arange(nbk)[None]
        mid = (j >= sink) & (j < nb_row[:, None] - window)  # [R, NB]: the middle blocks each row may select

        def attend(layer, q, k, v, curves):
            keys = jnp.concatenate([kp[layer], k[0]]).astype(jnp.float32)  # [T, Hkv, hd]
            vals = jnp.concatenate([vp[layer], v[0]]).astype(jnp.float32)
            hi = jax.lax.Precision.HIGHEST
            s = jnp.einsum("rhd,thd->rht", q[0].astype(jnp.float32), jnp.repeat(keys, g, axis=1),
                           precision=hi) * hd ** -0.5
            pr = jax.nn.softmax(jnp.where(causal[:, None], s, -jnp.inf), axis=-1)  # [R, Hq, T]
            mass = _block_view(pr, bs).sum(-1).mean(1)  # [R, NB]: SoloHead's view, every head counted once
            kept = jnp.where(mid, 0.0, mass).sum(-1)  # sinks, window, partial block (zero past the row's own)
            best = -jnp.sort(-jnp.where(mid, mass, 0.0), axis=-1)
            cum = kept[:, None] + jnp.concatenate([jnp.zeros((r, 1)), jnp.cumsum(best, -1)], -1)  # [R, NB + 1]
            o = jnp.einsum("rht,thd->rhd", pr, jnp.repeat(vals, g, axis=1), precision=hi)
            return o[None].astype(q.dtype), curves.at[layer].set(cum.mean(0))

        x = m.embed(params, tokens[None])
        _, curves = m.layers(params, x, pos[None], attend, jnp.zeros((c.num_layers, nbk + 1)))
        return curves

    return np.asarray(run(model.params, k_prompt, v_prompt, tokens), np.float64)


def greedy_split(curves: np.ndarray, layers: list[int], per_layer: int) -> dict[int, int]:
    """Middle blocks per layer maximising the summed kept mass for len(layers) * per_layer blocks in all."""
    top = curves.shape[1] - 1
    alloc = {layer: 0 for layer in layers}
    heap = [(-(curves[layer, 1] - curves[layer, 0]), layer) for layer in layers]
    heapq.heapify(heap)
    for _ in range(min(per_layer * len(layers), top * len(layers))):
        _, layer = heapq.heappop(heap)
        alloc[layer] += 1
        n = alloc[layer]
        if n < top:
            heapq.heappush(heap, (-(curves[layer, n + 1] - curves[layer, n]), layer))
    return alloc


def dropped(curves: np.ndarray, alloc: dict[int, int]) -> float:
    """Mean attention mass dropped per sparse layer under a split."""
    top = curves.shape[1] - 1
    return float(np.mean([1.0 - curves[layer, min(k, top)] for layer, k in alloc.items()]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--texts", default=",".join(map(str, TEXTS)),
                    help="two or more comma-separated texts (each split is also tried on the others)")
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--budgets", default="256,512,1024,2048", help="tokens per sparse layer (uniform)")
    add_block_layout_args(ap)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, random-weight SmolLM2 shape, token ids")
    ap.add_argument("--name", default=None, help="result file name (default layer_budgets_<platform>)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from pulseinfer_jax.models.loading import load_model

    bs, sink, window = args.block_size, args.sink_blocks, args.window_tokens // args.block_size
    if args.smoke:
        args.model, args.context, args.tokens, args.budgets = "random:smollm2-135m", 200, 16, "128"
    model = load_model(args.model)
    curves, names = [], []
    for i, text in enumerate(args.texts.split(",")):
        if args.smoke:  # random token ids: no tokenizer or text needed
            ids = np.random.default_rng(i).integers(3, model.cfg.vocab_size, args.context + args.tokens).tolist()
        else:
            if model.tokenizer is None:
                raise SystemExit("needs a model with a tokenizer (or --smoke)")
            ids = model.tokenizer.encode(pathlib.Path(text).read_text(encoding="utf-8", errors="replace"),
                                         add_special_tokens=True)
            if len(ids) < args.context + args.tokens:
                raise SystemExit(f"{text} has {len(ids)} tokens, fewer than --context + --tokens")
        ids = ids[-(args.context + args.tokens):]
        curves.append(mass_curves(model, ids[:args.context], ids[args.context:-1], bs=bs, sink=sink, window=window))
        names.append(pathlib.Path(text).name)
        print(f"{names[-1]}: curves of {curves[-1].shape[0]} layers", flush=True)
    layers = list(range(args.dense_layers, model.cfg.num_layers))
    results = []
    for budget in map(int, args.budgets.split(",")):
        per = -(-budget // bs) - sink - window  # middle blocks per layer under the uniform budget
        if per < 1:
            raise SystemExit(f"budget {budget} leaves no middle block after sinks and window")
        for fit, fc in enumerate(curves):
            alloc = greedy_split(fc, layers, per)
            for ev, ec in enumerate(curves):
                uni, split = dropped(ec, {layer: per for layer in layers}), dropped(ec, alloc)
                results.append({"budget_tokens": budget, "fitted_on": names[fit], "evaluated_on": names[ev],
                                "dropped_uniform": uni, "dropped_split": split,
                                "split": [alloc[layer] for layer in layers]})
                print(f"budget {budget:5d}  split fitted on {names[fit]:10s} evaluated on {names[ev]:10s}: dropped "
                      f"mass {uni:.4f} uniform -> {split:.4f} ({(split / uni - 1) * 100:+.0f}%)", flush=True)
    meta = {"model": model.source, "texts": args.texts.split(","), "context": args.context, "tokens": args.tokens,
            "block_size": bs, "sink_blocks": sink, "window_tokens": args.window_tokens,
            "dense_layers": args.dense_layers,
            "curves": {n: np.round(c, 5).tolist() for n, c in zip(names, curves, strict=True)}}
    name = args.name or ("layer_budgets_smoke" if args.smoke else f"layer_budgets_{jax.devices()[0].platform}")
    print(f"wrote {write_result(name, {**meta, 'results': results}, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
