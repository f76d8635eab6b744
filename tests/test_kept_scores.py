"""The kept blocks' scoring kernel (pallas_kernels/kept_scores.py, Pallas interpret mode) against its jnp reference:
random keys, shuffled units, lengths at and between block boundaries (partial last blocks, one token, none),
padding entries, NaN-poisoned unused token slots and blocks, per-head and group sums, beta < 1, sub-blocks; and the
reference against block bounds scored by the metadata formula on a block written whole."""

import jax.numpy as jnp
import numpy as np
import pytest
from pulseinfer_jax.pallas_kernels.block_metadata import block_key_bounds_reference
from pulseinfer_jax.pallas_kernels.block_scoring import block_scores_reference, default_scale
from pulseinfer_jax.pallas_kernels.kept_scores import kept_scores, kept_scores_reference

from pulseinfer_jax.kv import quant as kv_quant
from pulseinfer_jax.selection.kept_blocks import kept_block_scores

B, U, BS, HKV, HD = 3, 40, 8, 2, 16


def _inputs(rng, g, kk, dtype=np.float32):
    """A NaN-poisoned pool whose listed blocks hold keys only below their lengths; units shuffled, -1 padded."""
    pool = np.full((U, 2, BS, HKV, HD), np.nan, np.float32)
    units = rng.permutation(np.arange(1, U))[: B * kk].reshape(B, kk).astype(np.int32)
    lens = rng.choice([0, 1, BS // 2 - 1, BS // 2, BS // 2 + 1, BS - 1, BS], size=(B, kk)).astype(np.int32)
    lens[:, 0] = BS  # at a boundary
    units[1, -1], lens[1, -1] = -1, 0  # padding
    for b in range(B):
        for i in range(kk):
            if units[b, i] >= 0:
                pool[units[b, i], 0, : lens[b, i]] = rng.normal(size=(lens[b, i], HKV, HD))
    q = rng.normal(size=(B, HKV * g, HD)).astype(np.float32)
    return jnp.asarray(q, dtype), jnp.asarray(pool, dtype), jnp.asarray(units), jnp.asarray(lens)


@pytest.mark.parametrize("g,kk,per_head,beta,m", [(4, 5, True, 0.5, 1), (3, 5, False, 1.0, 1), (1, 3, True, 1.0, 2),
                                                  (5, 6, True, 0.5, 4), (2, 1, False, 0.5, 2)])
def test_kernel_matches_reference(g, kk, per_head, beta, m):
    rng = np.random.default_rng(g * 100 + kk * 10 + m)
    q, pool, units, lens = _inputs(rng, g, kk)
    kw = dict(per_head=per_head, beta=beta, sub_blocks=m, scale=default_scale(HD, g, per_head))
    got = np.asarray(kept_scores(q, pool, units, lens, interpret=True, **kw))
    want = np.asarray(kept_scores_reference(q, pool, units, lens, **kw))
    assert got.shape == (B, HKV * g if per_head else HKV, kk)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    assert np.isneginf(got[1, :, -1]).all() and not np.isnan(got).any()  # padding -> -inf, no NaN leaks
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # the dispatcher the engine calls takes the kernel for this pool
    np.testing.assert_allclose(np.asarray(kept_block_scores(q, pool, units, lens, **kw)), want, rtol=2e-5, atol=2e-5)


def test_bfloat16_pool_matches_reference():
    rng = np.random.default_rng(7)
    q, pool, units, lens = _inputs(rng, 4, 5, jnp.bfloat16)
    kw = dict(per_head=True, beta=0.5, sub_blocks=1, scale=default_scale(HD, 4, True))
    got = np.asarray(kept_scores(q, pool, units, lens, interpret=True, **kw))
    want = np.asarray(kept_scores_reference(q, pool, units, lens, **kw))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m,per_head", [(1, True), (2, False)])
def test_float8_pool_matches_reference(m, per_head):
    """A float8 cache's blocks (e4m3 bytes, a bfloat16 scale per token and head, rotated): the kernel bounds the
    dequantised keys; unused token slots hold NaN bytes (0x7F), values and scales."""
    rng = np.random.default_rng(11 + m)
    q, pool, units, lens = _inputs(rng, 4, 5)
    keys = np.nan_to_num(np.asarray(pool), nan=0.0)  # [U, 2, bs, Hkv, hd]
    packed = np.array(kv_quant.pack_blocks(jnp.asarray(keys), kv_quant.STORAGE))  # [U, 2, rows, Hkv, hd] uint8
    n = np.zeros(U, np.int64)
    n[np.asarray(units)[np.asarray(units) >= 0]] = np.asarray(lens)[np.asarray(units) >= 0]
    for u_ in range(U):  # poison every slot past the written tokens: their values and their scale bytes
        packed[u_, :, n[u_]:BS] = 0x7F
        for slot in range(n[u_], BS):
            for byte in range(kv_quant.SCALE_BYTES):
                row, col = (int(x) for x in kv_quant.scale_position(np.int32(slot), byte, BS, HD))
                packed[u_, :, row, :, col] = 0x7F
    pool8 = jnp.asarray(packed)
    kw = dict(per_head=per_head, beta=0.5, sub_blocks=m, scale=default_scale(HD, 4, per_head))
    got = np.asarray(kept_scores(q, pool8, units, lens, interpret=True, **kw))
    want = np.asarray(kept_scores_reference(q, pool8, units, lens, **kw))
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_reference_is_the_metadata_score_of_a_whole_block():
    """A full block scores as block_scores over its block_key_bounds row: the units the selection mixes them in."""
    rng = np.random.default_rng(3)
    q, pool, units, lens = _inputs(rng, 2, 4)
    full = np.asarray(lens) == BS
    lo, hi = block_key_bounds_reference(pool, units.reshape(-1).clip(0), lens.reshape(-1))
    rows = jnp.arange(units.size, dtype=jnp.int32).reshape(units.shape)
    want = np.asarray(block_scores_reference(q, lo, hi, rows, per_head=True, beta=0.5))
    got = np.asarray(kept_scores_reference(q, pool, units, lens, per_head=True, beta=0.5, sub_blocks=1, scale=1.0))
    np.testing.assert_allclose(got[:, :, :][np.broadcast_to(full[:, None, :], got.shape)],
                               want[np.broadcast_to(full[:, None, :], want.shape)], rtol=1e-6)


def test_bad_arguments():
    rng = np.random.default_rng(0)
    q, pool, units, lens = _inputs(rng, 2, 3)
    kw = dict(per_head=True, beta=1.0, scale=1.0)
    with pytest.raises(ValueError, match="sub_blocks"):
        kept_scores(q, pool, units, lens, sub_blocks=3, interpret=True, **kw)
    with pytest.raises(ValueError, match="units"):
        kept_scores(q, pool, units[:, None], lens, sub_blocks=1, interpret=True, **kw)
    with pytest.raises(ValueError, match="head_dim"):
        kept_scores(q[..., :8], pool, units, lens, sub_blocks=1, interpret=True, **kw)
