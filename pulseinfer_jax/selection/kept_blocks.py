"""Scores of the always-kept blocks (sinks, recent window), so that their mass enters SoloHead's softmax.

`select_blocks` keeps the sink and window blocks by position, so their scores never decide whether they are
selected. They still matter to SoloHead's `normalized_sum`: it softmaxes each head's scores over the sequence's
blocks to estimate the share of that head's attention each block holds, and a head whose mass sits in the
window has less left to claim from the middle. Scored on middle blocks only, every head hands out a full vote
(1) among the middle blocks, a head that attends locally as much as one that really reads the middle. Measured
(bench/RESULTS.md): scoring the kept blocks too lowers the KL to dense 3-15% at 512-2,048-token budgets.

The engine scores them from their key bounds like any block: each decoded key joins its block's bounds in the
scoring kernel (`block_scoring.append_and_score`), so the sinks' and the window's rows are current, the partial
last block's over the tokens written so far, the current one included, its slices with no token yet without mass.
Here the same scores straight from keys (`kept_block_scores`: the blocks' bounds taken on the fly, causally, and
scored with the metadata's formula, `BlockScoring`'s beta / per-head / sub-blocks; one Pallas kernel,
`pallas_kernels/kept_scores.py`, beside its jnp reference), for code that holds keys and no metadata: through
`score_kept_from_keys` (over a plain key sequence), `bench/oracle_accuracy.py` and `bench/selection_quality.py`;
and the tests, as the reference the engine's metadata scores must equal.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pulseinfer_jax.kv import quant as kv_quant
from pulseinfer_jax.pallas_kernels.kept_scores import kept_scores, kept_scores_reference
from pulseinfer_jax.parallel import kernels as tp_kernels


def kept_logical(num_blocks: Int[Array, " B"] | np.ndarray, sink: int, window: int, xp=np) -> Int[Array, "B KK"]:
    """Logical indices of each sequence's always-kept blocks, [B, sink + window] int32: slot i < sink holds sink
    block i, slot sink + i window block num_blocks - window + i; -1 where the sequence has no such block or the
    window block is a sink already (short sequences). `xp` = numpy (host side, the engine) or jax.numpy
    (traceable, the benches)."""
    n = xp.asarray(num_blocks).astype(xp.int32)[:, None]
    sinks = xp.arange(sink, dtype=xp.int32)[None, :]
    win = n - window + xp.arange(window, dtype=xp.int32)[None, :]  # always < n
    lo = xp.where(sinks < n, sinks, -1)
    hi = xp.where(win >= sink, win, -1)
    return xp.concatenate([lo, hi], axis=1).astype(xp.int32)


def kept_lens(logical: Int[Array, "B KK"], positions: Int[Array, " B"], block_size: int, xp=jnp) -> Int[Array, "B KK"]:
    """Tokens of each kept logical block visible to the query at `positions` (its own token included): block_size
    for full blocks, fewer for the partial last one, 0 for padding (-1). `xp` as in `kept_logical`."""
    n = xp.clip(xp.asarray(positions)[:, None] + 1 - logical * block_size, 0, block_size)
    return xp.where(logical >= 0, n, 0).astype(xp.int32)


def kept_block_scores(
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
    kernel: bool = True,
    bounds_dtype=None,
) -> Float[Array, "B S KK"]:
    """Scores of the blocks `units` (+ `unit_offset` where >= 0) of a flat pool (their first `lens` tokens; len 0
    or unit -1 = no block -> -inf), in the units of `block_scores(q, meta, ..., per_head, beta, sub_blocks,
    scale)`: the slices' bound scores combined by logsumexp(scale * s) / scale over the slices holding at least one
    token. Returns float32 [B, S, KK] (S = Hq with per_head, else Hkv). With `kernel` (the Pallas backend) one Pallas
    kernel (`pallas_kernels/kept_scores`, per device on its heads under tensor parallelism) for pools with
    power-of-two blocks and heads (float8 blocks included); other shapes and the jnp backend in plain jnp, and so does
    `bounds_dtype` (the bounds stored as the engine's metadata stores them, rounded outward, and read back)."""
    kw = dict(per_head=per_head, beta=beta, sub_blocks=sub_blocks, scale=scale)
    bs, hd = kv_quant.tokens_per_block(pool), pool.shape[4]
    if not kernel or bs & (bs - 1) or hd & (hd - 1) or bounds_dtype is not None:
        return kept_scores_reference(q, pool, units, lens, unit_offset, bounds_dtype=bounds_dtype, **kw)
    return tp_kernels.kept_scores(kept_scores, q, pool, units, lens, unit_offset, **kw)


def with_kept_scores(
    scores: Float[Array, "B S K"], kept: Float[Array, "B S KK"], logical: Int[Array, "B KK"]
) -> Float[Array, "B S K"]:
    """scores[b, :, logical[b, i]] = kept[b, :, i] for every listed (>= 0) logical block; the rest unchanged.

    One select per kept block (sinks + window: a handful) instead of a scatter: a scatter along K made XLA
    transpose the scores to [B, K, S], and the softmax over K that follows became a column reduction that spills
    registers on an H200 at 40 query heads (Qwen3-14B; ptxas, bench/results/h200_compile.json)."""
    cols = jnp.arange(scores.shape[2], dtype=jnp.int32)[None, :]  # [1, K]
    for i in range(logical.shape[1]):
        at = (logical[:, i, None] >= 0) & (cols == logical[:, i, None])  # [B, K]
        scores = jnp.where(at[:, None, :], kept[:, :, i, None].astype(scores.dtype), scores)
    return scores


def score_kept_from_keys(
    scores: Float[Array, "P S K"],
    q: Float[Array, "P Hq hd"],
    keys: Float[Array, "T Hkv hd"],
    positions: Int[Array, " P"],
    *,
    sink: int,
    window: int,
    block_size: int,
    per_head: bool,
    beta: float,
    sub_blocks: int,
    scale: float,
    bounds_dtype=None,
) -> Float[Array, "P S K"]:
    """`scores` with each query's always-kept blocks scored as the engine scores them, for queries at token
    `positions` over one sequence's keys (logical block j = tokens [j * block_size, (j + 1) * block_size)):
    kept_logical + kept_lens + kept_block_scores + with_kept_scores; `bounds_dtype`: the engine's metadata dtype,
    whose rounding its kept blocks' bounds take too (None: exact). For benches that hold plain keys, not a paged
    cache; traceable."""
    t = keys.shape[0]
    nb = -(-t // block_size)
    blocks = jnp.pad(jnp.asarray(keys), ((0, nb * block_size - t), (0, 0), (0, 0))).reshape(nb, block_size,
                                                                                           *keys.shape[1:])
    pool = jnp.stack([blocks, blocks], axis=1)  # [NB, 2, bs, Hkv, hd] (only the K half is read)
    positions = jnp.asarray(positions, jnp.int32)
    logical = kept_logical(positions // block_size + 1, sink, window, xp=jnp)  # logical block = pool block
    kept = kept_block_scores(jnp.asarray(q), pool, logical, kept_lens(logical, positions, block_size),
                             per_head=per_head, beta=beta, sub_blocks=sub_blocks, scale=scale,
                             bounds_dtype=bounds_dtype)
    return with_kept_scores(scores, kept, logical)
