"""bench/layer_budgets.py: the greedy per-layer split is optimal on concave curves, the mass curves are what they
claim (monotone, all middle blocks = all the mass, k = 0 = the always-kept blocks' mass), the script runs."""

import itertools
import json

import jax.numpy as jnp
import numpy as np

from bench import layer_budgets as lb


def test_greedy_split_is_optimal_on_concave_curves():
    rng = np.random.default_rng(0)
    for trial in range(20):
        k = int(rng.integers(2, 6))
        gains = -np.sort(-rng.dirichlet(np.ones(k), size=3) * rng.uniform(0.2, 1, (3, 1)), axis=1)  # decreasing
        curves = np.concatenate([np.zeros((3, 1)), np.cumsum(gains, 1)], 1) + rng.uniform(0, 0.1, (3, 1))
        layers = [0, 1, 2]
        per = int(rng.integers(1, k))
        alloc = lb.greedy_split(curves, layers, per)
        assert sum(alloc.values()) == 3 * per and all(0 <= v <= k for v in alloc.values())
        best = max(sum(curves[i, a[i]] for i in layers) for a in itertools.product(range(k + 1), repeat=3)
                   if sum(a) == 3 * per)
        assert sum(curves[i, alloc[i]] for i in layers) >= best - 1e-12, trial
        assert lb.dropped(curves, alloc) <= lb.dropped(curves, dict.fromkeys(layers, per)) + 1e-12


def test_mass_curves_are_kept_mass_by_number_of_middle_blocks(tiny4):
    rng = np.random.default_rng(1)
    toks = rng.integers(3, tiny4.cfg.vocab_size, 90).tolist()
    bs, sink, window = 4, 1, 2
    curves = lb.mass_curves(tiny4, toks[:70], toks[70:], bs=bs, sink=sink, window=window)
    nb = -(-90 // bs)
    assert curves.shape == (tiny4.cfg.num_layers, nb + 1)
    assert (np.diff(curves, axis=1) >= -1e-7).all()  # more blocks never keep less
    np.testing.assert_allclose(curves[:, -1], 1.0, atol=1e-5)  # every block: all the mass
    # k = 0: the always-kept blocks' mass, here checked directly for layer 0 (its input does not depend on the
    # attention of other layers) at the first row
    m, c = tiny4.transformer, tiny4.cfg

    def attend(layer, q, kk, v, st):  # dense pass over the 71 tokens, keeping layer 0's queries and keys
        qs, ks = st
        st = (jnp.where(layer == 0, q[0].astype(jnp.float32), qs), jnp.where(layer == 0, kk[0].astype(jnp.float32), ks))
        return m.causal_attention(q, kk, v), st

    x = m.embed(tiny4.params, jnp.asarray(toks[:71])[None])
    init = (jnp.zeros((71, c.num_heads, c.head_dim)), jnp.zeros((71, c.num_kv_heads, c.head_dim)))
    _, (qs, ks) = m.layers(tiny4.params, x, jnp.arange(71)[None], attend, init)
    q0 = np.asarray(qs[70], np.float64)  # [Hq, hd]: the first row is position 70
    keys = np.asarray(ks, np.float64)  # [71, Hkv, hd]
    s = np.einsum("hd,thd->ht", q0, np.repeat(keys, c.group_size, axis=1)) / np.sqrt(c.head_dim)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    blk = np.arange(71) // bs
    n = 70 // bs + 1
    kept = (blk < sink) | (blk >= n - window)
    # the curve averages rows; with one row (toks[70:71]) it is that row's value
    one = lb.mass_curves(tiny4, toks[:70], toks[70:71], bs=bs, sink=sink, window=window)
    np.testing.assert_allclose(one[0, 0], p[:, kept].sum(-1).mean(), rtol=1e-4)
    per_block = np.bincount(blk, weights=p.mean(0))  # [blocks] mass, mean over query heads
    middle = np.sort(per_block[sink:n - window])[::-1]
    np.testing.assert_allclose(one[0, 1:4], p[:, kept].sum(-1).mean() + np.cumsum(middle[:3]), rtol=1e-4)


def test_layer_budgets_smoke(tmp_path):
    assert lb.main(["--smoke", "--out", str(tmp_path), "--name", "lb"]) == 0
    data = json.loads((tmp_path / "lb.json").read_text())
    assert len(data["results"]) == 4 and len(data["curves"]) == 2
    for r in data["results"]:
        assert 0 <= r["dropped_split"] <= 1 and 0 <= r["dropped_uniform"] <= 1
        if r["fitted_on"] == r["evaluated_on"]:  # in-sample the optimal split cannot lose
            assert r["dropped_split"] <= r["dropped_uniform"] + 1e-9
