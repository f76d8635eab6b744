"""Gather / scatter of KV blocks between a layer's block pool and one contiguous staging buffer.

Layout (one layer, see kv/cache.py): `pool: [NB, 2, bs, Hkv, hd]` (block, K|V, token, kv head, feature).

- SoloHead unit: a whole block `pool[b]`, one contiguous run of `2 * bs * Hkv * hd` elements.
  `gather_blocks` packs n such blocks into `staging: [n, 2, bs, Hkv, hd]` (one buffer, one transfer);
  `scatter_blocks` writes `staging[i]` back into `cache[slots[i]]` in place.
- Headwise baseline unit: `pool[b, :, :, h]` -> `[2, bs, hd]` (2 * bs strided rows of hd elements).
  `gather_block_heads` / `scatter_block_heads` move those units.

Index contract (the same for kernel and reference, checked bit for bit by the tests):
- gathers: an entry whose id is outside `[0, NB)` (padding is -1) produces an all-zero staging row; the
  pool is not read for it. Duplicate ids are fine.
- scatters: an entry whose slot is outside `[0, NS)` (padding is -1) is skipped. Slots of the entries
  that are written must be distinct (with duplicates, which one lands is unspecified).
- headwise: heads must lie in `[0, Hkv)` for the entries that are read or written (out-of-range heads
  are clamped into range, for memory safety only).
Copies are bit-exact in any dtype (values are moved, never computed on; NaN payloads survive).

Kernel design (Triton-compatible `pl.pallas_call`, no scalar prefetch): ids / slots / heads are ordinary
int32 inputs whose BlockSpec is the whole vector; each program loads its entry's id as a scalar and
addresses the pool with a dynamic scalar index. The pool (gathers) and the cache (scatters) are passed
as whole-array refs; the staging side is tiled by BlockSpecs.
- whole blocks: the pool is viewed as `[NB, F]`, F = 2*bs*Hkv*hd; grid `(n, F // T)` with T the largest
  power of two dividing F, capped at `max_tile`; program (i, j) moves `T` contiguous elements.
- per (block, head): the pool is viewed as `[NB, 2*bs, Hkv, hd]`; grid `(n, 2*bs // R, hd // C)` with R
  and C the largest powers of two dividing 2*bs and hd (R capped so R*C <= max_tile); program (i, r, c)
  moves an `[R, C]` tile of strided rows.
Padding is handled with masked loads (`other=0`) and masked stores, so there is no control flow.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Int, Shaped
from pulseinfer_jax.pallas_kernels.common import on_platform, pow2_divisor, triton_params

DEFAULT_MAX_TILE = 8192  # elements per program (16 KiB in bf16)


def _check_pool(name: str, pool: Array) -> None:
    if pool.ndim != 5 or pool.shape[1] != 2:
        raise ValueError(f"{name} must be [blocks, 2, block_size, num_kv_heads, head_dim], got shape {pool.shape}")


def _check_index(name: str, idx: Array, n: int | None = None) -> None:
    if idx.ndim != 1 or not jnp.issubdtype(idx.dtype, jnp.integer):
        raise ValueError(f"{name} must be a 1-D integer vector, got shape {idx.shape} dtype {idx.dtype}")
    if n is not None and idx.shape[0] != n:
        raise ValueError(f"{name} has {idx.shape[0]} entries but {n} were expected")


def _check_staging(staging: Array, shape: tuple[int, ...], cache: Array) -> None:
    if staging.shape != shape:
        raise ValueError(f"staging shape {staging.shape} must be {shape} ({shape[0]} slots, cache {cache.shape})")
    if staging.dtype != cache.dtype:
        raise ValueError(f"staging dtype {staging.dtype} != cache dtype {cache.dtype}")


def _check_tile(max_tile: int) -> None:
    if max_tile < 1 or max_tile & (max_tile - 1):
        raise ValueError(f"max_tile={max_tile} must be a positive power of two")


# ------------------------------------------------------------------------------------------------
# Kernel bodies
# ------------------------------------------------------------------------------------------------


def _gather_blocks_kernel(ids_ref, pool_ref, out_ref, *, tile: int):
    # ids_ref: [n] int32 (whole vector); pool_ref: [NB, F] (whole pool); out_ref: [T] (row i, tile j).
    i, j = pl.program_id(0), pl.program_id(1)
    nb = pool_ref.shape[0]
    b = ids_ref[i]
    valid = (b >= 0) & (b < nb)
    src = pool_ref.at[jnp.clip(b, 0, nb - 1), pl.ds(j * tile, tile)]
    out_ref[...] = plt.load(src, mask=jnp.full((tile,), valid), other=0)


def _scatter_blocks_kernel(slots_ref, staging_ref, cache_in_ref, cache_ref, *, tile: int):
    # slots_ref: [n] int32; staging_ref: [T] (row i, tile j); cache_ref: [NS, F] (whole cache, aliased
    # to cache_in_ref, which is never read).
    del cache_in_ref
    i, j = pl.program_id(0), pl.program_id(1)
    ns = cache_ref.shape[0]
    s = slots_ref[i]
    valid = (s >= 0) & (s < ns)
    dst = cache_ref.at[jnp.clip(s, 0, ns - 1), pl.ds(j * tile, tile)]
    plt.store(dst, staging_ref[...], mask=jnp.full((tile,), valid))


def _gather_heads_kernel(ids_ref, heads_ref, pool_ref, out_ref, *, rows: int, cols: int):
    # ids_ref, heads_ref: [n] int32; pool_ref: [NB, 2*bs, Hkv, hd] (whole pool); out_ref: [R, C].
    i, r, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    nb, _, hkv, _ = pool_ref.shape
    b = ids_ref[i]
    h = jnp.clip(heads_ref[i], 0, hkv - 1)
    valid = (b >= 0) & (b < nb)
    src = pool_ref.at[jnp.clip(b, 0, nb - 1), pl.ds(r * rows, rows), h, pl.ds(c * cols, cols)]
    out_ref[...] = plt.load(src, mask=jnp.full((rows, cols), valid), other=0)


def _scatter_heads_kernel(slots_ref, heads_ref, staging_ref, cache_in_ref, cache_ref, *, rows: int, cols: int):
    # slots_ref, heads_ref: [n] int32; staging_ref: [R, C]; cache_ref: [NS, 2*bs, Hkv, hd] (aliased).
    del cache_in_ref
    i, r, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    ns, _, hkv, _ = cache_ref.shape
    s = slots_ref[i]
    h = jnp.clip(heads_ref[i], 0, hkv - 1)
    valid = (s >= 0) & (s < ns)
    dst = cache_ref.at[jnp.clip(s, 0, ns - 1), pl.ds(r * rows, rows), h, pl.ds(c * cols, cols)]
    plt.store(dst, staging_ref[...], mask=jnp.full((rows, cols), valid))


# ------------------------------------------------------------------------------------------------
# pallas_call wrappers (flat views) and jitted public functions
# ------------------------------------------------------------------------------------------------


def _full_spec(shape: tuple[int, ...]) -> pl.BlockSpec:
    nd = len(shape)
    return pl.BlockSpec(shape, lambda *_: (0,) * nd)


def _heads_tiles(two_bs: int, hd: int, max_tile: int) -> tuple[int, int]:
    cols = pow2_divisor(hd, max_tile)
    rows = pow2_divisor(two_bs, max(1, max_tile // cols))
    return rows, cols


@functools.partial(jax.jit, static_argnames=("interpret", "max_tile", "num_warps"))
def gather_blocks(
    pool: Shaped[Array, "NB 2 bs Hkv hd"],
    ids: Int[Array, " n"],
    *,
    interpret: bool | None = None,
    max_tile: int = DEFAULT_MAX_TILE,
    num_warps: int = 4,
) -> Shaped[Array, "n 2 bs Hkv hd"]:
    """staging[i] = pool[ids[i]] (zeros where ids[i] is outside [0, NB)): whole blocks, one buffer."""
    _check_pool("pool", pool)
    _check_index("ids", ids)
    _check_tile(max_tile)
    nb, _, bs, hkv, hd = pool.shape
    n = ids.shape[0]
    if n == 0:
        return jnp.zeros((0, 2, bs, hkv, hd), pool.dtype)
    f = 2 * bs * hkv * hd
    tile = pow2_divisor(f, max_tile)
    out = on_platform(lambda interp: pl.pallas_call(
        functools.partial(_gather_blocks_kernel, tile=tile),
        grid=(n, f // tile),
        in_specs=[_full_spec((n,)), _full_spec((nb, f))],
        out_specs=pl.BlockSpec((None, tile), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n, f), pool.dtype),
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
        interpret=interp,
        name="gather_blocks",
    )(ids.astype(jnp.int32), pool.reshape(nb, f)), interpret)
    return out.reshape(n, 2, bs, hkv, hd)


@functools.partial(jax.jit, static_argnames=("interpret", "max_tile", "num_warps"), donate_argnames=("cache",))
def scatter_blocks(
    cache: Shaped[Array, "NS 2 bs Hkv hd"],
    slots: Int[Array, " n"],
    staging: Shaped[Array, "n 2 bs Hkv hd"],
    *,
    interpret: bool | None = None,
    max_tile: int = DEFAULT_MAX_TILE,
    num_warps: int = 4,
) -> Shaped[Array, "NS 2 bs Hkv hd"]:
    """cache[slots[i]] = staging[i] in place (cache is donated); slots outside [0, NS) are skipped."""
    _check_pool("cache", cache)
    _check_index("slots", slots)
    _check_tile(max_tile)
    ns, _, bs, hkv, hd = cache.shape
    n = slots.shape[0]
    _check_staging(staging, (n, 2, bs, hkv, hd), cache)
    if n == 0:
        return cache
    f = 2 * bs * hkv * hd
    tile = pow2_divisor(f, max_tile)
    out = on_platform(lambda interp: pl.pallas_call(
        functools.partial(_scatter_blocks_kernel, tile=tile),
        grid=(n, f // tile),
        in_specs=[_full_spec((n,)), pl.BlockSpec((None, tile), lambda i, j: (i, j)), _full_spec((ns, f))],
        out_specs=_full_spec((ns, f)),
        out_shape=jax.ShapeDtypeStruct((ns, f), cache.dtype),
        input_output_aliases={2: 0},
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
        interpret=interp,
        name="scatter_blocks",
    )(slots.astype(jnp.int32), staging.reshape(n, f), cache.reshape(ns, f)), interpret)
    return out.reshape(cache.shape)


@functools.partial(jax.jit, static_argnames=("interpret", "max_tile", "num_warps"))
def gather_block_heads(
    pool: Shaped[Array, "NB 2 bs Hkv hd"],
    ids: Int[Array, " n"],
    heads: Int[Array, " n"],
    *,
    interpret: bool | None = None,
    max_tile: int = DEFAULT_MAX_TILE,
    num_warps: int = 4,
) -> Shaped[Array, "n 2 bs hd"]:
    """staging[i] = pool[ids[i], :, :, heads[i]] (zeros where ids[i] is outside [0, NB))."""
    _check_pool("pool", pool)
    _check_index("ids", ids)
    _check_index("heads", heads, ids.shape[0])
    _check_tile(max_tile)
    nb, _, bs, hkv, hd = pool.shape
    n = ids.shape[0]
    if n == 0:
        return jnp.zeros((0, 2, bs, hd), pool.dtype)
    rows, cols = _heads_tiles(2 * bs, hd, max_tile)
    out = on_platform(lambda interp: pl.pallas_call(
        functools.partial(_gather_heads_kernel, rows=rows, cols=cols),
        grid=(n, 2 * bs // rows, hd // cols),
        in_specs=[_full_spec((n,)), _full_spec((n,)), _full_spec((nb, 2 * bs, hkv, hd))],
        out_specs=pl.BlockSpec((None, rows, cols), lambda i, r, c: (i, r, c)),
        out_shape=jax.ShapeDtypeStruct((n, 2 * bs, hd), pool.dtype),
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
        interpret=interp,
        name="gather_block_heads",
    )(ids.astype(jnp.int32), heads.astype(jnp.int32), pool.reshape(nb, 2 * bs, hkv, hd)), interpret)
    return out.reshape(n, 2, bs, hd)


@functools.partial(jax.jit, static_argnames=("interpret", "max_tile", "num_warps"), donate_argnames=("cache",))
def scatter_block_heads(
    cache: Shaped[Array, "NS 2 bs Hkv hd"],
    slots: Int[Array, " n"],
    heads: Int[Array, " n"],
    staging: Shaped[Array, "n 2 bs hd"],
    *,
    interpret: bool | None = None,
    max_tile: int = DEFAULT_MAX_TILE,
    num_warps: int = 4,
) -> Shaped[Array, "NS 2 bs Hkv hd"]:
    """cache[slots[i], :, :, heads[i]] = staging[i] in place (cache donated); slots outside [0, NS) skipped."""
    _check_pool("cache", cache)
    _check_index("slots", slots)
    _check_index("heads", heads, slots.shape[0])
    _check_tile(max_tile)
    ns, _, bs, hkv, hd = cache.shape
    n = slots.shape[0]
    _check_staging(staging, (n, 2, bs, hd), cache)
    if n == 0:
        return cache
    rows, cols = _heads_tiles(2 * bs, hd, max_tile)
    out = on_platform(lambda interp: pl.pallas_call(
        functools.partial(_scatter_heads_kernel, rows=rows, cols=cols),
        grid=(n, 2 * bs // rows, hd // cols),
        in_specs=[_full_spec((n,)), _full_spec((n,)),
                  pl.BlockSpec((None, rows, cols), lambda i, r, c: (i, r, c)),
                  _full_spec((ns, 2 * bs, hkv, hd))],
        out_specs=_full_spec((ns, 2 * bs, hkv, hd)),
        out_shape=jax.ShapeDtypeStruct((ns, 2 * bs, hkv, hd), cache.dtype),
        input_output_aliases={3: 0},
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
        interpret=interp,
        name="scatter_block_heads",
    )(slots.astype(jnp.int32), heads.astype(jnp.int32), staging.reshape(n, 2 * bs, hd),
      cache.reshape(ns, 2 * bs, hkv, hd)), interpret)
    return out.reshape(cache.shape)


# ------------------------------------------------------------------------------------------------
# Plain-jnp references (same index contract)
# ------------------------------------------------------------------------------------------------


@jax.jit
def gather_blocks_reference(pool: Shaped[Array, "NB 2 bs Hkv hd"], ids: Int[Array, " n"]) -> Array:
    nb = pool.shape[0]
    valid = (ids >= 0) & (ids < nb)
    rows = pool[jnp.clip(ids, 0, nb - 1)]  # [n, 2, bs, Hkv, hd]
    return jnp.where(valid[:, None, None, None, None], rows, jnp.zeros((), pool.dtype))


@jax.jit
def scatter_blocks_reference(
    cache: Shaped[Array, "NS 2 bs Hkv hd"], slots: Int[Array, " n"], staging: Shaped[Array, "n 2 bs Hkv hd"]
) -> Array:
    ns = cache.shape[0]
    tgt = jnp.where((slots >= 0) & (slots < ns), slots, ns)  # ns is out of bounds -> dropped
    return cache.at[tgt].set(staging, mode="drop")


@jax.jit
def gather_block_heads_reference(
    pool: Shaped[Array, "NB 2 bs Hkv hd"], ids: Int[Array, " n"], heads: Int[Array, " n"]
) -> Array:
    nb, hkv = pool.shape[0], pool.shape[3]
    valid = (ids >= 0) & (ids < nb)
    rows = pool[jnp.clip(ids, 0, nb - 1), :, :, jnp.clip(heads, 0, hkv - 1)]  # [n, 2, bs, hd]
    return jnp.where(valid[:, None, None, None], rows, jnp.zeros((), pool.dtype))


@jax.jit
def scatter_block_heads_reference(
    cache: Shaped[Array, "NS 2 bs Hkv hd"],
    slots: Int[Array, " n"],
    heads: Int[Array, " n"],
    staging: Shaped[Array, "n 2 bs hd"],
) -> Array:
    ns, hkv = cache.shape[0], cache.shape[3]
    tgt = jnp.where((slots >= 0) & (slots < ns), slots, ns)
    return cache.at[tgt, :, :, jnp.clip(heads, 0, hkv - 1)].set(staging, mode="drop")
