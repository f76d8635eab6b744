"""selection/kept_blocks.py: the always-kept blocks' indices, their on-the-fly scores (against the metadata
path's kernel reference on the same bounds), causal partial blocks, empty sub-block slices, NaN-poisoned slots,
and the scatter into the candidates' scores."""

import jax.numpy as jnp
import numpy as np
import pytest
from pulseinfer_jax.pallas_kernels.block_metadata import block_key_bounds_reference
from pulseinfer_jax.pallas_kernels.block_scoring import block_scores_reference, default_scale

from pulseinfer_jax.selection.kept_blocks import kept_block_scores, kept_lens, kept_logical, with_kept_scores


@pytest.mark.parametrize("n,want", [
    (0, [-1, -1, -1, -1]), (1, [0, -1, -1, -1]), (2, [0, -1, -1, 1]), (4, [0, 1, 2, 3]),
    (3, [0, -1, 1, 2]), (9, [0, 6, 7, 8]),
])
def test_kept_logical_numpy_and_jnp(n, want):
    """One sink, three window blocks: each kept block once, -1 where there is none; numpy and jnp agree."""
    got = kept_logical(np.array([n]), 1, 3)
    assert got.dtype == np.int32 and got.tolist() == [want]
    assert np.asarray(kept_logical(jnp.array([n]), 1, 3, xp=jnp)).tolist() == [want]
    assert kept_logical(np.array([n, 9]), 1, 3)[1].tolist() == [0, 6, 7, 8]  # rows are independent


def test_kept_lens_causal():
    logical = jnp.array([[0, 3, 4, -1]])
    assert np.asarray(kept_lens(logical, jnp.array([17]), 4)).tolist() == [[4, 4, 2, 0]]  # token 17 = slot 1 of 4


def _pool(rng, nb, bs, hkv, hd):
    pool = rng.standard_normal((nb, 2, bs, hkv, hd)).astype(np.float32)
    return pool


@pytest.mark.parametrize("per_head,beta", [(True, 0.5), (False, 1.0)])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_full_blocks_score_like_their_metadata(per_head, beta, m):
    """Full blocks: the same scores as the metadata path (block_scores_reference on block_key_bounds_reference
    rows) for shuffled block ids; -1 padding scores -inf."""
    rng = np.random.default_rng(m)
    bs, hkv, g, hd = 8, 2, 2, 16
    pool = _pool(rng, 11, bs, hkv, hd)
    units = np.array([[7, 2, -1], [0, 10, 5]], np.int32)
    lens = np.where(units >= 0, bs, 0).astype(np.int32)
    q = rng.standard_normal((2, hkv * g, hd)).astype(np.float32)
    scale = default_scale(hd, g, per_head)
    got = np.asarray(kept_block_scores(jnp.asarray(q), jnp.asarray(pool), jnp.asarray(units), jnp.asarray(lens),
                                       per_head=per_head, beta=beta, sub_blocks=m, scale=scale))
    kmin, kmax = block_key_bounds_reference(jnp.asarray(pool), jnp.arange(11), jnp.full(11, bs), sub_blocks=m)
    want = np.asarray(block_scores_reference(jnp.asarray(q), kmin, kmax, jnp.asarray(units), per_head=per_head,
                                             beta=beta, sub_blocks=m, scale=scale))
    assert got.shape == want.shape == (2, hkv * g if per_head else hkv, 3)
    assert np.isneginf(got[0, :, 2]).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 2, 4])
def test_partial_block_reads_only_its_tokens(m):
    """A block with 3 of 8 tokens: scored from those 3 keys only (slots after them hold NaN and must not leak);
    sub-block slices with no token carry no mass (with m = 4: slice 0 (2 tokens) and slice 1 (1 token) only)."""
    rng = np.random.default_rng(7)
    bs, hkv, hd = 8, 1, 16
    pool = _pool(rng, 3, bs, hkv, hd)
    pool[1, 0, 3:] = np.nan  # unwritten slots of the partial block
    q = rng.standard_normal((1, 2, hd)).astype(np.float32)
    scale = default_scale(hd, 2, True)
    got = np.asarray(kept_block_scores(jnp.asarray(q), jnp.asarray(pool), jnp.array([[1]]), jnp.array([[3]]),
                                       per_head=True, beta=0.5, sub_blocks=m, scale=scale))[0, :, 0]
    assert np.isfinite(got).all()
    keys = pool[1, 0].astype(np.float64)  # [bs, 1, hd]
    sb = bs // m
    parts = []
    for j in range(m):
        k = keys[j * sb:min(3, (j + 1) * sb)]
        if len(k):
            lo, hi = k.min(0)[0], k.max(0)[0]
            parts.append(q[0] @ ((hi + lo) / 2) + 0.5 * np.abs(q[0]) @ ((hi - lo) / 2))  # [Hq]
    parts = np.stack(parts)  # [slices with tokens, Hq]
    want = np.log(np.exp(parts * scale).sum(0)) / scale
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_with_kept_scores_sets_listed_blocks_only():
    scores = jnp.full((2, 3, 6), -jnp.inf).at[:, :, 2].set(1.0)
    kept = jnp.arange(2 * 3 * 3, dtype=jnp.float32).reshape(2, 3, 3)
    logical = jnp.array([[0, 4, 5], [0, -1, 3]])
    out = np.asarray(with_kept_scores(scores, kept, logical))
    np.testing.assert_array_equal(out[0, :, [0, 4, 5]], np.asarray(kept[0]).T)
    np.testing.assert_array_equal(out[1, :, [0, 3]], np.asarray(kept[1][:, [0, 2]]).T)
    assert (out[:, :, 2] == 1.0).all() and np.isneginf(out[0, :, [1, 3]]).all() and np.isneginf(out[1, :, 5]).all()
