"""float8 (e4m3) KV with scales: quantise K / V once, when written, and dequantise where attention reads them.

Two scale granularities over a block of KV `[..., bs, Hkv, hd]` (tokens, heads, features):
  - "token": one scale per (token, KV head), the amax of that token's head_dim features. A decode step appends
    one token to a partly filled block without touching the tokens already there (nothing is re-quantised), and one
    outlier token costs only itself precision.
  - "block": one scale per (block, KV head), the amax over the block's tokens and features: 1 / bs of the scales'
    bytes, but a block's scale moves when a later token's amax exceeds it (the earlier tokens would be re-quantised
    on append) and every token of the block shares an outlier's coarse steps.
`quantize` maps amax to e4m3's largest finite value (448): round-to-nearest-even keeps each element within half a
step of its value (relative 2^-4 of the element for normals, 2^-9 x amax at the bottom of the range). Scales are
float32; an all-zero group gets scale 1 (its zeros stay zeros; no division by zero, no NaN). With `pow2` the scale
is rounded up to a power of two (amax lands in (224, 448]): a float8 value keeps its 3 mantissa bits, so only the
subnormal floor moves, and dequantising is exact in any float dtype with float32's exponent range.

The cache's float8 storage (`kv_dtype="float8_e4m3fn"`) uses per-token power-of-two scales, each stored as ONE
byte, a *scale code*, inside the block it scales: a block `[2, bs + 1, Hkv, hd]` holds the bs tokens' e4m3 values
and, in row bs of K and of V, the codes of every (token, head): `block[c, bs, h, t]` scales `block[c, t, h, :]`.
A block therefore stays one contiguous run with its scales (one transfer for spill and recall, moved bit for bit:
nothing is re-quantised between write and read), the null block and padding stay plain bytes, and tensor
parallelism's split by KV head carries each head's codes with it. Code b stands for 2^(b - SCALE_BIAS), b in
[1, 126] (also a finite positive e4m3 bit pattern, should a code ever be read as a value).
The arrays hold the bytes as uint8 (STORAGE), read as float8 only where attention converts them: XLA:CPU has no
native float8 scatter and rewrote each one-token cache write into a copy of the whole cache (measured: 200 ms per
write into a 390 MB cache, against 0.015 ms for the same write in uint8); readers accept either dtype.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
Granularity = Literal["token", "block"]
KV_DTYPES = ("auto", "float8_e4m3fn")  # EngineConfig.kv_dtype: the model's dtype, or float8 with scale codes
STORAGE = jnp.dtype(jnp.uint8)  # the float8 cache's array dtype: e4m3 bytes and scale codes
SCALE_BIAS = 64  # scale code b -> 2^(b - 64)
CODE_MIN, CODE_MAX = 1, 126  # scales 2^-63 .. 2^62; codes stay finite positive e4m3 patterns (0x7f is NaN)


def quantize(x: Float[Array, "... bs H hd"], granularity: Granularity = "token", *, pow2: bool = False
             ) -> tuple[Float[Array, "... bs H hd"], Float[Array, "... s H 1"]]:
    """(x / scale as float8_e4m3fn, scale float32) with scale = amax / 448 per (token, head) ("token": s = bs) or per
    (block, head) ("block": s = 1); with `pow2` the power of two at or above it (clamped to the codes' range)."""
    if granularity not in ("token", "block"):
        raise ValueError(f"granularity={granularity!r}; use 'token' or 'block'")
    xf = x.astype(jnp.float32)
    axes = (-1,) if granularity == "token" else (-3, -1)
    amax = jnp.max(jnp.abs(xf), axis=axes, keepdims=True)
    if pow2:
        scale = jnp.ldexp(jnp.float32(1.0), _exponent(amax))
    else:
        scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return jnp.clip(xf / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale


def _exponent(amax: Array) -> Int[Array, "..."]:
    """The smallest e with amax / 2^e <= 448 (0 for amax 0), clamped to the scale codes' range."""
    mant, ex = jnp.frexp(amax / FP8_MAX)  # amax / 448 = mant * 2^ex, mant in [0.5, 1)
    e = jnp.where(mant == 0.5, ex - 1, ex)  # an exact power of two needs no step up
    e = jnp.where(amax > 0, e, 0)
    return jnp.clip(e, CODE_MIN - SCALE_BIAS, CODE_MAX - SCALE_BIAS).astype(jnp.int32)


def dequantize(q: Float[Array, "... bs H hd"], scale: Float[Array, "... s H 1"], dtype=jnp.float32
               ) -> Float[Array, "... bs H hd"]:
    """The values `q` x `scale` stand for, in `dtype`."""
    return (q.astype(jnp.float32) * scale).astype(dtype)


# ---- the cache's float8 storage: values plus one scale code per (token, head) in row bs of the block -------------
def is_quantized(dtype) -> bool:
    """Whether a cache of `dtype` (its STORAGE bytes, or float8_e4m3fn naming the format) holds float8 values with
    scale codes."""
    return jnp.dtype(dtype) in (STORAGE, jnp.dtype(FP8))


def resolve_kv_dtype(kv_dtype: str, model_dtype) -> str:
    """`EngineConfig.kv_dtype` -> the KV format's name ("auto": the model's dtype)."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype={kv_dtype!r}; use one of {', '.join(KV_DTYPES)}")
    return jnp.dtype(model_dtype).name if kv_dtype == "auto" else jnp.dtype(FP8).name


def storage_dtype(kv_dtype) -> jnp.dtype:
    """The cache arrays' dtype for a KV format (a dtype or its name): STORAGE for float8, else the format itself."""
    return STORAGE if is_quantized(kv_dtype) else jnp.dtype(kv_dtype)


def as_float8(x: Array) -> Array:
    """Stored bytes (or float8 already) viewed as float8_e4m3fn (a free bitcast)."""
    return x if x.dtype == jnp.dtype(FP8) else jax.lax.bitcast_convert_type(x, FP8)


def block_rows(block_size: int, head_dim: int, dtype) -> int:
    """Token rows of one block's K (and of its V) in storage: bs, plus the scale-code row for float8."""
    if not is_quantized(dtype):
        return block_size
    if block_size > head_dim:
        raise ValueError(f"float8 KV keeps a block's scale codes in one row of head_dim={head_dim} bytes per head, "
                         f"which holds at most {head_dim} tokens; use block_size <= {head_dim}")
    return block_size + 1


def layer_block_bytes(block_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes of one block of one layer in storage (K and V of every head, scale codes included)."""
    rows = block_rows(block_size, head_dim, dtype)
    return 2 * rows * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def tokens_per_block(kv: Array) -> int:
    """Tokens a block of `kv` holds: a cache [L, NB, 2, rows, Hkv, hd], a pool [NB, 2, rows, Hkv, hd] or staging."""
    rows = kv.shape[-3]
    return rows - 1 if is_quantized(kv.dtype) else rows


def code_scales(codes: Array) -> Float[Array, "..."]:
    """Scale codes (uint8, or float8 bytes) -> their float32 power-of-two scales (built from the exponent bits:
    exact)."""
    if codes.dtype != STORAGE:
        codes = jax.lax.bitcast_convert_type(codes, STORAGE)
    b = codes.astype(jnp.int32)
    return jax.lax.bitcast_convert_type((b - SCALE_BIAS + 127) << 23, jnp.float32)


def encode(x: Float[Array, "... H hd"]) -> tuple[Array, Array]:
    """Tokens' K or V -> (e4m3 value bytes [..., H, hd], scale codes [..., H]), both uint8 (STORAGE): per
    (token, head) power-of-two scales."""
    values, _ = quantize(x[..., None, :, :], "token", pow2=True)
    e = _exponent(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1))
    codes = (e + SCALE_BIAS).astype(STORAGE)
    return jax.lax.bitcast_convert_type(values[..., 0, :, :], STORAGE), codes


def pack_blocks(x: Float[Array, "... bs H hd"], dtype) -> Array:
    """Whole blocks of K or V (tokens, heads, features) in storage form [..., rows, H, hd]: cast, or for a float8
    `dtype` (or STORAGE) the value bytes and their code row, uint8."""
    if not is_quantized(dtype):
        return x.astype(dtype)
    bs, h, hd = x.shape[-3:]
    block_rows(bs, hd, dtype)  # (checks bs <= hd)
    values, codes = encode(x)  # [..., bs, H, hd], [..., bs, H]
    row = jnp.swapaxes(codes, -1, -2)  # [..., H, bs]
    row = jnp.concatenate([row, jnp.zeros(row.shape[:-1] + (hd - bs,), STORAGE)], axis=-1)
    return jnp.concatenate([values, row[..., None, :, :]], axis=-3)


def unpack_blocks(blocks: Array, dtype) -> Float[Array, "... bs H hd"]:
    """Stored blocks of K or V [..., rows, H, hd] -> their values in `dtype` (float8 x its power-of-two scale:
    exact)."""
    if not is_quantized(blocks.dtype):
        return blocks.astype(dtype)
    bs = blocks.shape[-3] - 1
    scales = code_scales(jnp.swapaxes(blocks[..., bs, :, :bs], -1, -2))  # [..., bs, H]
    return (as_float8(blocks[..., :bs, :, :]).astype(jnp.float32) * scales[..., None]).astype(dtype)


def write_tokens(kv: Array, li: Int[Array, " B"], bi: Int[Array, " B"], off: Int[Array, " B"],
                 k: Float[Array, "B Hkv hd"], v: Float[Array, "B Hkv hd"]) -> Array:
    """One new token per row b at slot off[b] of block (li[b], bi[b]) of the cache `kv` [L, NB, 2, rows, Hkv, hd]: K
    and V (float8: values and their codes; the block's other tokens are left bit for bit)."""
    if not is_quantized(kv.dtype):
        kv = kv.at[li, bi, 0, off].set(k.astype(kv.dtype))
        return kv.at[li, bi, 1, off].set(v.astype(kv.dtype))
    bs = tokens_per_block(kv)
    for half, x in ((0, k), (1, v)):
        values, codes = encode(x)  # [B, Hkv, hd], [B, Hkv]
        if kv.dtype != STORAGE:  # (a float8-typed cache)
            values, codes = as_float8(values), as_float8(codes)
        kv = kv.at[li, bi, half, off].set(values)
        kv = kv.at[li, bi, half, bs, :, off].set(codes)  # advanced indices first: [B, Hkv]
    return kv
