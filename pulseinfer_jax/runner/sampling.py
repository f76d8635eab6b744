"""Sampling parameters per row and the batched, seeded sampler (greedy, temperature, top-k, top-p).

Each request owns a PRNG key derived from (seed, request stream); step n uses fold_in(key, n), so a request's tokens
do not depend on which other requests share its batch. `sample_rows` is traceable: a decode step's program samples
inside itself (only token ids leave the device); `sample_tokens` is the same as a program of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, UInt

from pulseinfer_jax.request import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling of one batch, in the rows' order (padding rows greedy): row b draws with key
    fold_in(fold_in(key(seed), streams[b]), steps[b])."""

    temperature: Float[Array, " B"]  # 0: greedy
    top_k: Int[Array, " B"]  # 0: off
    top_p: Float[Array, " B"]
    streams: Int[Array, " B"]  # each request's random stream
    steps: Int[Array, " B"]  # tokens it has produced so far
    seed: UInt[Array, ""]

    @staticmethod
    def of(params: Sequence[SamplingParams], streams: Sequence[int], steps: Sequence[int], seed: int,
           at: Sequence[int] | None = None, rows: int | None = None) -> SamplingRows | None:
        """The rows of `params` (with their streams and steps) placed at rows `at` (default 0, 1, ...) of a batch of
        `rows` (default len(params)); the other rows are greedy padding. None where every row is greedy: the
        programs then take the argmax alone."""
        if all(p.greedy for p in params):
            return None
        at = np.arange(len(params)) if at is None else np.asarray(at, np.int64)
        n = len(params) if rows is None else rows
        temp, top_p = np.zeros(n, np.float32), np.ones(n, np.float32)
        top_k, ids, st = (np.zeros(n, np.int32) for _ in range(3))
        temp[at] = [p.temperature for p in params]
        top_k[at] = [p.top_k for p in params]
        top_p[at] = [p.top_p for p in params]
        ids[at], st[at] = streams, steps
        return SamplingRows(temp, top_k, top_p, ids, st, np.uint32(seed))


@dataclasses.dataclass(frozen=True)
class BatchSampling:
    """A batch's sampling on the host, one entry per request in the batch's order: placed into a step's rows with
    `rows`."""

    params: tuple[SamplingParams, ...]
    streams: tuple[int, ...]
    steps: tuple[int, ...]
    seed: int

    def rows(self, at: Sequence[int], n: int) -> SamplingRows | None:
        """Request i at row at[i] of an `n`-row step (the other rows greedy padding); None: every row greedy."""
        return SamplingRows.of(self.params, self.streams, self.steps, self.seed, at, n)


def sample_rows(logits: Float[Array, "B V"], rows: SamplingRows | None) -> Int[Array, " B"]:
    """Token ids of `logits` under `rows` (None: greedy for all); traceable inside a step's program."""
    if rows is None:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return _sample(logits, rows.temperature, rows.top_k, rows.top_p, rows.seed, rows.streams, rows.steps)


@jax.jit
def sample_tokens(logits: Float[Array, "B V"], rows: SamplingRows | None) -> Int[Array, " B"]:
    """`sample_rows` as a program of its own (prefill's first token, dense steps, the same-layer sparse step)."""
    return sample_rows(logits, rows)


def _sample(logits: Float[Array, "B V"], temperature: Float[Array, " B"], top_k: Int[Array, " B"],
            top_p: Float[Array, " B"], seed: UInt[Array, ""], request_ids: Int[Array, " B"],
            steps: Int[Array, " B"]) -> Int[Array, " B"]:
    """Rows with temperature 0 are greedy; the others draw from their top-k / top-p filtered distribution."""
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
