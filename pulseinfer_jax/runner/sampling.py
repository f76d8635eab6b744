"""Sampling parameters and the batched, seeded sampler (greedy, temperature, top-k, top-p).

Each request owns a PRNG key derived from (seed, request index); step n uses fold_in(key, n), so a
request's tokens do not depend on which other requests share its batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@jax.jit
def greedy_sample(logits: Float[Array, "B V"]) -> Int[Array, " B"]:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


@jax.jit
def sample(
    logits: Float[Array, "B V"],
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
    seed: Int[Array, ""],
    request_ids: Int[Array, " B"],
    steps: Int[Array, " B"],
) -> Int[Array, " B"]:
    """Rows with temperature 0 are greedy; others sample from the top-k/top-p filtered distribution.

    Row b draws with key fold_in(fold_in(key(seed), request_ids[b]), steps[b]).
    """
    base = jax.random.key(seed)
    keys = jax.vmap(lambda r, n: jax.random.fold_in(jax.random.fold_in(base, r), n))(request_ids, steps)
    v = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [B, V]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)  # [B, 1]
    sorted_desc = jnp.where(jnp.arange(v)[None] < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = before < top_p[:, None]
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
    pth = jnp.take_along_axis(sorted_desc, (n_keep - 1)[:, None], axis=-1)
    thresh = jnp.maximum(kth, pth)
    filtered = jnp.where(scaled >= thresh, scaled, -jnp.inf)
    drawn = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)
