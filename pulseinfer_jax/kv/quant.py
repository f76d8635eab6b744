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
float32; an all-zero group gets scale 1 (its zeros stay zeros; no division by zero, no NaN). With `code` the scale
is what fewer bytes hold: "bf16" (rounded to nearest; x / scale saturates at 448), "e5m2" or "pow2" (rounded up).
Measured on SmolLM2's keys (bench/kv_fp8.py): a bfloat16 scale keeps float32's accuracy, a one-byte scale (e5m2,
a power of two) doubles the attention KL: the amax element, often a head's outlier channel that dominates q.k, is
exact only when the scale puts it on 448.

The cache's float8 storage (`kv_dtype="float8_e4m3fn"`) keeps one bfloat16 scale per (token, KV head) inside the
block it scales: a block `[2, bs + r, Hkv, hd]` holds the bs tokens' e4m3 values in rows 0..bs-1 of K and of V and,
in the r = ceil(2 bs / hd) *scale rows* after them, each head's scales as bytes: token t's scale is bytes 2t (low)
and 2t + 1 (high) of head h's scale rows read as one run (`scale_bytes`). A block therefore stays one contiguous
run with its scales (one transfer for spill and recall, moved bit for bit: nothing is re-quantised between write
and read), the null block and padding stay plain bytes, and tensor parallelism's split by KV head carries each
head's scales with it. A stored value times its scale (e4m3 x bfloat16: 12 significant bits) is exact in float32.
Each head's K and V are stored in a rotated basis: x H, H the orthonormal Hadamard matrix of head_dim (`rotate`;
symmetric, its own inverse). The rotation spreads a head's outlier channel over every feature, so the per-token amax
no longer sits on one channel that alone decides the scale (measured on SmolLM2, bench/kv_fp8.py --hadamard: the
attention KL halves). q.k and softmax(.) v are unchanged when q is rotated the same way and the output rotated back:
the readers that attend over the stored values (the Pallas kernel, its reference, the jnp decode and prefill paths)
do that, `unpack_blocks` rotates back for the others (key bounds), and a block's bytes never change in between.
The arrays hold the bytes as uint8 (STORAGE), read as float8 only where attention converts them: XLA:CPU has no
native float8 scatter and rewrote each one-token cache write into a copy of the whole cache (measured: 200 ms per
write into a 390 MB cache, against 0.015 ms for the same write in uint8); readers accept either dtype.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
Granularity = Literal["token", "block"]
KV_DTYPES = ("auto", "float8_e4m3fn")  # EngineConfig.kv_dtype: the model's dtype, or float8 with scales
STORAGE = jnp.dtype(jnp.uint8)  # the float8 cache's array dtype: e4m3 bytes and the scales' bytes
ScaleCode = Literal["bf16", "e5m2", "pow2"]
SCALE_BIAS = 64  # (code="pow2": code b -> 2^(b - 64))
CODE_MIN, CODE_MAX = 1, 126  # (code="pow2": scales 2^-63 .. 2^62)
SCALE_BYTES = 2  # the cache's scales: bfloat16
E5M2_TINY = 2.0 ** -16  # (code="e5m2": its smallest subnormal)


def quantize(x: Float[Array, "... bs H hd"], granularity: Granularity = "token", *, code: ScaleCode | None = None
             ) -> tuple[Float[Array, "... bs H hd"], Float[Array, "... s H 1"]]:
    """(x / scale as float8_e4m3fn, scale float32) with scale = amax / 448 per (token, head) ("token": s = bs) or per
    (block, head) ("block": s = 1); with `code` that scale as a narrower number holds it: "bf16" (rounded to nearest;
    the cache's), or one byte, rounded up: "e5m2" (a float8_e5m2 value) or "pow2" (a power of two)."""
    if granularity not in ("token", "block"):
        raise ValueError(f"granularity={granularity!r}; use 'token' or 'block'")
    if code not in (None, "bf16", "e5m2", "pow2"):
        raise ValueError(f"code={code!r}; use None (float32 scales), 'bf16', 'e5m2' or 'pow2'")
    xf = x.astype(jnp.float32)
    axes = (-1,) if granularity == "token" else (-3, -1)
    amax = jnp.max(jnp.abs(xf), axis=axes, keepdims=True)
    if code == "pow2":
        scale = jnp.ldexp(jnp.float32(1.0), _exponent(amax))
    elif code == "e5m2":  # (rounded up from the smallest subnormal: an all-zero group keeps a nonzero scale)
        scale = round_directed(jnp.maximum(amax / FP8_MAX, E5M2_TINY), jnp.float8_e5m2, down=False)
        scale = scale.astype(jnp.float32)
    elif code == "bf16":
        scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.bfloat16).astype(jnp.float32)
        scale = jnp.maximum(scale, float(jnp.finfo(jnp.bfloat16).tiny))  # (never 0: a denormal amax would divide by it)
    else:
        scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return jnp.clip(xf / scale, -FP8_MAX, FP8_MAX).astype(FP8), scale


def round_directed(x: Float[Array, "..."], dtype: jnp.dtype, *, down: bool) -> Array:
    """x (any float) -> `dtype`, rounded toward -inf (down) or +inf, saturating at the dtype's finite range."""
    dt = jnp.dtype(dtype)
    bits = dt.itemsize * 8
    uint = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits]
    fmax = float(jnp.finfo(dt).max)
    xc = jnp.clip(x.astype(jnp.float32), -fmax, fmax)
    y = xc.astype(dt)  # round to nearest
    yf = y.astype(jnp.float32)
    b = jax.lax.bitcast_convert_type(y, uint)
    sign = jnp.asarray(1 << (bits - 1), uint)
    one = jnp.asarray(1, uint)
    neg, zero = b >= sign, (b & (sign - one)) == 0
    # IEEE-style sign-magnitude: the next value away from zero is bits + 1, toward zero bits - 1; from +-0 the
    # next value down is the smallest negative subnormal (sign | 1), up the smallest positive one (1)
    if down:
        wrong = yf > xc
        nxt = jnp.where(zero, sign | one, jnp.where(neg, b + one, b - one))
    else:
        wrong = yf < xc
        nxt = jnp.where(zero, one, jnp.where(neg, b - one, b + one))
    return jax.lax.bitcast_convert_type(jnp.where(wrong, nxt, b), dt)


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


# ---- the cache's float8 storage: values plus a bfloat16 scale per (token, head) in the block's scale rows ---------
def is_quantized(dtype) -> bool:
    """Whether a cache of `dtype` (its STORAGE bytes, or float8_e4m3fn naming the format) holds float8 values with
    scales."""
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


def scale_rows(block_size: int, head_dim: int) -> int:
    """Rows of head_dim bytes per head that hold a block's bs bfloat16 scales."""
    return -(-SCALE_BYTES * block_size // head_dim)


def block_rows(block_size: int, head_dim: int, dtype) -> int:
    """Token rows of one block's K (and of its V) in storage: bs, plus float8's scale rows."""
    return block_size + scale_rows(block_size, head_dim) if is_quantized(dtype) else block_size


def layer_block_bytes(block_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes of one block of one layer in storage (K and V of every head, scales included)."""
    rows = block_rows(block_size, head_dim, dtype)
    return 2 * rows * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def tokens_per_block(kv: Array) -> int:
    """Tokens a block of `kv` holds: a cache [L, NB, 2, rows, Hkv, hd], a pool [NB, 2, rows, Hkv, hd] or staging."""
    return block_tokens(kv.shape[-3], kv.shape[-1], kv.dtype)


def block_tokens(rows: int, head_dim: int, dtype) -> int:
    """Tokens of a stored block with `rows` rows (float8: the bs with bs + scale_rows(bs, hd) == rows; rows grow
    with bs, so there is one)."""
    if not is_quantized(dtype):
        return rows
    for r in range(1, rows):
        if scale_rows(rows - r, head_dim) == r:
            return rows - r
    raise ValueError(f"{rows} rows of head_dim {head_dim} are no float8 block (bs + ceil(2 bs / hd) rows)")


def scale_position(slot: Int[Array, "..."], byte: int, block_size: int, head_dim: int
                   ) -> tuple[Int[Array, "..."], Int[Array, "..."]]:
    """(row, column) of byte `byte` (0: low, 1: high) of token `slot`'s scale within its head's scale rows."""
    j = SCALE_BYTES * slot + byte
    return block_size + j // head_dim, j % head_dim


def scale_from_bytes(low: Array, high: Array) -> Float[Array, "..."]:
    """A bfloat16 scale's two stored bytes (uint8, or float8 views of them) -> the scale as float32 (exact: bfloat16
    is float32's top half)."""
    lo, hi = (b if b.dtype == STORAGE else jax.lax.bitcast_convert_type(b, STORAGE) for b in (low, high))
    bits = (hi.astype(jnp.int32) << 24) | (lo.astype(jnp.int32) << 16)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


@functools.cache
def hadamard(head_dim: int) -> np.ndarray:
    """The orthonormal, symmetric head_dim x head_dim rotation of the float8 cache: Sylvester's Hadamard matrix over
    the largest power of two p dividing head_dim, repeated along the diagonal (head_dim 64 / 128: one matrix)."""
    p = head_dim & -head_dim
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < p:
        h = np.block([[h, h], [h, -h]])
    out = np.kron(np.eye(head_dim // p, dtype=np.float32), h / np.float32(np.sqrt(p)))
    out.flags.writeable = False  # (cached: shared by every caller)
    return out


def rotate(x: Float[Array, "... hd"]) -> Float[Array, "... hd"]:
    """x H over the last axis, in float32 (H = `hadamard(hd)`, its own inverse: rotate(rotate(x)) == x up to float32
    rounding). Written as a broadcast product summed over hd, in float32: XLA:GPU fuses it with what produces x (the
    query's padding, the merge of the attention's splits, a dequantisation) into one reduction kernel, where a dot
    became a GEMM plus a split-K reduction of its own and the fast transform's log2(hd) stages each wrote the whole
    array (compiled for an H200: key bounds of 2,048 blocks 0.55 GB, against 0.75 and 2.0 GB)."""
    h = jnp.asarray(hadamard(x.shape[-1]))
    return jnp.sum(x.astype(jnp.float32)[..., :, None] * h, axis=-2)


def cache_basis(x: Float[Array, "... hd"], kv_dtype) -> Array:
    """x (queries, or an attention output) in the basis a cache of `kv_dtype` holds K / V in: rotated, in float32, for
    float8; unchanged otherwise. Its own inverse: a reader attending over the stored values moves q into that basis
    and its output back out with it."""
    return rotate(x) if is_quantized(kv_dtype) else x


def round_trip(x: Float[Array, "... H hd"]) -> Float[Array, "... H hd"]:
    """Tokens' K or V as a float8 cache gives them back (`unpack_blocks`): rotated, rounded to e4m3 under a bfloat16
    scale per (token, head), rotated back; float32."""
    values, scale = quantize(rotate(x)[..., None, :, :], "token", code="bf16")
    return rotate(dequantize(values, scale)[..., 0, :, :])


def encode(x: Float[Array, "... H hd"]) -> tuple[Array, Array]:
    """Tokens' K or V -> (e4m3 value bytes [..., H, hd] of the rotated x (`rotate`), scale bytes [..., H, 2] low then
    high), uint8 (STORAGE): per (token, head) bfloat16 scales."""
    values, scale = quantize(rotate(x)[..., None, :, :], "token", code="bf16")  # scale [..., 1, H, 1]
    bits = jax.lax.bitcast_convert_type(scale[..., 0, :, 0].astype(jnp.bfloat16), jnp.uint16).astype(jnp.int32)
    scale_bytes = jnp.stack([bits & 0xFF, bits >> 8], axis=-1).astype(STORAGE)
    return jax.lax.bitcast_convert_type(values[..., 0, :, :], STORAGE), scale_bytes


def pack_blocks(x: Float[Array, "... bs H hd"], dtype) -> Array:
    """Whole blocks of K or V (tokens, heads, features) in storage form [..., rows, H, hd]: cast, or for a float8
    `dtype` (or STORAGE) the value bytes and their scale rows, uint8."""
    if not is_quantized(dtype):
        return x.astype(dtype)
    bs, h, hd = x.shape[-3:]
    r = scale_rows(bs, hd)
    values, scale_bytes = encode(x)  # [..., bs, H, hd], [..., bs, H, 2]
    run = jnp.swapaxes(scale_bytes, -3, -2).reshape(*x.shape[:-3], h, SCALE_BYTES * bs)  # [..., H, 2 bs]
    run = jnp.concatenate([run, jnp.zeros(run.shape[:-1] + (r * hd - SCALE_BYTES * bs,), STORAGE)], axis=-1)
    rows = jnp.swapaxes(run.reshape(*run.shape[:-1], r, hd), -3, -2)  # [..., r, H, hd]
    return jnp.concatenate([values, rows], axis=-3)


def block_scales(blocks: Array) -> Float[Array, "... bs H"]:
    """The float32 scales of stored float8 blocks [..., rows, H, hd], per (token, head)."""
    bs = tokens_per_block(blocks)
    run = jnp.swapaxes(blocks[..., bs:, :, :], -3, -2)  # [..., H, r, hd]
    run = run.reshape(*run.shape[:-2], -1)[..., : SCALE_BYTES * bs]  # [..., H, 2 bs]
    run = run.reshape(*run.shape[:-1], bs, SCALE_BYTES)
    return jnp.swapaxes(scale_from_bytes(run[..., 0], run[..., 1]), -1, -2)


def unpack_blocks(blocks: Array, dtype, *, rotated: bool = False) -> Float[Array, "... bs H hd"]:
    """Stored blocks of K or V [..., rows, H, hd] -> their values in `dtype` (float8: value x scale rotated back; with
    `rotated` left in the stored basis, value x scale exact in float32, for readers that rotate q and the output)."""
    if not is_quantized(blocks.dtype):
        return blocks.astype(dtype)
    bs = tokens_per_block(blocks)
    values = as_float8(blocks[..., :bs, :, :]).astype(jnp.float32) * block_scales(blocks)[..., None]
    return (values if rotated else rotate(values)).astype(dtype)


def write_tokens(kv: Array, li: Int[Array, " B"] | Int[Array, ""], bi: Int[Array, " B"], off: Int[Array, " B"],
                 k: Float[Array, "B Hkv hd"], v: Float[Array, "B Hkv hd"]) -> Array:
    """One new token per row b at slot off[b] of block (li[b], bi[b]) of the cache `kv` [L, NB, 2, rows, Hkv, hd]: K
    and V (float8: values and their scale's two bytes; the block's other tokens are left bit for bit). One scatter
    into the cache viewed as [L * NB * 2 * rows, Hkv * hd] (a bitcast): whole rows, or for float8 every byte the
    tokens write (the value rows' and the scale bytes'), where per-field updates compiled to six scatter kernels."""
    n_l, nb, _, rows, h, hd = kv.shape
    b = k.shape[0]
    li = jnp.broadcast_to(jnp.asarray(li, jnp.int32), (b,))
    first = ((li * nb + bi.astype(jnp.int32))[:, None] * 2 + jnp.arange(2, dtype=jnp.int32)) * rows  # [B, 2] K, V
    flat = kv.reshape(n_l * nb * 2 * rows, h * hd)
    row = first + off.astype(jnp.int32)[:, None]  # [B, 2] the token's row of K and of V
    if not is_quantized(kv.dtype):
        upd = jnp.stack([k, v], axis=1).astype(kv.dtype).reshape(2 * b, h * hd)
        return flat.at[row.reshape(-1)].set(upd).reshape(kv.shape)
    bs = tokens_per_block(kv)
    cast = (lambda a: a) if kv.dtype == STORAGE else as_float8  # (a float8-typed cache)
    values, scale_bytes = encode(jnp.stack([k, v], axis=1))  # [B, 2, Hkv, hd], [B, 2, Hkv, 2]
    cols = jnp.arange(h * hd, dtype=jnp.int32)
    v_rows = jnp.broadcast_to(row[:, :, None], (b, 2, h * hd))
    v_cols = jnp.broadcast_to(cols, (b, 2, h * hd))
    at = [scale_position(off.astype(jnp.int32), byte, bs, hd) for byte in range(SCALE_BYTES)]  # [B] each
    srow, scol = (jnp.stack(x, axis=-1)[:, None, None, :] for x in zip(*at, strict=True))  # [B, 1, 1, 2]
    s_rows = jnp.broadcast_to(first[:, :, None, None] + srow, (b, 2, h, SCALE_BYTES))
    s_cols = jnp.broadcast_to(jnp.arange(h, dtype=jnp.int32)[None, None, :, None] * hd + scol, (b, 2, h, SCALE_BYTES))
    at_rows = jnp.concatenate([v_rows.reshape(-1), s_rows.reshape(-1)])
    at_cols = jnp.concatenate([v_cols.reshape(-1), s_cols.reshape(-1)])
    upd = cast(jnp.concatenate([values.reshape(-1), scale_bytes.reshape(-1)]))
    return flat.at[at_rows, at_cols].set(upd).reshape(kv.shape)
