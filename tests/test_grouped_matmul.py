"""Grouped matmul (Pallas, interpret mode on CPU) against its jnp twin and a float64 numpy oracle.

Every case draws fresh random data from its own seed. The weights of groups no tile names are poisoned with
NaN, and so are the rows of the tiles marked unused (-1), so any stray read shows up; unused tiles must come
out exactly zero.
"""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from pulseinfer_jax.pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference

TOL = {"float32": 1e-5, "bfloat16": 2e-2}

# (tile_m, K, N, groups, dtype, expert_axis, block_k, block_n): K/N not powers of two (blocks shrink to a
# divisor), several K steps and column blocks per tile, both weight layouts.
CASES = [
    (16, 64, 96, 5, "float32", 0, 32, 32),
    (16, 48, 64, 3, "bfloat16", 1, 16, 64),
    (32, 128, 32, 4, "float32", 1, 64, 128),
    (16, 96, 48, 6, "bfloat16", 0, 32, 16),
]
IDS = [f"t{c[0]}-k{c[1]}-n{c[2]}-g{c[3]}-{c[4]}-ax{c[5]}" for c in CASES]


def _case(case, seed_name: str):
    tile_m, k, n, groups, dtype, axis, _, _ = case
    r = np.random.default_rng(zlib.crc32(f"{seed_name}{case}".encode()))
    used = r.permutation(groups)[: groups - 1]  # one group is never named: its weights are NaN
    tile_group = np.concatenate([r.choice(used, 6), [-1, -1]])  # repeats, out of order, two unused tiles
    r.shuffle(tile_group)
    mats = r.normal(0, 1, (groups, k, n)).astype(np.float32)
    mats[np.setdiff1d(np.arange(groups), used)] = np.nan
    x = r.normal(0, 1, (tile_group.size * tile_m, k)).astype(np.float32)
    for t in np.flatnonzero(tile_group < 0):
        x[t * tile_m:(t + 1) * tile_m] = np.nan
    w = mats if axis == 0 else mats.transpose(1, 0, 2)
    dt = jnp.dtype(dtype)
    xj, wj = jnp.asarray(x, dt), jnp.asarray(w, dt)
    # the oracle in float64 from the values the kernels see (rounded to dtype)
    x64 = np.asarray(xj, np.float64)
    m64 = np.asarray(wj, np.float64) if axis == 0 else np.asarray(wj, np.float64).transpose(1, 0, 2)
    want = np.zeros((x.shape[0], n))
    for t, g in enumerate(tile_group):
        if g >= 0:
            want[t * tile_m:(t + 1) * tile_m] = x64[t * tile_m:(t + 1) * tile_m] @ m64[g]
    return xj, wj, jnp.asarray(tile_group, jnp.int32), want


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_kernel_and_reference_match_the_oracle(case):
    tile_m, _, _, _, dtype, axis, bk, bn = case
    x, w, tg, want = _case(case, "match")
    got_k = np.asarray(grouped_matmul(x, w, tg, tile_m=tile_m, expert_axis=axis, block_k=bk, block_n=bn),
                       np.float64)  # interpret mode on CPU, compiled on a GPU (bench/gpu_suite.sh)
    got_r = np.asarray(grouped_matmul_reference(x, w, tg, tile_m=tile_m, expert_axis=axis), np.float64)
    scale = max(1.0, np.abs(want).max())
    for name, got in (("pallas", got_k), ("reference", got_r)):
        assert got.dtype == np.float64 and got.shape == want.shape
        assert np.isfinite(got).all(), f"{name}: read an unused group's weights or an unused tile's rows"
        assert np.abs(got - want).max() / scale <= TOL[dtype], name
        unused = np.repeat(np.asarray(tg) < 0, tile_m)
        assert (got[unused] == 0).all(), f"{name}: unused tiles must be exactly zero"
    assert np.abs(got_k - got_r).max() / scale <= TOL[dtype]


def test_out_of_range_groups_are_unused_tiles():
    x = jnp.ones((48, 16))
    w = jnp.ones((2, 16, 16))
    tg = jnp.asarray([1, 2, -5], jnp.int32)  # 2 and -5 are outside [0, 2)
    for got in (grouped_matmul(x, w, tg, tile_m=16), grouped_matmul_reference(x, w, tg, tile_m=16)):
        got = np.asarray(got)
        assert (got[:16] == 16).all() and (got[16:] == 0).all()


def test_bad_inputs_are_clear_errors():
    x, w, tg = jnp.ones((32, 16)), jnp.ones((2, 16, 8)), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="power of two"):
        grouped_matmul_reference(x, w, tg, tile_m=12)
    with pytest.raises(ValueError, match="not a multiple of tile_m"):
        grouped_matmul_reference(x[:24], w, tg, tile_m=16)
    with pytest.raises(ValueError, match="K=16 columns"):
        grouped_matmul_reference(x, jnp.ones((2, 8, 8)), tg, tile_m=16)
    with pytest.raises(ValueError, match="one per tile"):
        grouped_matmul_reference(x, w, jnp.zeros((3,), jnp.int32), tile_m=16)
    with pytest.raises(ValueError, match="cast one"):
        grouped_matmul(x, w.astype(jnp.bfloat16), tg, tile_m=16, interpret=True)
    with pytest.raises(ValueError, match="expert_axis"):
        grouped_matmul(x, w, tg, tile_m=16, expert_axis=2, interpret=True)
    with pytest.raises(ValueError, match=">= 16"):  # Triton's dots: checked before lowering for a GPU
        grouped_matmul(jnp.ones((16, 8)), jnp.ones((2, 8, 8)), jnp.zeros((1,), jnp.int32), tile_m=16,
                       interpret=False)
