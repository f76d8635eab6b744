"""The sparse decode pieces composed as the engine will: key bounds -> Quest scores -> top-k selection ->
physical ids + lengths -> sparse attention (Pallas, interpret mode), against numpy attention over exactly the
selected tokens; with a budget covering the context it must equal dense attention."""

import jax.numpy as jnp
import numpy as np
import pytest
from pulseinfer_jax.pallas_kernels.block_metadata import block_key_bounds, update_bounds
from pulseinfer_jax.pallas_kernels.block_scoring import block_scores
from pulseinfer_jax.pallas_kernels.sparse_decode_attention import sparse_decode_attention

from pulseinfer_jax.selection.policy import candidate_ids, logical_to_physical, select_blocks, selected_block_lens


def _attend(q, k, v):
    """q [G, hd], k/v [T, hd] -> [G, hd] in float64."""
    s = q.astype(np.float64) @ k.T.astype(np.float64) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)


@pytest.mark.parametrize("mode", ["solohead", "headwise"])
@pytest.mark.parametrize("budget", [4, 16])
def test_selection_to_attention(mode, budget):
    rng = np.random.default_rng(budget + len(mode))
    bs, hkv, g, hd = 8, 2, 2, 64
    lengths = np.array([77, 40], np.int32)  # 10 and 5 logical blocks, both partial at the end
    nblk = -(-lengths // bs)
    mb = 16
    nb = int(nblk.sum()) + 5
    pool = np.full((nb, 2, bs, hkv, hd), np.nan, np.float32)  # unlisted blocks and unused slots stay NaN
    perm = rng.permutation(np.arange(1, nb))
    tables = np.zeros((2, mb), np.int32)
    toks = []
    used = 0
    for b, n in enumerate(lengths):
        tables[b, :nblk[b]] = perm[used:used + nblk[b]]
        used += nblk[b]
        kv = rng.standard_normal((2, n, hkv, hd)).astype(np.float32)
        toks.append(kv)
        for j in range(nblk[b]):
            m = min(bs, n - j * bs)
            pool[tables[b, j], :, :m] = kv[:, j * bs: j * bs + m]
    q = rng.standard_normal((2, hkv * g, hd)).astype(np.float32)

    ids = np.concatenate([tables[b, :nblk[b]] for b in range(2)])
    lens = np.concatenate([[min(bs, n - j * bs) for j in range(k)] for n, k in zip(lengths, nblk, strict=True)])
    kmin, kmax = block_key_bounds(jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(lens, jnp.int32))
    meta_min, meta_max = update_bounds(jnp.zeros((nb, hkv, hd)), jnp.zeros((nb, hkv, hd)), jnp.asarray(ids),
                                       kmin, kmax)
    tables_j, nblk_j, len_j = jnp.asarray(tables), jnp.asarray(nblk, jnp.int32), jnp.asarray(lengths)
    scores = block_scores(jnp.asarray(q), meta_min, meta_max, candidate_ids(tables_j, nblk_j))
    sel = select_blocks(scores, nblk_j, budget_blocks=budget, sink_blocks=1, window_blocks=2, mode=mode,
                        score_scale=1.0 / (g * np.sqrt(hd)))
    phys = logical_to_physical(sel, tables_j)
    blens = selected_block_lens(sel, len_j, bs)
    o, _, _ = sparse_decode_attention(jnp.asarray(q), jnp.asarray(pool), phys, blens)
    o = np.asarray(o)
    assert np.isfinite(o).all()
    sel = np.asarray(sel)
    for b in range(2):
        for h in range(hkv):
            logical = [j for j in sel[b, h if mode == "headwise" else 0] if j >= 0]
            if budget >= nblk[b]:
                assert logical == list(range(nblk[b]))  # everything selected: dense attention
            else:
                assert {0, nblk[b] - 2, nblk[b] - 1} <= set(logical) and len(logical) == budget
            t = np.concatenate([np.arange(j * bs, min((j + 1) * bs, lengths[b])) for j in logical])
            k, v = toks[b][0][t, h], toks[b][1][t, h]
            ref = _attend(q[b, h * g:(h + 1) * g], k, v)
            np.testing.assert_allclose(o[b, h * g:(h + 1) * g], ref, atol=2e-5, rtol=2e-5)
