"""Gather / scatter kernels (Pallas, interpret mode on CPU) against their jnp references and numpy, bit for bit.

Every case draws fresh random data from its own seed. Pool blocks (or (block, head) units) that no entry
lists are poisoned with NaN, so any stray read shows up in the output; scatters must leave every slot
they do not list bit-identical, NaN payloads included.
"""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from bench.gather_scatter import (
    gather_block_heads,
    gather_block_heads_reference,
    gather_blocks,
    gather_blocks_reference,
    scatter_block_heads,
    scatter_block_heads_reference,
    scatter_blocks,
    scatter_blocks_reference,
)

# (block_size, head_dim, dtype, num_kv_heads, max_tile): covers every pair of bs x hd x dtype, a
# non-power-of-two Hkv, and small tiles that split a block (and a head's rows) over several programs.
CASES = [
    (8, 64, "float32", 2, 8192),
    (16, 128, "bfloat16", 2, 512),
    (32, 64, "bfloat16", 3, 8192),
    (16, 64, "float32", 3, 256),
    (32, 128, "float32", 1, 1024),
    (8, 128, "bfloat16", 2, 8192),
]
IDS = [f"bs{c[0]}-hd{c[1]}-{c[2]}-hkv{c[3]}-tile{c[4]}" for c in CASES]


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _bits(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_bits_equal(got, want, what: str) -> None:
    g, w = _bits(got), _bits(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    bad = np.argwhere(g != w)
    assert bad.size == 0, f"{what}: {len(bad)} elements differ, first at {tuple(bad[0])}"


def _random(rng, shape, dtype: str) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(jnp.dtype(dtype))


def _gather_ids(rng, nb: int, n: int) -> np.ndarray:
    """n ids drawn (with duplicates) from a random half of the pool, shuffled, with ~1/5 set to -1."""
    listed = rng.permutation(nb)[: max(1, nb // 2)]
    ids = rng.choice(listed, size=n, replace=True).astype(np.int32)
    ids[rng.random(n) < 0.2] = -1
    ids[0] = listed[0]  # at least one real entry
    return ids


def _scatter_slots(rng, ns: int, n: int) -> np.ndarray:
    """n distinct slots (shuffled), with ~1/4 of the entries padding (-1)."""
    slots = rng.permutation(ns)[:n].astype(np.int32)
    slots[rng.random(n) < 0.25] = -1
    return slots


@pytest.mark.parametrize("bs,hd,dtype,hkv,tile", CASES, ids=IDS)
def test_gather_blocks(bs, hd, dtype, hkv, tile):
    rng = _rng("gather_blocks", bs, hd, dtype, hkv, tile)
    nb, n = 12, 9
    pool = _random(rng, (nb, 2, bs, hkv, hd), dtype)
    ids = _gather_ids(rng, nb, n)
    unlisted = np.setdiff1d(np.arange(nb), ids)
    pool[unlisted] = np.nan
    want = np.where((ids >= 0)[:, None, None, None, None], pool[np.maximum(ids, 0)], 0).astype(pool.dtype)

    got = gather_blocks(jnp.asarray(pool), jnp.asarray(ids), max_tile=tile)
    ref = gather_blocks_reference(jnp.asarray(pool), jnp.asarray(ids))
    assert got.shape == (n, 2, bs, hkv, hd) and got.dtype == pool.dtype
    _assert_bits_equal(got, want, "gather_blocks vs numpy")
    _assert_bits_equal(ref, want, "gather_blocks_reference vs numpy")
    assert not np.isnan(np.asarray(got, np.float32)).any(), "a NaN-poisoned (unlisted) block leaked into the output"


@pytest.mark.parametrize("bs,hd,dtype,hkv,tile", CASES, ids=IDS)
def test_gather_block_heads(bs, hd, dtype, hkv, tile):
    rng = _rng("gather_block_heads", bs, hd, dtype, hkv, tile)
    nb, n = 10, 11
    pool = _random(rng, (nb, 2, bs, hkv, hd), dtype)
    ids = _gather_ids(rng, nb, n)
    heads = rng.integers(0, hkv, n).astype(np.int32)
    listed = {(int(b), int(h)) for b, h in zip(ids, heads, strict=True) if b >= 0}
    for b in range(nb):
        for h in range(hkv):
            if (b, h) not in listed:
                pool[b, :, :, h] = np.nan
    want = np.where((ids >= 0)[:, None, None, None], pool[np.maximum(ids, 0), :, :, heads], 0).astype(pool.dtype)

    got = gather_block_heads(jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(heads), max_tile=tile)
    ref = gather_block_heads_reference(jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(heads))
    assert got.shape == (n, 2, bs, hd) and got.dtype == pool.dtype
    _assert_bits_equal(got, want, "gather_block_heads vs numpy")
    _assert_bits_equal(ref, want, "gather_block_heads_reference vs numpy")
    assert not np.isnan(np.asarray(got, np.float32)).any(), "a NaN-poisoned (block, head) unit leaked"


@pytest.mark.parametrize("bs,hd,dtype,hkv,tile", CASES, ids=IDS)
def test_scatter_blocks(bs, hd, dtype, hkv, tile):
    rng = _rng("scatter_blocks", bs, hd, dtype, hkv, tile)
    ns, n = 10, 7
    cache = _random(rng, (ns, 2, bs, hkv, hd), dtype)
    cache[rng.integers(0, ns)] = np.nan  # NaN payloads in the cache must survive untouched, bit for bit
    slots = _scatter_slots(rng, ns, n)
    staging = _random(rng, (n, 2, bs, hkv, hd), dtype)
    want = cache.copy()
    for i, s in enumerate(slots):
        if s >= 0:
            want[s] = staging[i]

    ref = scatter_blocks_reference(jnp.asarray(cache), jnp.asarray(slots), jnp.asarray(staging))
    got = scatter_blocks(jnp.asarray(cache), jnp.asarray(slots), jnp.asarray(staging), max_tile=tile)
    assert got.shape == cache.shape and got.dtype == cache.dtype
    _assert_bits_equal(got, want, "scatter_blocks vs numpy")
    _assert_bits_equal(ref, want, "scatter_blocks_reference vs numpy")
    untouched = np.setdiff1d(np.arange(ns), slots)
    _assert_bits_equal(np.asarray(got)[untouched], cache[untouched], "untouched slots")


@pytest.mark.parametrize("bs,hd,dtype,hkv,tile", CASES, ids=IDS)
def test_scatter_block_heads(bs, hd, dtype, hkv, tile):
    rng = _rng("scatter_block_heads", bs, hd, dtype, hkv, tile)
    ns, n = 8, 7
    cache = _random(rng, (ns, 2, bs, hkv, hd), dtype)
    cache[rng.integers(0, ns), :, :, rng.integers(0, hkv)] = np.nan
    pairs = rng.permutation(ns * hkv)[:n]  # distinct (slot, head) pairs
    slots, heads = (pairs // hkv).astype(np.int32), (pairs % hkv).astype(np.int32)
    slots[rng.random(n) < 0.25] = -1
    staging = _random(rng, (n, 2, bs, hd), dtype)
    want = cache.copy()
    for i, (s, h) in enumerate(zip(slots, heads, strict=True)):
        if s >= 0:
            want[s, :, :, h] = staging[i]

    args = (jnp.asarray(slots), jnp.asarray(heads), jnp.asarray(staging))
    ref = scatter_block_heads_reference(jnp.asarray(cache), *args)
    got = scatter_block_heads(jnp.asarray(cache), *args, max_tile=tile)
    _assert_bits_equal(got, want, "scatter_block_heads vs numpy")
    _assert_bits_equal(ref, want, "scatter_block_heads_reference vs numpy")


@pytest.mark.parametrize("bs,hd,dtype,hkv,tile", CASES[:3], ids=IDS[:3])
def test_round_trip(bs, hd, dtype, hkv, tile):
    """pool --gather--> staging --scatter--> cache slots --gather--> the same staging; cache[slot] == pool[id]."""
    rng = _rng("round_trip", bs, hd, dtype, hkv, tile)
    nb, ns, n = 12, 8, 6
    pool = _random(rng, (nb, 2, bs, hkv, hd), dtype)
    ids = rng.permutation(nb)[:n].astype(np.int32)
    slots = rng.permutation(ns)[:n].astype(np.int32)
    cache = np.zeros((ns, 2, bs, hkv, hd), pool.dtype)

    staging = gather_blocks(jnp.asarray(pool), jnp.asarray(ids), max_tile=tile)
    out = scatter_blocks(jnp.asarray(cache), jnp.asarray(slots), staging, max_tile=tile)
    _assert_bits_equal(np.asarray(out)[slots], pool[ids], "cache[slots] after round trip")
    _assert_bits_equal(gather_blocks(out, jnp.asarray(slots), max_tile=tile), staging, "re-gathered staging")

    heads = rng.integers(0, hkv, n).astype(np.int32)
    hs = gather_block_heads(jnp.asarray(pool), jnp.asarray(ids), jnp.asarray(heads), max_tile=tile)
    out = scatter_block_heads(jnp.asarray(cache), jnp.asarray(slots), jnp.asarray(heads), hs, max_tile=tile)
    _assert_bits_equal(np.asarray(out)[slots, :, :, heads], pool[ids, :, :, heads], "headwise round trip")


def test_padding_out_of_range_and_empty():
    rng = _rng("edges")
    pool = _random(rng, (5, 2, 8, 2, 64), "bfloat16")
    ids = jnp.asarray([-1, 5, 99, -7], jnp.int32)  # all outside [0, NB): all-zero rows, pool never read
    got = gather_blocks(jnp.asarray(pool), ids)
    assert not np.any(_bits(got)), "out-of-range gather ids must give zero rows"
    _assert_bits_equal(got, gather_blocks_reference(jnp.asarray(pool), ids), "reference, out-of-range ids")
    heads = jnp.zeros(4, jnp.int32)
    assert not np.any(_bits(gather_block_heads(jnp.asarray(pool), ids, heads)))

    cache = _random(rng, (4, 2, 8, 2, 64), "bfloat16")
    staging = jnp.asarray(_random(rng, (4, 2, 8, 2, 64), "bfloat16"))
    out = scatter_blocks(jnp.asarray(cache), jnp.asarray([-1, 4, 50, -2], jnp.int32), staging)
    _assert_bits_equal(out, cache, "scatter with only skipped slots")

    empty = jnp.zeros((0,), jnp.int32)
    assert gather_blocks(jnp.asarray(pool), empty).shape == (0, 2, 8, 2, 64)
    assert gather_block_heads(jnp.asarray(pool), empty, empty).shape == (0, 2, 8, 64)
    _assert_bits_equal(scatter_blocks(jnp.asarray(cache), empty, jnp.zeros((0, 2, 8, 2, 64), jnp.bfloat16)),
                       cache, "empty scatter")


def test_bad_input_errors():
    pool = jnp.zeros((4, 2, 8, 2, 64), jnp.float32)
    ids = jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match="pool must be"):
        gather_blocks(pool[:, 0], ids)
    with pytest.raises(ValueError, match="ids must be a 1-D integer"):
        gather_blocks(pool, ids.astype(jnp.float32))
    with pytest.raises(ValueError, match="heads has 2 entries"):
        gather_block_heads(pool, ids, ids[:2])
    with pytest.raises(ValueError, match="staging shape"):
        scatter_blocks(pool, ids, jnp.zeros((2, 2, 8, 2, 64), jnp.float32))
    with pytest.raises(ValueError, match="staging dtype"):
        scatter_block_heads(pool, ids, ids, jnp.zeros((3, 2, 8, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="max_tile"):
        gather_blocks(pool, ids, max_tile=100)
