"""Scores of a sequence's always-kept blocks (sinks, recent window) straight from their resident keys, in one kernel.

SoloHead's normalized_sum needs the kept blocks' scores in the units of the metadata scores (`block_scoring`): the
bound score of each of the block's m slices over the keys written so far, combined by logsumexp(scale * s) /
scale (selection/kept_blocks.py says why). Their metadata rows do not exist yet (a block's bounds are written when
it leaves the window), so the bounds come from the cache. In plain XLA that is four kernels per layer (lengths, the
keys' gather with their min / max, the score, the masks); here one program per (sequence, KV head):

    grid = (B, Hkv)
    program (b, h), for each kept entry i < KK and slice j < m (static loops, KK * m small):
      keys   pool[units[b, i], K, j*bs/m : (j+1)*bs/m, h, :]   [bs/m, hd], tokens at or past lens[b, i] masked
      bounds kmin, kmax over the valid tokens                    [hd] each (f32)
      score  sum_d max(q_d kmax_d, q_d kmin_d) (beta = 1), else q_d mid_d + beta |q_d| half_d, per query head of
             the group [G] (or summed over the group)
    writes   out[b, h*G:(h+1)*G, :] (per_head) or out[b, h, :]   [.., KK] f32, -inf for no block / no token

It reads (sinks + window) x bs keys per sequence and KV head, which the step's attention reads anyway. Float8 pools
(`kv_quant`: e4m3 bytes with a bfloat16 scale per token and head, stored in the rotated basis): the keys are the values
times their scales, rotated back by one [T, hd] x [hd, hd] bfloat16 dot of the e4m3 values with the +-1 Hadamard
matrix (exact, float32 sums; T >= 16 rows, masked past the slice), then scaled, so the bounds are the dequantised
keys' as `block_key_bounds` takes them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int
from pulseinfer_jax.pallas_kernels.block_metadata import block_key_bounds, check_sub_blocks, round_bounds_outward
from pulseinfer_jax.pallas_kernels.block_scoring import block_scores_reference
from pulseinfer_jax.pallas_kernels.common import next_pow2, on_platform, tile, traced_zero, triton_params

from pulseinfer_jax.kv import quant as kv_quant

MIN_DOT_ROWS = 16  # Triton dots need >= 16 rows


def _kernel(off_ref, units_ref, lens_ref, q_ref, k_ref, *rest, g: int, gp: int, kk: int, m: int, per_head: bool,
            beta: float, scale: float, rot_scale: float):
    """off_ref [1] (added to units >= 0); units_ref / lens_ref [KK]; q_ref [G, hd]; k_ref [U, rows, hd] (K of head h);
    for a float8 pool rot_ref [hd, hd] (the cache's rotation x sqrt(p), bfloat16 +-1 / 0; rot_scale = 1 / sqrt(p))
    next; out_ref [G, KK] or [KK]."""
    out_ref = rest[-1]
    hd = q_ref.shape[1]
    quantized = kv_quant.is_quantized(k_ref.dtype)
    bs = kv_quant.block_tokens(k_ref.shape[1], hd, k_ref.dtype)  # (float8: rows past bs hold the scales)
    sb = bs // m
    tp = max(sb, MIN_DOT_ROWS) if quantized else sb  # rows of a loaded slice (the rotation's dot needs >= 16)
    zero = traced_zero()
    q = plt.load(q_ref.at[tile(gp, zero)], mask=jnp.broadcast_to((jnp.arange(gp) < g)[:, None], (gp, hd)),
                 other=0).astype(jnp.float32)  # [Gp, hd]: padding rows 0 (they add nothing)
    tok = jnp.arange(tp, dtype=jnp.int32)
    feat = jnp.arange(hd, dtype=jnp.int32)
    kkp = next_pow2(kk)
    col = jnp.arange(kkp, dtype=jnp.int32)
    out = jnp.full((gp, kkp) if per_head else (kkp,), -jnp.inf, jnp.float32)
    for i in range(kk):
        u, n = units_ref[i], lens_ref[i]
        live = (u >= 0) & (n > 0)
        u = u + off_ref[0]
        parts = []
        for j in range(m):
            at = j * sb + tok  # [T] token slots of slice j
            valid = live & (at < n) & (tok < sb)
            ids = jnp.maximum(u, 0) + jnp.zeros((tp,), jnp.int32)
            keys = plt.load(k_ref.at[(ids[:, None], at[:, None], feat[None, :])],
                            mask=jnp.broadcast_to(valid[:, None], (tp, hd)), other=0)
            if quantized:  # e4m3 values x each token's bfloat16 scale (exact in float32), rotated back (x H)
                scales = kv_quant.scale_from_bytes(*(
                    plt.load(k_ref.at[(ids, *kv_quant.scale_position(at, byte, bs, hd))], mask=valid, other=0)
                    for byte in range(kv_quant.SCALE_BYTES)))  # [T]
                # rotate(v * s) = (v @ (H sqrt(p))) * s / sqrt(p): e4m3 values and a +-1 / 0 matrix are exact in
                # bfloat16, their products summed in float32 exactly, so the dot is a tensor-core bfloat16 one
                vals = kv_quant.as_float8(keys).astype(jnp.bfloat16)
                keys = jax.lax.dot_general(vals, rest[0][...], (((1,), (0,)), ((), ())),
                                           preferred_element_type=jnp.float32) * (scales * rot_scale)[:, None]
            else:
                keys = keys.astype(jnp.float32)
            kmin = jnp.min(jnp.where(valid[:, None], keys, jnp.inf), axis=0)  # [hd]
            kmax = jnp.max(jnp.where(valid[:, None], keys, -jnp.inf), axis=0)
            on = live & (n > j * sb)  # the slice holds a token
            kmin, kmax = jnp.where(on, kmin, 0.0), jnp.where(on, kmax, 0.0)
            if beta == 1.0:
                prod = jnp.maximum(q * kmax[None, :], q * kmin[None, :])
            else:
                prod = q * ((kmax + kmin) / 2)[None, :] + beta * jnp.abs(q) * ((kmax - kmin) / 2)[None, :]
            s = jnp.sum(prod, axis=1)  # [Gp]
            if not per_head:
                s = jnp.sum(s)
            parts.append(jnp.where(on, s, -jnp.inf))
        if m == 1:
            s = parts[0]
        else:  # logsumexp(scale * s_j) / scale over the slices with a token; none -> -inf
            top = functools.reduce(jnp.maximum, parts) * scale
            off = jnp.where(top == -jnp.inf, 0.0, top)
            total = functools.reduce(jnp.add, [jnp.exp(p * scale - off) for p in parts])
            s = jnp.where(top == -jnp.inf, -jnp.inf, (jnp.log(total) + off) / scale)
        out = jnp.where(col[None, :] == i, s[:, None], out) if per_head else jnp.where(col == i, s, out)
    if per_head:
        mask = (jnp.arange(gp) < g)[:, None] & (col < kk)[None, :]
        plt.store(out_ref.at[tile(gp, zero), tile(kkp, zero)], out, mask=mask)
    else:
        plt.store(out_ref.at[tile(kkp, zero)], out, mask=col < kk)


def _check(q, pool, units, lens, sub_blocks):
    if q.ndim != 3 or pool.ndim != 5:
        raise ValueError(f"q must be [B, Hq, hd] and pool [U, 2, rows, Hkv, hd]; got {q.shape} and {pool.shape}")
    b, hq, hd = q.shape
    hkv = pool.shape[3]
    if pool.shape[4] != hd or hq % hkv:
        raise ValueError(f"q {q.shape} does not fit the pool {pool.shape}: head_dim must match and Hq be a multiple "
                         "of Hkv")
    if units.ndim != 2 or units.shape[0] != b or lens.shape != units.shape:
        raise ValueError(f"units {units.shape} and lens {lens.shape} must both be [B, KK] with B = {b}")
    check_sub_blocks(sub_blocks, kv_quant.tokens_per_block(pool))


@functools.partial(jax.jit, static_argnames=("per_head", "beta", "sub_blocks", "scale", "num_warps", "interpret"))
def kept_scores(
    q: Float[Array, "B Hq hd"],
    pool: Float[Array, "U 2 rows Hkv hd"],
    units: Int[Array, "B KK"],
    lens: Int[Array, "B KK"],
    unit_offset: Int[Array, ""] | int = 0,
    *,
    per_head: bool,
    beta: float,
    sub_blocks: int,
    scale: float,
    num_warps: int = 4,
    interpret: bool | None = None,
) -> Float[Array, "B S KK"]:
    """Scores of the blocks `units` (+ `unit_offset` where >= 0, inside the kernel: a layer's blocks of a flat
    cache) of a flat pool (their first `lens` tokens; len 0 or unit -1 = no block -> -inf), in the units of
    `block_scores(q, meta, ..., per_head, beta, sub_blocks, scale)` (module docstring). The pool's block size and
    head dim must be powers of two (float8 blocks: bounds of their dequantised keys). Returns float32 [B, S, KK]
    (S = Hq with per_head, else Hkv)."""
    _check(q, pool, units, lens, sub_blocks)
    b, hq, hd = q.shape
    u, _, rows, hkv, _ = pool.shape
    g, kk = hq // hkv, units.shape[1]
    bs = kv_quant.tokens_per_block(pool)
    if bs & (bs - 1) or hd & (hd - 1):
        raise ValueError(f"block size {bs} and head_dim {hd} must be powers of two (Triton tile sizes)")
    quantized = kv_quant.is_quantized(pool.dtype)
    p = hd & -hd  # the rotation's Hadamard block: entries +-1 / sqrt(p)
    rot = [jnp.asarray(np.round(kv_quant.hadamard(hd) * np.sqrt(p)), jnp.bfloat16)] if quantized else []
    kernel = functools.partial(_kernel, g=g, gp=next_pow2(g), kk=kk, m=sub_blocks, per_head=per_head,
                               beta=float(beta), scale=float(scale), rot_scale=float(1 / np.sqrt(p)))
    s = hq if per_head else hkv
    out_spec = (pl.BlockSpec((None, g, kk), lambda i, h: (i, h, 0)) if per_head else
                pl.BlockSpec((None, None, kk), lambda i, h: (i, h, 0)))
    return on_platform(lambda interp: pl.pallas_call(
        kernel,
        grid=(b, hkv),
        in_specs=[pl.BlockSpec((1,), lambda i, h: (0,)),  # unit offset
                  pl.BlockSpec((None, kk), lambda i, h: (i, 0)),  # units -> [KK]
                  pl.BlockSpec((None, kk), lambda i, h: (i, 0)),  # lens -> [KK]
                  pl.BlockSpec((None, g, hd), lambda i, h: (i, h, 0)),  # q -> [G, hd]
                  pl.BlockSpec((u, None, rows, None, hd), lambda i, h: (0, 0, 0, h, 0))]  # K of head h
        + [pl.BlockSpec((hd, hd), lambda i, h: (0, 0))] * quantized,  # float8: the rotation
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct((b, s, kk), jnp.float32),
        compiler_params=triton_params(num_warps=num_warps, num_stages=1),
        interpret=interp,
        name=f"kept_scores_kk{kk}_m{sub_blocks}" + ("_per_head" if per_head else "") + ("_f8" if quantized else ""),
    )(jnp.asarray(unit_offset, jnp.int32).reshape(1), units.astype(jnp.int32), lens.astype(jnp.int32), q, pool, *rot),
        interpret)


def kept_scores_reference(
    q: Float[Array, "B Hq hd"],
    pool: Float[Array, "U 2 rows Hkv hd"],
    units: Int[Array, "B KK"],
    lens: Int[Array, "B KK"],
    unit_offset: Int[Array, ""] | int = 0,
    *,
    per_head: bool,
    beta: float,
    sub_blocks: int,
    scale: float,
    bounds_dtype=None,
) -> Float[Array, "B S KK"]:
    """Plain jnp: the blocks' key bounds (`block_key_bounds`, float8 dequantised) scored by the metadata formula
    (`block_scores_reference`), slices with no token -inf, combined by logsumexp(scale * s) / scale. Same contract
    as `kept_scores`, any pool dtype; with `bounds_dtype` the bounds are first stored as the engine's metadata
    stores them (`round_bounds_outward`) and read back."""
    _check(q, pool, units, lens, sub_blocks)
    b, kk = units.shape
    m = sub_blocks
    live = (units >= 0) & (lens > 0)
    ids = jnp.where(live, units + unit_offset, 0).reshape(-1)
    kmin, kmax = block_key_bounds(pool, ids, jnp.where(live, lens, 0).reshape(-1), sub_blocks=m)  # [B*KK*m, ...]
    if bounds_dtype is not None:
        kmin, kmax = (a.astype(jnp.float32) for a in round_bounds_outward(kmin, kmax, bounds_dtype))
    sb = kv_quant.tokens_per_block(pool) // m
    slice_len = jnp.clip(lens[:, :, None] - jnp.arange(m) * sb, 0, sb)  # [B, KK, m]
    slice_live = (slice_len > 0) & live[:, :, None]
    rows = jnp.arange(b * kk * m, dtype=jnp.int32).reshape(b, kk * m)
    s = block_scores_reference(q, kmin, kmax, jnp.where(slice_live.reshape(b, -1), rows, -1), per_head=per_head,
                               beta=beta)  # [B, S, KK*m], empty slices -inf
    s = s.reshape(b, s.shape[1], kk, m)
    if m == 1:
        return s[..., 0]
    return jax.nn.logsumexp(s * scale, axis=-1) / scale
