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
float32; an all-zero group gets scale 1 (its zeros stay zeros; no division by zero, no NaN).
"""

from __future__ import annotations

from typing import Literal

import jax.numpy as jnp
from jaxtyping import Array, Float

FP8 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
Granularity = Literal["token", "block"]


def quantize(x: Float[Array, "... bs H hd"], granularity: Granularity = "token"
             ) -> tuple[Float[Array, "... bs H hd"], Float[Array, "... s H 1"]]:
    """(x / scale as float8_e4m3fn, scale float32) with scale = amax / 448 per (token, head) ("token": s = bs) or per
    (block, head) ("block": s = 1)."""
    if granularity not in ("token", "block"):
        raise ValueError(f"granularity={granularity!r}; use 'token' or 'block'")
    xf = x.astype(jnp.float32)
    axes = (-1,) if granularity == "token" else (-3, -1)
    amax = jnp.max(jnp.abs(xf), axis=axes, keepdims=True)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
    return (xf / scale).astype(FP8), scale


def dequantize(q: Float[Array, "... bs H hd"], scale: Float[Array, "... s H 1"], dtype=jnp.float32
               ) -> Float[Array, "... bs H hd"]:
    """The values `q` x `scale` stand for, in `dtype`."""
    return (q.astype(jnp.float32) * scale).astype(dtype)
