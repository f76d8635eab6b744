"""Rotary position embeddings (Hugging Face `rotate_half` convention: the two halves of head_dim pair up)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int
from pulseinfer_jax.models.config import ModelConfig


def rope_tables(cfg: ModelConfig, positions: Int[Array, "*batch"]) -> tuple[Array, Array]:
    """cos and sin, float32 [*batch, head_dim // 2], for integer positions (times YaRN's attention factor)."""
    inv_freq = jnp.asarray(cfg.inv_freq().astype(np.float32))  # [head_dim // 2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    scale = cfg.rope_cos_sin_scale
    if scale == 1.0:
        return jnp.cos(angles), jnp.sin(angles)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(
    x: Float[Array, "*batch heads head_dim"],
    cos: Float[Array, "*batch half"],
    sin: Float[Array, "*batch half"],
) -> Float[Array, "*batch heads head_dim"]:
    """Rotate x by the per-position angles; computed in float32 and cast back to x's dtype."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)
