"""Quest-style per-block key metadata: element-wise min/max of the keys of each KV block.

For one layer's pool `pool: [NB, 2, bs, Hkv, hd]` (see `pulseinfer_jax.kv.cache`), the metadata of
block `b` and KV head `h` is the pair of vectors

    kmin[b, h, d] = min_t K[b, t, h, d]      kmax[b, h, d] = max_t K[b, t, h, d]

over the block's *valid* tokens t < len(b). `block_scoring.block_scores` turns them into an upper bound
of every q.k inside the block. The engine keeps per-layer arrays `meta_min/meta_max: [NB * m, Hkv, hd]` next
to the (possibly offloaded) cache, in float8_e4m3fn by default (rounded outward by `round_bounds_outward`, so
they still bound; `BlockScoring.bounds_dtype`) or in the KV dtype (exact). A prompt's blocks get theirs here at
prefill (`update_bounds`; the partial last one's over its tokens), and from then on each decoded key joins its
block's rows in the scoring kernel that reads them (`block_scoring.append_and_score`), so every block's bounds,
the sinks' and the window's included, are current at every step.
With m = `sub_blocks` > 1 each block has m rows, the bounds of its m equal token slices (finer bounds,
m times the bytes; `block_scoring` combines them).

A float8 pool (`kv_quant`: float8_e4m3fn values plus their bfloat16 scales, [NB, 2, bs + r, Hkv, hd]) is read
through its scales: the bounds are those of the dequantised keys (float8 x bfloat16 scale, exact in
float32), i.e. exactly the keys attention reads, so they bound its scores as they do for any other dtype.

No Pallas kernel here, on purpose: the op is a gather of `n` blocks followed by a masked min/max over
the token axis. XLA fuses the gather, the mask and the reduction into one pass that reads each listed
key exactly once (the same traffic a kernel would have), and the op runs once per filled block (once
every `bs` decode steps, or once per prefill chunk): off the per-step critical path. A kernel would add
a GPU-compile risk and no speed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pulseinfer_jax.kv import quant as kv_quant


def _check_inputs(pool: Array, block_ids: Array, block_lens: Array, full_cache: bool = False) -> None:
    if full_cache and (pool.ndim != 6 or pool.shape[2] != 2):
        raise ValueError(f"with layer=..., pool must be the full [L, NB, 2, rows, Hkv, hd] cache, got {pool.shape}")
    if not full_cache and (pool.ndim != 5 or pool.shape[1] != 2):
        raise ValueError(f"pool must be one layer's [NB, 2, rows, Hkv, hd] K|V pool, got shape {pool.shape}; "
                         "pass kv[layer], or the full [L, NB, 2, rows, Hkv, hd] cache together with layer=")
    if block_ids.ndim != 1 or block_lens.shape != block_ids.shape:
        raise ValueError(f"block_ids {block_ids.shape} and block_lens {block_lens.shape} must both be [n]")
    if not jnp.issubdtype(block_ids.dtype, jnp.integer) or not jnp.issubdtype(block_lens.dtype, jnp.integer):
        raise ValueError(f"block_ids ({block_ids.dtype}) and block_lens ({block_lens.dtype}) must be integer arrays")


def check_sub_blocks(sub_blocks: int, block_size: int) -> None:
    """Sub-block slices must split a block evenly: a positive int dividing the block size."""
    if isinstance(sub_blocks, bool) or not isinstance(sub_blocks, int) or sub_blocks < 1 or block_size % sub_blocks:
        raise ValueError(f"sub_blocks={sub_blocks!r} must be a positive int dividing the block size {block_size}")


@functools.partial(jax.jit, static_argnames=("sub_blocks",))
def block_key_bounds(
    pool: Float[Array, "NB 2 rows Hkv hd"] | Float[Array, "L NB 2 rows Hkv hd"],
    block_ids: Int[Array, " n"],
    block_lens: Int[Array, " n"],
    *,
    layer: Int[Array, ""] | int | None = None,
    sub_blocks: int = 1,
) -> tuple[Float[Array, "nm Hkv hd"], Float[Array, "nm Hkv hd"]]:
    """Element-wise (min, max) of the keys over the first `block_lens[i]` tokens of block `block_ids[i]`.

    pool: one layer's [NB, 2, rows, Hkv, hd] pool, or (with `layer`, a possibly traced index) the full
      [L, NB, 2, rows, Hkv, hd] cache: then only the listed blocks of that layer are read, no layer copy.
      rows = bs, or bs + r for float8_e4m3fn with its scale rows: then the bounds are the dequantised keys'.
    block_ids: physical block ids in [0, NB) (out-of-range ids are clamped: keep them in range).
    block_lens: valid tokens per listed block, in [0, bs] (clamped). Slots at or beyond the length are
      never read into the result, whatever they hold (NaN included).
    sub_blocks: m > 1 bounds each of the m equal slices of a block (tokens [j*bs/m, (j+1)*bs/m)) on its own:
      row i*m + j of the result is slice j of block_ids[i] (the layout `block_scores(..., sub_blocks=m)` reads).
    Returns float32 (kmin, kmax), each [n*m, Hkv, hd]. A block (or slice) with no valid token gets zero
    bounds (any value bounds an empty set, and zeros keep the scores finite, whereas +-inf would give
    0 * inf = NaN in `block_scores`).
    """
    _check_inputs(pool, block_ids, block_lens, full_cache=layer is not None)
    bs = kv_quant.tokens_per_block(pool)
    check_sub_blocks(sub_blocks, bs)
    if layer is None:
        blocks = pool[block_ids, 0]  # [n, rows, Hkv, hd]
    else:
        blocks = pool[layer, block_ids, 0]
    keys = kv_quant.unpack_blocks(blocks, jnp.float32)  # [n, bs, Hkv, hd]: float8 dequantised after the gather
    n, m, sb = keys.shape[0], sub_blocks, bs // sub_blocks
    keys = keys.reshape(n * m, sb, *keys.shape[2:])  # [n*m, bs/m, Hkv, hd]: slices in order
    lens = jnp.clip(jnp.clip(block_lens, 0, bs)[:, None] - jnp.arange(m) * sb, 0, sb).reshape(n * m)
    valid = (jnp.arange(sb)[None, :] < lens[:, None])[:, :, None, None]  # [n*m, bs/m, 1, 1]
    kmin = jnp.min(jnp.where(valid, keys, jnp.inf), axis=1)
    kmax = jnp.max(jnp.where(valid, keys, -jnp.inf), axis=1)
    empty = (lens == 0)[:, None, None]
    return jnp.where(empty, 0.0, kmin), jnp.where(empty, 0.0, kmax)


def block_key_bounds_reference(
    pool: Float[Array, "NB 2 rows Hkv hd"],
    block_ids: Int[Array, " n"],
    block_lens: Int[Array, " n"],
    *,
    sub_blocks: int = 1,
) -> tuple[Float[Array, "nm Hkv hd"], Float[Array, "nm Hkv hd"]]:
    """Plain jnp reference: one block slice at a time, slicing the valid tokens explicitly (Python loop over n,
    so `block_ids`/`block_lens` must be concrete). Same contract as `block_key_bounds`."""
    _check_inputs(pool, block_ids, block_lens)
    hkv, hd = pool.shape[3], pool.shape[4]
    bs = kv_quant.tokens_per_block(pool)
    sb = bs // sub_blocks
    kmins, kmaxs = [], []
    for b, n in zip(jax.device_get(block_ids).tolist(), jax.device_get(block_lens).tolist(), strict=True):
        n = min(max(int(n), 0), bs)
        for j in range(sub_blocks):
            lo, hi = j * sb, min(n, (j + 1) * sb)
            if hi <= lo:
                kmins.append(jnp.zeros((hkv, hd), jnp.float32))
                kmaxs.append(jnp.zeros((hkv, hd), jnp.float32))
                continue
            k = kv_quant.unpack_blocks(pool[b, 0], jnp.float32)[lo:hi]  # [tokens, Hkv, hd]
            kmins.append(k.min(axis=0))
            kmaxs.append(k.max(axis=0))
    if not kmins:
        empty = jnp.zeros((0, hkv, hd), jnp.float32)
        return empty, empty
    return jnp.stack(kmins), jnp.stack(kmaxs)


def round_bounds_outward(
    kmin: Float[Array, "*s"], kmax: Float[Array, "*s"], dtype
) -> tuple[Float[Array, "*s"], Float[Array, "*s"]]:
    """Store key bounds in `dtype` so that they still bound: kmin rounded toward -inf, kmax toward +inf (each
    moves by at most one step of `dtype`). A cast that is exact (bf16 keys' bounds stored in bf16 or float32)
    changes nothing. Values beyond the dtype's finite range saturate at +-max (float8_e4m3fn: +-448), the one
    case where a stored bound no longer bounds; it only affects which blocks are selected, never the attention
    over them. NaN stays NaN."""
    dt = jnp.dtype(dtype)
    if not jnp.issubdtype(dt, jnp.floating) or dt.itemsize not in (1, 2, 4):
        raise ValueError(f"key bounds need a 1-, 2- or 4-byte float dtype, got {dt}")
    return kv_quant.round_directed(kmin, dt, down=True), kv_quant.round_directed(kmax, dt, down=False)


def _as_bytes(meta: Array) -> Array:
    """A 1-byte float array (float8 bounds) as its uint8 bytes; any other dtype unchanged. XLA:CPU scatters float8
    by converting the whole array to float16 and back, and gathers from that copy (2 ms per decode layer with
    SmolLM2's pool, read from its compiled program), where rows moved as bytes cost what they move."""
    one_byte_float = jnp.issubdtype(meta.dtype, jnp.floating) and jnp.dtype(meta.dtype).itemsize == 1
    return jax.lax.bitcast_convert_type(meta, jnp.uint8) if one_byte_float else meta


def take_rows(meta: Float[Array, "NB Hkv hd"], rows: Int[Array, "*i"]) -> Float[Array, "*i Hkv hd"]:
    """meta[rows] (rows in range), float8 moved as bytes (`_as_bytes`)."""
    return jax.lax.bitcast_convert_type(_as_bytes(meta)[rows], meta.dtype)


def set_rows(meta: Float[Array, "NB Hkv hd"], rows: Int[Array, " n"],
             values: Float[Array, "n Hkv hd"]) -> Float[Array, "NB Hkv hd"]:
    """meta.at[rows].set(values) with rows out of range dropped, float8 moved as bytes (`_as_bytes`): in place
    where the caller's jit donates `meta`."""
    out = _as_bytes(meta).at[rows].set(_as_bytes(values.astype(meta.dtype)), mode="drop")
    return jax.lax.bitcast_convert_type(out, meta.dtype)


def init_bounds(num_blocks: int, num_kv_heads: int, head_dim: int) -> tuple[Array, Array]:
    """Zero per-layer metadata arrays (meta_min, meta_max), each [NB, Hkv, hd] float32."""
    shape = (num_blocks, num_kv_heads, head_dim)
    return jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32)


def update_bounds(
    meta_min: Float[Array, "NB Hkv hd"],
    meta_max: Float[Array, "NB Hkv hd"],
    block_ids: Int[Array, " n"],
    kmin: Float[Array, "n Hkv hd"],
    kmax: Float[Array, "n Hkv hd"],
) -> tuple[Float[Array, "NB Hkv hd"], Float[Array, "NB Hkv hd"]]:
    """Write the bounds of blocks `block_ids` into one layer's metadata rows (jittable; donate the metadata
    in the caller's jit to update in place), rounded outward to the metadata's dtype (`round_bounds_outward`).
    Ids < 0 (padding) and ids >= NB are dropped, not wrapped."""
    if meta_min.shape != meta_max.shape or meta_min.ndim != 3 or meta_min.dtype != meta_max.dtype:
        raise ValueError(f"meta_min {meta_min.shape} {meta_min.dtype} and meta_max {meta_max.shape} {meta_max.dtype} "
                         "must both be [NB, Hkv, hd] of one dtype")
    if kmin.shape != kmax.shape or kmin.shape != (block_ids.shape[0], *meta_min.shape[1:]):
        raise ValueError(f"kmin {kmin.shape} / kmax {kmax.shape} must be [n, Hkv, hd] = "
                         f"[{block_ids.shape[0]}, {meta_min.shape[1]}, {meta_min.shape[2]}] to match block_ids "
                         "and the metadata")
    nb = meta_min.shape[0]
    ids = jnp.where(block_ids < 0, nb, block_ids)  # negative ids would wrap around: send them out of range
    kmin, kmax = round_bounds_outward(kmin, kmax, meta_min.dtype)
    return set_rows(meta_min, ids, kmin), set_rows(meta_max, ids, kmax)
