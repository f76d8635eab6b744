"""Quest block metadata and scoring (Pallas interpret mode on CPU) against jnp/numpy references.

Pools are NaN everywhere a test did not write, metadata rows of unlisted blocks are NaN, and padding slots
of partial blocks are NaN: any stray read shows up as a NaN in the result.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pulseinfer_jax.pallas_kernels.block_metadata import (
    block_key_bounds,
    block_key_bounds_reference,
    init_bounds,
    round_bounds_outward,
    set_rows,
    take_rows,
    update_bounds,
)
from pulseinfer_jax.pallas_kernels.block_scoring import (
    KeyAppend,
    append_and_score,
    append_and_score_reference,
    block_scores,
    block_scores_reference,
    default_scale,
)
from pulseinfer_jax.pallas_kernels.kept_scores import kept_scores_reference

from pulseinfer_jax.kv import quant as kv_quant


def _pool(rng, nb, bs, hkv, hd, lens):
    """[NB, 2, bs, Hkv, hd] float32 pool: block i holds lens[i] random keys (scaled per feature so the bounds
    differ per feature), NaN elsewhere. Returns (pool, keys) with keys[i] = [lens[i], Hkv, hd]."""
    pool = np.full((nb, 2, bs, hkv, hd), np.nan, np.float32)
    scale = rng.uniform(0.2, 3.0, size=(hkv, hd)).astype(np.float32)
    keys = []
    for i, n in enumerate(lens):
        k = (rng.standard_normal((n, hkv, hd)) * scale + rng.standard_normal((hkv, hd))).astype(np.float32)
        pool[i, 0, :n] = k
        pool[i, 1, :n] = rng.standard_normal((n, hkv, hd))
        keys.append(k)
    return pool, keys


@pytest.mark.parametrize("bs,hd,dtype", [(8, 64, jnp.float32), (16, 128, jnp.bfloat16), (32, 64, jnp.float32)])
def test_block_key_bounds_valid_tokens_only(bs, hd, dtype):
    rng = np.random.default_rng(1000 * bs + hd)
    hkv, nb = 2, 9
    lens = [bs, 1, bs - 1, bs // 2, 0, bs, 3, bs, 2]
    pool, _ = _pool(rng, nb, bs, hkv, hd, lens)
    pool = jnp.asarray(pool, dtype)  # NaN in every slot at or past a block's length
    ids = np.array(rng.permutation(nb), np.int32)
    blens = np.array([lens[i] for i in ids], np.int32)
    kmin, kmax = block_key_bounds(pool, jnp.asarray(ids), jnp.asarray(blens))
    assert kmin.shape == kmax.shape == (nb, hkv, hd) and kmin.dtype == jnp.float32
    keys = np.asarray(pool.astype(jnp.float32))[:, 0]
    for j, (b, n) in enumerate(zip(ids, blens, strict=True)):
        want_min = keys[b, :n].min(0) if n else np.zeros((hkv, hd), np.float32)
        want_max = keys[b, :n].max(0) if n else np.zeros((hkv, hd), np.float32)
        np.testing.assert_array_equal(np.asarray(kmin[j]), want_min)  # min/max are exact
        np.testing.assert_array_equal(np.asarray(kmax[j]), want_max)
    full = jnp.stack([jnp.full_like(pool, jnp.nan), pool])  # [L=2, NB, 2, bs, Hkv, hd]: read layer 1 in place
    fmin, fmax = block_key_bounds(full, jnp.asarray(ids), jnp.asarray(blens), layer=jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(fmin), np.asarray(kmin))
    np.testing.assert_array_equal(np.asarray(fmax), np.asarray(kmax))
    rmin, rmax = block_key_bounds_reference(pool, jnp.asarray(ids), jnp.asarray(blens))
    np.testing.assert_array_equal(np.asarray(kmin), np.asarray(rmin))
    np.testing.assert_array_equal(np.asarray(kmax), np.asarray(rmax))


@pytest.mark.parametrize("bs,hd,m", [(8, 32, 1), (16, 16, 2)])
def test_block_key_bounds_of_a_float8_pool_are_the_dequantised_keys(bs, hd, m):
    """A float8 pool (values + bfloat16 scales in its scale rows, `kv_quant.pack_blocks`) is bounded by the bounds of
    its dequantised keys (rotated back), for one layer's pool, the full cache with `layer`, and the reference; the
    value and scale bytes of slots at or past each block's length are NaN bytes and never leak."""
    from test_sparse_decode_attention import poison_scales

    rng = np.random.default_rng(7 * bs + hd + m)
    hkv, nb = 2, 7
    lens = [bs, 1, bs - 1, 0, bs, 2, bs // 2]
    pool, _ = _pool(rng, nb, bs, hkv, hd, lens)
    pool = np.nan_to_num(pool) * np.exp2(rng.uniform(-3, 3, (nb, 2, bs, hkv, 1)))  # scales differ per token
    raw = np.array(kv_quant.pack_blocks(jnp.asarray(pool), jnp.float8_e4m3fn))  # [NB, 2, bs + r, Hkv, hd] uint8
    for i, n in enumerate(lens):
        raw[i, :, n:bs] = 0x7F  # NaN values past the length
        poison_scales(raw[i], n, bs, hd)  # and their scales
    f8 = jnp.asarray(raw)
    ids = jnp.asarray(rng.permutation(nb), jnp.int32)
    blens = jnp.asarray([lens[i] for i in np.asarray(ids)], jnp.int32)
    want = block_key_bounds(kv_quant.unpack_blocks(f8, jnp.float32), ids, blens, sub_blocks=m)
    assert np.isfinite(np.asarray(want[0])).all() and np.isfinite(np.asarray(want[1])).all()
    full = jnp.stack([jnp.full_like(f8, jnp.nan), f8])  # [L=2, NB, 2, bs + 1, Hkv, hd]
    for got in (block_key_bounds(f8, ids, blens, sub_blocks=m),
                block_key_bounds(full, ids, blens, layer=jnp.int32(1), sub_blocks=m),
                block_key_bounds_reference(f8, ids, blens, sub_blocks=m)):
        for g, w in zip(got, want, strict=True):  # (float32 rounding of the rotation back, which varies with shape)
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6 * np.abs(w).max())


@pytest.mark.parametrize("bs,m", [(16, 2), (8, 4), (32, 2)])
def test_block_key_bounds_sub_blocks_are_the_bounds_of_each_slice(bs, m):
    """sub_blocks = m: row i*m + j bounds slice j of block ids[i] (tokens [j bs/m, (j+1) bs/m) below the block's
    length), bit-exact against the reference and against slicing the pool into blocks of bs/m; slices past the
    length (the partial block's tail) get zero bounds; NaN padding never leaks; m must divide bs."""
    rng = np.random.default_rng(bs * 10 + m)
    hkv, hd, nb = 2, 64, 8
    sb = bs // m
    lens = [bs, sb, sb + 1, 1, 0, bs - 1, 2 * sb if m > 2 else bs, bs]  # lengths at slice boundaries
    pool, _ = _pool(rng, nb, bs, hkv, hd, lens)
    ids = np.array(rng.permutation(nb), np.int32)
    blens = np.array([lens[i] for i in ids], np.int32)
    kmin, kmax = block_key_bounds(jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(blens), sub_blocks=m)
    assert kmin.shape == (nb * m, hkv, hd)
    rmin, rmax = block_key_bounds_reference(jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(blens), sub_blocks=m)
    np.testing.assert_array_equal(np.asarray(kmin), np.asarray(rmin))
    np.testing.assert_array_equal(np.asarray(kmax), np.asarray(rmax))
    # the same as bounding a pool of blocks of size bs/m
    fine = pool.reshape(nb, 2, m, sb, hkv, hd).transpose(0, 2, 1, 3, 4, 5).reshape(nb * m, 2, sb, hkv, hd)
    fine_ids = (ids[:, None] * m + np.arange(m)).reshape(-1).astype(np.int32)
    fine_lens = np.clip(blens[:, None] - np.arange(m) * sb, 0, sb).reshape(-1).astype(np.int32)
    fmin, fmax = block_key_bounds(jnp.asarray(fine), jnp.asarray(fine_ids), jnp.asarray(fine_lens))
    np.testing.assert_array_equal(np.asarray(kmin), np.asarray(fmin))
    np.testing.assert_array_equal(np.asarray(kmax), np.asarray(fmax))
    assert np.isfinite(np.asarray(kmin)).all() and np.isfinite(np.asarray(kmax)).all()
    empty = fine_lens == 0
    assert empty.any() and not np.asarray(kmin)[empty].any() and not np.asarray(kmax)[empty].any()
    with pytest.raises(ValueError, match="must be a positive int dividing the block size"):
        block_key_bounds(jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(blens), sub_blocks=3)


@pytest.mark.parametrize("group,per_head,beta,m,tile_k", [(2, True, 0.5, 2, 4), (3, False, 1.0, 2, None),
                                                         (1, True, 1.0, 4, 8), (4, False, 0.25, 4, 4)])
def test_block_scores_sub_blocks_match_reference_and_combine_slices(group, per_head, beta, m, tile_k):
    """sub_blocks = m: the kernel equals the reference (shuffled -1 padded candidates, NaN in every metadata row of
    an unlisted block); a block's score is log(sum_j exp(scale s_j)) / scale of its slices' scores s_j (each slice
    scored as a block of its own), so it is at least the best slice's, and at beta = 1 still bounds every true q.k
    of the block; identical slices add exactly log(m) / scale."""
    bs, hd, k, hkv = 16, 64, 11, 2
    rng = np.random.default_rng(31 * group + m)
    nb = 2 * k + 3
    lens = [bs] * nb
    pool, keys = _pool(rng, nb, bs, hkv, hd, lens)
    listed = rng.permutation(np.arange(1, nb))[: 2 * k - 3]
    cand = np.full((2, k), -1, np.int32).reshape(-1)
    cand[rng.permutation(2 * k)[: len(listed)]] = listed
    cand = cand.reshape(2, k)
    kmin, kmax = block_key_bounds(jnp.asarray(pool), jnp.asarray(listed, jnp.int32),
                                  jnp.asarray([bs] * len(listed), jnp.int32), sub_blocks=m)
    rows = jnp.asarray((listed[:, None] * m + np.arange(m)).reshape(-1), jnp.int32)
    meta_min, meta_max = update_bounds(jnp.full((nb * m, hkv, hd), jnp.nan), jnp.full((nb * m, hkv, hd), jnp.nan),
                                       rows, kmin, kmax)
    q = jnp.asarray(rng.standard_normal((2, hkv * group, hd)) * 0.5, jnp.float32)
    args = (q, meta_min, meta_max, jnp.asarray(cand))
    out = np.asarray(block_scores(*args, per_head=per_head, beta=beta, sub_blocks=m, tile_k=tile_k))
    ref = np.asarray(block_scores_reference(*args, per_head=per_head, beta=beta, sub_blocks=m))
    fin = np.isfinite(ref)
    assert (np.isfinite(out) == fin).all() and (fin == (cand >= 0)[:, None]).all()
    atol = 1e-4 * np.abs(ref[fin]).max()
    np.testing.assert_allclose(out[fin], ref[fin], rtol=1e-5, atol=atol)
    # slice scores: the same metadata read as blocks of their own (candidate ids = rows)
    slice_cand = np.where(cand[:, :, None] >= 0, cand[:, :, None] * m + np.arange(m), -1).reshape(2, -1)
    parts = np.asarray(block_scores_reference(q, meta_min, meta_max, jnp.asarray(slice_cand, jnp.int32),
                                              per_head=per_head, beta=beta))
    parts = parts.reshape(*parts.shape[:2], k, m).astype(np.float64)
    scale = 1.0 / ((1 if per_head else group) * hd ** 0.5)
    with np.errstate(invalid="ignore"):
        top = parts.max(-1)
        want = top + np.log(np.exp((parts - top[..., None]) * scale).sum(-1)) / scale
    np.testing.assert_allclose(out[fin], want[fin], rtol=1e-5, atol=atol)
    assert (out[fin] >= top[fin] - atol).all()
    if beta == 1.0:
        for b in range(2):
            for c in range(k):
                if cand[b, c] < 0:
                    continue
                qk = np.einsum("hgd,thd->hgt", np.asarray(q[b]).reshape(hkv, group, hd), keys[cand[b, c]]).max(-1)
                best = qk.reshape(-1) if per_head else qk.sum(-1)
                assert (out[b, :, c] >= best - 1e-3 * (1 + np.abs(best))).all()
    same = jnp.repeat(meta_min[::m], m, axis=0), jnp.repeat(meta_max[::m], m, axis=0)  # every slice = slice 0
    one = np.asarray(block_scores(q, same[0][::m], same[1][::m], jnp.asarray(cand), per_head=per_head, beta=beta))
    rep = np.asarray(block_scores(q, *same, jnp.asarray(cand), per_head=per_head, beta=beta, sub_blocks=m))
    np.testing.assert_allclose(rep[fin], one[fin] + np.log(m) / scale, rtol=1e-5, atol=atol)
    with pytest.raises(ValueError, match="not a multiple of sub_blocks"):
        block_scores(q, meta_min[:-1], meta_max[:-1], jnp.asarray(cand), sub_blocks=m)
    with pytest.raises(ValueError, match="sub_blocks=0 must be a positive int"):
        block_scores_reference(*args, sub_blocks=0)


def test_update_bounds_writes_listed_rows_and_drops_padding():
    rng = np.random.default_rng(7)
    nb, hkv, hd = 6, 2, 64
    meta_min = jnp.full((nb, hkv, hd), jnp.nan)
    meta_max = jnp.full((nb, hkv, hd), jnp.nan)
    ids = jnp.asarray([4, -1, 1], jnp.int32)
    lo = jnp.asarray(rng.standard_normal((3, hkv, hd)), jnp.float32)
    hi = lo + 1.0
    new_min, new_max = update_bounds(meta_min, meta_max, ids, lo, hi)
    np.testing.assert_array_equal(np.asarray(new_min[4]), np.asarray(lo[0]))
    np.testing.assert_array_equal(np.asarray(new_max[1]), np.asarray(hi[2]))
    for row in (0, 2, 3, 5):  # untouched: -1 must not wrap around to the last row
        assert np.isnan(np.asarray(new_min[row])).all() and np.isnan(np.asarray(new_max[row])).all()
    zmin, zmax = init_bounds(nb, hkv, hd)
    assert zmin.shape == (nb, hkv, hd) and not np.asarray(zmax).any()
    with pytest.raises(ValueError, match="must be \\[n, Hkv, hd\\]"):
        update_bounds(meta_min, meta_max, ids, lo[:2], hi[:2])


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32])
def test_rows_move_bit_for_bit_and_float8_moves_as_bytes(dtype):
    """take_rows / set_rows equal plain indexing bit for bit (NaN rows too), out-of-range rows dropped; and on
    XLA:CPU a float8 metadata array is never converted whole to gather or scatter a few rows (it was, twice per
    array and layer: the decode step's jnp path paid 2 ms a layer)."""
    rng = np.random.default_rng(3)
    meta = jnp.asarray(rng.standard_normal((40, 2, 16)), jnp.float32).at[5].set(jnp.nan).astype(dtype)
    rows = jnp.asarray([[5, 0], [39, 7]], jnp.int32)
    bits = lambda x: np.asarray(x).view(np.uint8)  # noqa: E731
    np.testing.assert_array_equal(bits(take_rows(meta, rows)), bits(meta[rows]))
    vals = jnp.asarray(rng.standard_normal((3, 2, 16)), jnp.float32).astype(dtype)
    at = jnp.asarray([2, 40, 5], jnp.int32)  # 40: out of range, dropped
    np.testing.assert_array_equal(bits(set_rows(meta, at, vals)), bits(meta.at[at].set(vals, mode="drop")))

    def step(meta, at, vals, rows):
        meta = set_rows(meta, at, vals)
        return meta, take_rows(meta, rows).astype(jnp.float32)

    hlo = jax.jit(step, donate_argnums=0).lower(meta, at, vals, rows).compile().as_text()
    whole = [line for line in hlo.splitlines() if "[40,2,16]" in line and " convert(" in line]
    assert not whole, "\n".join(whole)


def _all_finite_values(dtype) -> np.ndarray:
    """Every finite value of a 1- or 2-byte float dtype, ascending (float64), from its bit patterns."""
    dt = jnp.dtype(dtype)
    bits = np.arange(2 ** (8 * dt.itemsize), dtype=np.uint8 if dt.itemsize == 1 else np.uint16)
    vals = np.asarray(jax.lax.bitcast_convert_type(jnp.asarray(bits), dt).astype(jnp.float32), np.float64)
    return np.unique(vals[np.isfinite(vals)])


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float16])
def test_round_bounds_outward_is_the_nearest_enclosing_pair(dtype):
    """kmin goes to the largest value of the dtype <= it, kmax to the smallest >= it (brute force over every
    finite value of the dtype): stored bounds still bound, and by as little as the dtype allows; in-range
    values the dtype holds exactly stay as they are; beyond the finite range they saturate; NaN stays NaN."""
    vals = _all_finite_values(dtype)
    top = vals.max()
    rng = np.random.default_rng(5)
    step = max(1, len(vals) // 4000)
    x = np.concatenate([rng.standard_normal(4000) * s for s in (1e-3, 0.3, 4.0, 60.0)]
                       + [vals[::step], ((vals[:-1] + vals[1:]) / 2)[::step], [0.0, -0.0, 1e-30, -1e-30]]
                       ).astype(np.float32)
    # in range; XLA flushes float32 subnormals to zero (bf16's subnormals are float32 subnormals): not tested
    x = x[(np.abs(x) <= top) & ((np.abs(x) >= np.finfo(np.float32).tiny) | (x == 0))]
    lo, hi = round_bounds_outward(jnp.asarray(x), jnp.asarray(x), dtype)
    assert lo.dtype == hi.dtype == jnp.dtype(dtype)
    lo, hi = (np.asarray(a.astype(jnp.float32), np.float64) for a in (lo, hi))
    want_lo = vals[np.searchsorted(vals, x, side="right") - 1]
    want_hi = vals[np.searchsorted(vals, x, side="left")]
    np.testing.assert_array_equal(lo, want_lo)
    np.testing.assert_array_equal(hi, want_hi)
    exact = np.isin(x.astype(np.float64), vals)
    assert exact.sum() > 200 and (lo[exact] == x[exact]).all() and (hi[exact] == x[exact]).all()
    lo, hi = round_bounds_outward(jnp.asarray([3 * top, -3 * top, np.nan]), jnp.asarray([3 * top, -3 * top, np.nan]),
                                  dtype)
    lo, hi = np.asarray(lo.astype(jnp.float32)), np.asarray(hi.astype(jnp.float32))
    assert lo[0] == hi[0] == top and lo[1] == hi[1] == -top and np.isnan(lo[2]) and np.isnan(hi[2])
    with pytest.raises(ValueError, match="float dtype"):
        round_bounds_outward(jnp.zeros(2), jnp.zeros(2), jnp.int8)


def test_update_bounds_rounds_outward_into_float8_rows():
    rng = np.random.default_rng(9)
    nb, hkv, hd = 5, 2, 64
    meta = jnp.full((nb, hkv, hd), jnp.nan, jnp.float8_e4m3fn)
    lo = jnp.asarray(rng.standard_normal((2, hkv, hd)) * 3, jnp.float32)
    hi = lo + jnp.asarray(rng.uniform(0, 2, (2, hkv, hd)), jnp.float32)
    new_min, new_max = update_bounds(meta, meta, jnp.asarray([3, 0], jnp.int32), lo, hi)
    assert new_min.dtype == new_max.dtype == jnp.float8_e4m3fn
    want_min, want_max = round_bounds_outward(lo, hi, jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(new_min[jnp.asarray([3, 0])].astype(jnp.float32)),
                                  np.asarray(want_min.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(new_max[jnp.asarray([3, 0])].astype(jnp.float32)),
                                  np.asarray(want_max.astype(jnp.float32)))
    assert (np.asarray(new_min[jnp.asarray([3, 0])].astype(jnp.float32)) <= np.asarray(lo)).all()
    assert (np.asarray(new_max[jnp.asarray([3, 0])].astype(jnp.float32)) >= np.asarray(hi)).all()
    assert not (np.asarray(new_min.astype(jnp.float32)) == np.asarray(lo)[0]).all()  # float8 really rounded
    with pytest.raises(ValueError, match="one dtype"):
        update_bounds(meta, meta.astype(jnp.float32), jnp.asarray([3, 0], jnp.int32), lo, hi)


def _scoring_case(seed, bs, group, hd, k, hkv=2, batch=2, meta_dtype=jnp.float32):
    """Random pool + metadata in `meta_dtype` (NaN rows for blocks nobody lists) + shuffled, -1 padded candidate
    lists."""
    rng = np.random.default_rng(seed)
    nb = 2 * k + 3
    lens = [int(n) for n in rng.integers(1, bs + 1, size=nb)]
    pool, keys = _pool(rng, nb, bs, hkv, hd, lens)
    listed = rng.permutation(np.arange(1, nb))[: batch * k - 3]  # block 0 and a few others never listed
    cand = np.full((batch, k), -1, np.int32)
    flat = cand.reshape(-1)
    slots = rng.permutation(batch * k)[: len(listed)]  # -1 padding lands at random places
    flat[slots] = listed
    kmin, kmax = block_key_bounds(jnp.asarray(pool), jnp.asarray(listed, jnp.int32),
                                  jnp.asarray([lens[i] for i in listed], jnp.int32))
    nan = jnp.full((nb, hkv, hd), jnp.nan, meta_dtype)
    meta_min, meta_max = update_bounds(nan, nan, jnp.asarray(listed, jnp.int32), kmin, kmax)
    q = (rng.standard_normal((batch, hkv * group, hd)) * 0.5).astype(np.float32)
    return q, meta_min, meta_max, cand, keys


@pytest.mark.parametrize(
    "bs,group,hd,k,tile_k,meta_dtype",
    [(8, 1, 64, 5, None, jnp.float32), (16, 2, 128, 20, 8, jnp.float32), (32, 4, 64, 12, None, jnp.float32),
     (16, 8, 128, 9, 4, jnp.float32), (8, 3, 64, 17, 16, jnp.float32),
     (16, 4, 128, 20, 8, jnp.float8_e4m3fn), (8, 3, 64, 17, None, jnp.float8_e4m3fn)],
)
def test_block_scores_matches_reference_and_bounds_true_scores(bs, group, hd, k, tile_k, meta_dtype):
    """float8 metadata (the engine's default storage, rounded outward) still bounds every true q.k."""
    q, meta_min, meta_max, cand, keys = _scoring_case(bs * 97 + group * 13 + hd + k, bs, group, hd, k,
                                                      meta_dtype=meta_dtype)
    hkv = meta_min.shape[1]
    out = block_scores(jnp.asarray(q), meta_min, meta_max, jnp.asarray(cand), tile_k=tile_k)
    ref = block_scores_reference(jnp.asarray(q), meta_min, meta_max, jnp.asarray(cand))
    assert out.shape == (2, hkv, k) and out.dtype == jnp.float32
    out, ref = np.asarray(out), np.asarray(ref)
    pad = cand < 0
    assert np.isneginf(out[:, :, :][np.broadcast_to(pad[:, None], out.shape)]).all()
    assert np.isfinite(out[np.broadcast_to(~pad[:, None], out.shape)]).all()  # no NaN row leaked
    atol = 1e-4 * np.abs(ref[np.isfinite(ref)]).max()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=atol)

    per_head = np.asarray(block_scores(jnp.asarray(q), meta_min, meta_max, jnp.asarray(cand), per_head=True,
                                       tile_k=tile_k))
    ref_ph = np.asarray(block_scores_reference(jnp.asarray(q), meta_min, meta_max, jnp.asarray(cand),
                                               per_head=True))
    assert per_head.shape == (2, hkv * group, k)
    np.testing.assert_allclose(per_head, ref_ph, rtol=1e-5, atol=atol)
    group_sum = per_head.reshape(2, hkv, group, k).sum(2)
    np.testing.assert_allclose(group_sum, out, rtol=1e-5, atol=atol)

    # Quest property: each head's bound >= its best true q.k in the block; the group score >= their sum.
    for b in range(2):
        for c in range(k):
            blk = cand[b, c]
            if blk < 0:
                continue
            qk = np.einsum("hgd,thd->hgt", q[b].reshape(hkv, group, hd).astype(np.float64), keys[blk])
            best = qk.max(-1)  # [Hkv, G]
            slack = 1e-4 * (1.0 + np.abs(best))
            assert (per_head[b].reshape(hkv, group, k)[:, :, c] >= best - slack).all()
            assert (out[b, :, c] >= best.sum(-1) - slack.sum(-1)).all()


@pytest.mark.parametrize("group,beta,per_head", [(2, 0.5, False), (3, 0.0, True), (1, 0.25, False)])
def test_block_scores_beta_matches_reference_and_interpolates(group, beta, per_head):
    """score_beta = q.mid + beta |q|.half: the kernel's folded form equals the literal reference; beta = 0 is the
    midpoint dot product; the score grows with beta from it to Quest's bound (beta = 1, bit-identical to the
    default call), and each beta < 1 score is at most the bound."""
    q, meta_min, meta_max, cand, _ = _scoring_case(100 + group, 16, group, 64, 11)
    args = (jnp.asarray(q), meta_min, meta_max, jnp.asarray(cand))
    out = np.asarray(block_scores(*args, per_head=per_head, beta=beta, tile_k=4))
    ref = np.asarray(block_scores_reference(*args, per_head=per_head, beta=beta))
    fin = np.isfinite(ref)
    assert (np.isfinite(out) == fin).all() and fin.any()
    atol = 1e-4 * np.abs(ref[fin]).max()
    np.testing.assert_allclose(out[fin], ref[fin], rtol=1e-5, atol=atol)
    quest = np.asarray(block_scores(*args, per_head=per_head, tile_k=4))
    np.testing.assert_array_equal(np.asarray(block_scores(*args, per_head=per_head, beta=1.0, tile_k=4)), quest)
    assert (out[fin] <= quest[fin] + atol).all()
    if beta == 0.0:
        lo, hi = np.asarray(meta_min, np.float64), np.asarray(meta_max, np.float64)
        b, hq, hd = q.shape
        hkv = lo.shape[1]
        for i in range(b):
            for c in range(cand.shape[1]):
                if cand[i, c] < 0:
                    continue
                mid = (lo[cand[i, c]] + hi[cand[i, c]]) / 2  # [Hkv, hd]
                want = np.einsum("hgd,hd->hg", q[i].reshape(hkv, group, hd).astype(np.float64), mid).reshape(-1)
                np.testing.assert_allclose(out[i, :, c], want, rtol=1e-4, atol=atol)
    with pytest.raises(ValueError, match="beta=1.5 must be in"):
        block_scores(*args, beta=1.5)
    with pytest.raises(ValueError, match="beta=-0.1 must be in"):
        block_scores_reference(*args, beta=-0.1)


def test_block_scores_id_offset_shifts_listed_ids_only():
    """`id_offset` (a layer's first row in a metadata array shared by layers) is added to every id >= 0 in the kernel:
    the scores equal those of the shifted ids bit for bit; padding (-1) stays padding."""
    q, meta_min, meta_max, cand, _ = _scoring_case(7, 16, 2, 64, 11)
    off = 3
    base = np.where(cand >= 0, np.minimum(cand, meta_min.shape[0] - 1 - off), -1).astype(np.int32)
    shifted = np.where(base >= 0, base + off, -1).astype(np.int32)
    args = (jnp.asarray(q), meta_min, meta_max)
    for fn in (block_scores, block_scores_reference):
        want = np.asarray(fn(*args, jnp.asarray(shifted), per_head=True))
        got = np.asarray(fn(*args, jnp.asarray(base), jnp.int32(off), per_head=True))
        np.testing.assert_array_equal(got, want)
        assert np.isneginf(got[0][:, base[0] < 0]).all() and (base[0] < 0).any()


def test_block_scores_bf16_query_and_tight_bound():
    """bf16 queries are read as f32; a one-token block's bound is exactly its q.k (min = max = k)."""
    rng = np.random.default_rng(3)
    hkv, group, hd, nb = 2, 2, 64, 5
    k1 = rng.standard_normal((nb, hkv, hd)).astype(np.float32)
    meta = jnp.asarray(k1)
    q = jnp.asarray(rng.standard_normal((1, hkv * group, hd)), jnp.bfloat16)
    cand = jnp.asarray([[3, 0, -1, 4]], jnp.int32)
    out = np.asarray(block_scores(q, meta, meta, cand))
    qf = np.asarray(q.astype(jnp.float32)).reshape(hkv, group, hd)
    want = np.einsum("hgd,chd->hc", qf, k1[[3, 0, 0, 4]])
    want[:, 2] = -np.inf
    np.testing.assert_allclose(out[0], want, rtol=1e-5, atol=1e-4)


def test_bf16_key_bounds_are_exact_and_score_like_float32():
    """The engine stores key bounds in the KV dtype: the min / max of bf16 keys are bf16 values, so bf16 rows hold
    exactly the float32 bounds, and scoring (kernel and reference) gives bit-identical results from either."""
    rng = np.random.default_rng(11)
    nb, bs, hkv, hd, group = 12, 16, 2, 64, 3
    pool, _ = _pool(rng, nb, bs, hkv, hd, [bs] * nb)
    pool = jnp.asarray(pool, jnp.bfloat16)
    ids = jnp.asarray(rng.permutation(nb), jnp.int32)
    kmin, kmax = block_key_bounds(pool, ids, jnp.full((nb,), bs, jnp.int32))
    bmin, bmax = kmin.astype(jnp.bfloat16), kmax.astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(bmin.astype(jnp.float32)), np.asarray(kmin))
    np.testing.assert_array_equal(np.asarray(bmax.astype(jnp.float32)), np.asarray(kmax))
    q = jnp.asarray(rng.standard_normal((2, hkv * group, hd)), jnp.bfloat16)
    cand = jnp.asarray(rng.integers(-1, nb, (2, 20)), jnp.int32)
    for fn in (block_scores, block_scores_reference):
        np.testing.assert_array_equal(np.asarray(fn(q, bmin, bmax, cand)), np.asarray(fn(q, kmin, kmax, cand)))


def test_block_scores_rejects_bad_inputs():
    q = jnp.zeros((1, 6, 64))
    meta = jnp.zeros((4, 4, 64))
    ids = jnp.zeros((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="divisible by num_kv_heads"):
        block_scores(q, meta, meta, ids)
    with pytest.raises(ValueError, match="head_dim of q"):
        block_scores(jnp.zeros((1, 4, 32)), meta, meta, ids)
    with pytest.raises(ValueError, match="integer array"):
        block_scores(jnp.zeros((1, 4, 64)), meta, meta, ids.astype(jnp.float32))
    with pytest.raises(ValueError, match="power of two"):
        block_scores(jnp.zeros((1, 4, 64)), meta, meta, ids, tile_k=24)
    with pytest.raises(ValueError, match="\\[B, K\\]"):
        block_scores(jnp.zeros((2, 4, 64)), meta, meta, ids)


@pytest.mark.parametrize("m,per_head,meta_dtype,kv_dtype,tile_k", [
    (1, True, jnp.float32, jnp.float32, 4), (2, False, jnp.float32, jnp.float32, 4),
    (4, True, jnp.float32, jnp.bfloat16, None), (2, True, jnp.bfloat16, jnp.bfloat16, 8),
    (2, False, jnp.float8_e4m3fn, jnp.bfloat16, 4), (1, True, jnp.float32, jnp.float8_e4m3fn, 4),
    (2, True, jnp.float8_e4m3fn, jnp.float8_e4m3fn, 8)])
def test_append_and_score_keeps_the_bounds_current_token_by_token(m, per_head, meta_dtype, kv_dtype, tile_k):
    """Two sequences decode 3.5 blocks token by token into layer 1 of a 2-layer cache (float8: quantised), the second
    starting later (a padding row -1 until then). Each key is read back where it was written (the cache's unwritten
    slots NaN, never read) and appended to its block's slice in metadata rows that start NaN (a previous owner's
    garbage) inside the second layer's range (`id_offset`), every block listed, shuffled among padding, in the
    kernel's several tiles. After every token: kernel and reference agree (bounds bit for bit, or within a bound's
    rounding step for a float8 cache, whose rotation sums in another order; scores to rounding); the bounds are
    those of the keys written so far (`block_key_bounds` of the cache, rounded outward), and the scores equal
    `kept_scores_reference`'s from the keys themselves (the sink and window blocks' scores before), the newest
    block's empty slices without mass."""
    bs, hkv, group, hd, beta, nb_cache = 8, 2, 2, 32, 0.5, 10
    f8 = kv_quant.is_quantized(kv_dtype)
    rng = np.random.default_rng(7 * m + per_head + 3 * f8)
    steps, nb, per_layer = 3 * bs + 4, 4, 16  # 4 logical blocks per sequence, 16 metadata blocks per layer
    keys = (rng.standard_normal((2, steps, hkv, hd)) * rng.uniform(0.3, 2, (hkv, hd))).astype(np.float32)
    q_all = (rng.standard_normal((steps, 2, hkv * group, hd)) * 0.5).astype(np.float32)
    blocks = rng.permutation(per_layer)[: 2 * nb].reshape(2, nb)  # logical block j of sequence b -> metadata block
    gpu = rng.permutation(np.arange(1, nb_cache))[: 2 * nb].reshape(2, nb)  # the cache block of each logical one
    cache = jnp.full((2, nb_cache, 2, kv_quant.block_rows(bs, hd, kv_dtype), hkv, hd), jnp.nan,
                     kv_quant.storage_dtype(kv_dtype))
    if f8:
        cache = jnp.zeros_like(cache)
    nan = jnp.full((2 * per_layer * m, hkv, hd), jnp.nan, meta_dtype)
    got, want = (nan, nan), (nan, nan)
    off = jnp.int32(per_layer)  # layer 1's rows
    scale = default_scale(hd, group, per_head)
    kw = dict(per_head=per_head, beta=beta, sub_blocks=m, scale=scale)
    start = (0, 5)  # sequence 1's first token is written at step 5
    # one step of the bounds' dtype (float8: relative 2^-3, or its smallest subnormal 2^-9 near zero)
    step = dict(rtol=0.07, atol=2.0 ** -9) if meta_dtype == jnp.float8_e4m3fn else dict(rtol=1e-5, atol=1e-5)
    for t in range(steps):
        pos = np.array([t - s for s in start])
        live = pos >= 0
        p0 = np.maximum(pos, 0)
        rows = np.where(live, blocks[np.arange(2), p0 // bs], -1)
        blk = np.where(live, gpu[np.arange(2), p0 // bs], 0)
        k = keys[np.arange(2), p0]
        cache = kv_quant.write_tokens(cache, jnp.ones(2, jnp.int32), jnp.asarray(blk), jnp.asarray(p0 % bs),
                                      jnp.asarray(k), jnp.asarray(k))
        flat = cache.reshape(-1, *cache.shape[2:])
        app = KeyAppend(jnp.asarray(rows, jnp.int32), jnp.asarray(blk, jnp.int32), jnp.asarray(p0 % bs, jnp.int32))
        cand = np.full((2, 12), -1, np.int32)
        for b in range(2):
            n = pos[b] // bs + 1 if live[b] else 0
            cand[b, rng.permutation(12)[:n]] = blocks[b, :n]
        args = (jnp.asarray(cand), off, app, flat, jnp.int32(nb_cache))
        s_got, *got = append_and_score(jnp.asarray(q_all[t]), *got, *args, tile_k=tile_k, **kw)
        s_want, *want = append_and_score_reference(jnp.asarray(q_all[t]), *want, *args, **kw)
        for a, b in zip(got, want, strict=True):
            a, b = np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32))
            if f8:  # (one rounding step of the bounds' dtype at most)
                np.testing.assert_allclose(a, b, **step)
            else:
                np.testing.assert_array_equal(a, b)
        s_got, s_want = np.asarray(s_got), np.asarray(s_want)
        fin = np.isfinite(s_want)
        assert (np.isfinite(s_got) == fin).all() and (fin == (cand >= 0)[:, None]).all()
        np.testing.assert_allclose(s_got[fin], s_want[fin], rtol=1e-3 if f8 else 1e-5, atol=1e-3 if f8 else 1e-4)
        for b in np.flatnonzero(live):  # against the keys in the cache themselves
            n = pos[b] // bs + 1
            lens = np.clip(pos[b] + 1 - np.arange(n) * bs, 0, bs).astype(np.int32)
            units = jnp.asarray(nb_cache + gpu[b, :n], jnp.int32)
            lo, hi = block_key_bounds(flat, units, jnp.asarray(lens), sub_blocks=m)
            lo, hi = round_bounds_outward(lo, hi, meta_dtype)
            at = ((per_layer + blocks[b, :n])[:, None] * m + np.arange(m)).reshape(-1)
            filled = (lens[:, None] > np.arange(m) * (bs // m)).reshape(-1)  # slices holding a token
            for mine, theirs in ((want[0], lo), (want[1], hi)):
                mine, theirs = (np.asarray(x.astype(jnp.float32)) for x in (mine[at], theirs))
                if f8:  # (a float8 cache's keys, dequantised a token or a block at a time: float32 rounding)
                    np.testing.assert_allclose(mine[filled], theirs[filled], **step)
                else:
                    np.testing.assert_array_equal(mine[filled], theirs[filled])
            if meta_dtype == jnp.float32:
                ref = kept_scores_reference(jnp.asarray(q_all[t, b:b + 1]), flat, units[None], jnp.asarray(lens)[None],
                                            **kw)
                mine = s_got[b][:, [list(cand[b]).index(x) for x in blocks[b, :n]]]
                np.testing.assert_allclose(mine, np.asarray(ref[0]), rtol=1e-3 if f8 else 1e-5,
                                           atol=1e-3 if f8 else 1e-4)


def test_append_and_score_rejects_a_pool_that_does_not_fit():
    meta = jnp.zeros((8, 2, 16), jnp.float32)
    app = KeyAppend(jnp.array([0]), jnp.array([0]), jnp.array([1]))
    with pytest.raises(ValueError, match="flat"):
        append_and_score(jnp.zeros((1, 4, 16)), meta, meta, jnp.array([[0]]), None, app, jnp.zeros((3, 2, 8, 4, 16)))
    with pytest.raises(ValueError, match="sub_blocks=3 divides"):
        append_and_score_reference(jnp.zeros((1, 4, 16)), meta[:6], meta[:6], jnp.array([[0]]), None, app,
                                   jnp.zeros((3, 2, 8, 2, 16)), sub_blocks=3)
