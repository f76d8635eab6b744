"""Exact merge of partial attentions computed over disjoint key sets (plain jnp, runs anywhere).

A partial attention over key set A is the triple (o_A, m_A, l_A):

    m_A = max_{j in A} s_j                      float32, -inf when A is empty
    l_A = sum_{j in A} exp(s_j - m_A)           float32, 0 when A is empty
    o_A = sum_{j in A} exp(s_j - m_A) v_j / l_A any dtype, 0 when A is empty

For disjoint A and B, attention over A u B is recovered exactly (up to rounding of o_A, o_B) by

    m = max(m_A, m_B),  w_X = l_X * exp(m_X - m),  l = w_A + w_B,  o = (w_A o_A + w_B o_B) / l.

Empty partials (m = -inf, l = 0) get weight 0 without forming `-inf - -inf`, and a merge of nothing
but empty partials is again empty (o = 0, m = -inf, l = 0), never NaN. An empty partial's `o` is not
read, so it may hold anything (even NaN).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax.numpy as jnp
from jaxtyping import Array, Float


def merge_stacked_partials(
    o: Float[Array, "P *batch hd"],
    m: Float[Array, " P *batch"],
    l: Float[Array, " P *batch"],  # noqa: E741
    *,
    out_dtype: jnp.dtype | None = None,
    normalized: bool = True,
) -> tuple[Float[Array, "*batch hd"], Float[Array, "*batch"], Float[Array, "*batch"]]:
    """Merge P partials stacked on axis 0 (m/l float32; o normalised, or with `normalized=False` the unnormalised
    sums exp(s - m) v, as a split-K kernel leaves them). Returns (o, m, l) without axis 0.

    Written as elementwise ops over the P partials (P is static and small: split-K splits or a few partials) rather
    than reductions over axis 0: XLA:GPU then fuses the whole merge into one or two kernels, where the reductions'
    intermediates made four."""
    if o.shape[:-1] != m.shape or m.shape != l.shape:
        raise ValueError(f"partials disagree in shape: {o.shape=} (expected m/l shape + [hd]), {m.shape=}, {l.shape=}")
    if o.shape[0] < 1:
        raise ValueError("merge needs at least one partial")
    p = o.shape[0]
    ms = [m[i].astype(jnp.float32) for i in range(p)]
    ls = [l[i].astype(jnp.float32) for i in range(p)]
    m_all = functools.reduce(jnp.maximum, ms)
    m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)  # every partial empty: weights below are all 0
    e = [jnp.where(mi == -jnp.inf, 0.0, jnp.exp(mi - m_safe)) for mi in ms]  # [*batch] each
    w = [li * ei for li, ei in zip(ls, e, strict=True)]
    l_all = functools.reduce(jnp.add, w)
    scale = w if normalized else e  # o_i * w_i (normalised o) = acc_i * e_i (unnormalised)
    # an empty partial's o is not read (it may hold anything, NaN included)
    o_all = functools.reduce(jnp.add, [jnp.where(w_i[..., None] > 0, o[i].astype(jnp.float32) * s_i[..., None], 0.0)
                                       for i, (w_i, s_i) in enumerate(zip(w, scale, strict=True))])
    o_all = o_all / jnp.where(l_all > 0, l_all, 1.0)[..., None]
    return o_all.astype(out_dtype or o.dtype), m_all, l_all


def merge_attention_partials(
    parts: Sequence[tuple[Float[Array, "*batch hd"], Float[Array, "*batch"], Float[Array, "*batch"]]],
) -> tuple[Float[Array, "*batch hd"], Float[Array, "*batch"], Float[Array, "*batch"]]:
    """Merge partial attentions (o, m, l) over disjoint key sets; o keeps the first partial's dtype.

    Typical shapes: o [B, Hq, hd], m and l [B, Hq] float32 (as returned by `sparse_decode_attention`).
    """
    parts = list(parts)
    if not parts:
        raise ValueError("merge_attention_partials needs at least one (o, m, l) partial")
    for i, part in enumerate(parts):
        if len(part) != 3:
            raise ValueError(f"partial {i} has {len(part)} elements; expected (o, m, l)")
        if part[0].shape != parts[0][0].shape or part[1].shape != parts[0][1].shape:
            raise ValueError(f"partial {i} has o {part[0].shape} / m {part[1].shape}; partial 0 has "
                             f"o {parts[0][0].shape} / m {parts[0][1].shape}")
    o = jnp.stack([p[0].astype(jnp.float32) for p in parts])
    m = jnp.stack([p[1] for p in parts])
    l = jnp.stack([p[2] for p in parts])  # noqa: E741
    return merge_stacked_partials(o, m, l, out_dtype=parts[0][0].dtype)
