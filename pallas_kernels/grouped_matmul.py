"""Grouped matmul over row tiles (mixture-of-experts expert matmuls): each tile of rows uses its own group's
weights.

    out[t*T:(t+1)*T] = x[t*T:(t+1)*T] @ W[g_t]      g_t = tile_group[t]; a tile with g_t < 0 is all zeros

Shapes: x [M, K] with M = num_tiles * T; W holds G weight matrices [K, N], either on axis 0 (`expert_axis=0`,
W [G, K, N]: the MoE down projection [E, f, d]) or on axis 1 (`expert_axis=1`, W [K, G, N]: the fused gate/up
projection [d, E, 2f], models/moe.py), so neither layout is ever transposed or copied. The caller sorts its
rows by group and pads every group to a multiple of T (`models/moe.py: grouped_layout`); padding rows and
padding tiles (g_t = -1) cost no weight reads.

Why: a prefill chunk of n tokens routed to k of E experts needs n*k rows of expert matmuls; running every
expert on every token (the "dense" strategy) does E/k times that. Grouping does the n*k rows plus at most one
partial tile per picked expert, and reads each picked expert's weights once per tile.

Kernel (Triton-compatible `pl.pallas_call`, no scalar prefetch): grid (num_tiles, N // bn). Program (t, j)
loads g_t from the `tile_group` vector (an ordinary input whose BlockSpec is the whole vector), and, if
g_t >= 0, accumulates x_tile[:, k0:k0+bk] @ W[g_t][k0:k0+bk, n0:n0+bn] over K in steps of bk (f32
accumulation; HIGHEST precision for f32 operands, no TF32) into its [T, bn] output tile; else it writes
zeros. W is a whole-array ref addressed with the dynamic scalar g_t. Tile sizes are powers of two, >= 16 for
Triton's dots (block sizes shrink to the largest power-of-two divisor of K and N).

`grouped_matmul_reference` is the plain-jnp twin (one `lax.map` step per tile, empty tiles skipped by
`lax.cond`): the oracle of the tests and, since interpret mode is slow, what CPUs run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int
from pulseinfer_jax.pallas_kernels.common import (
    matmul_precision,
    on_platform,
    pow2_divisor,
    resolve_interpret,
    triton_params,
)

MIN_DOT_DIM = 16  # Triton's tensor-core dots want every operand dim >= 16
# float32 operands: at most this many output elements per program, with 8 warps (ptxas for sm_90a, 30B-A3B's expert
# shapes: 128 x 128 tiles spilled 4 KB at 4 warps and 1.5 KB at 8; 128 x 32 at 8 warps used 80 registers, no spill)
F32_TILE_ELEMS = 4096


def _dims(x: Array, w: Array, tile_group: Array, tile_m: int, expert_axis: int) -> tuple[int, int, int, int]:
    """(num_tiles, K, N, G) after checking the shapes; errors say what to pass instead."""
    if tile_m < 1 or tile_m & (tile_m - 1):
        raise ValueError(f"tile_m={tile_m} must be a positive power of two")
    if expert_axis not in (0, 1):
        raise ValueError(f"expert_axis={expert_axis} must be 0 (W [G, K, N]) or 1 (W [K, G, N])")
    if x.ndim != 2 or w.ndim != 3:
        raise ValueError(f"x must be [M, K] and W 3-D, got x {x.shape}, W {w.shape}")
    m, k = x.shape
    g = w.shape[expert_axis]
    wk, n = (w.shape[1], w.shape[2]) if expert_axis == 0 else (w.shape[0], w.shape[2])
    if wk != k:
        raise ValueError(f"x has K={k} columns but W's matrices are [{wk}, {n}] (W {w.shape}, expert_axis "
                         f"{expert_axis})")
    if m % tile_m:
        raise ValueError(f"x has {m} rows, not a multiple of tile_m={tile_m}: pad the groups to whole tiles")
    if tile_group.ndim != 1 or tile_group.shape[0] != m // tile_m or not jnp.issubdtype(tile_group.dtype,
                                                                                           jnp.integer):
        raise ValueError(f"tile_group must be an integer vector of {m // tile_m} entries (one per tile of "
                         f"{tile_m} rows), got shape {tile_group.shape} dtype {tile_group.dtype}")
    if x.dtype != w.dtype:
        raise ValueError(f"x dtype {x.dtype} != W dtype {w.dtype}: cast one (the dots take one operand dtype)")
    return m // tile_m, k, n, g


def _grouped_matmul_kernel(group_ref, x_ref, w_ref, out_ref, *, block_k: int, block_n: int, expert_axis: int,
                           precision: jax.lax.Precision | None):
    # group_ref: [num_tiles] int32 (whole vector); x_ref: [T, K] (tile t); w_ref: W (whole array);
    # out_ref: [T, bn] (tile t, column block j).
    t, j = pl.program_id(0), pl.program_id(1)
    num_groups = w_ref.shape[expert_axis]
    k_total = x_ref.shape[1]
    g = group_ref[t]
    valid = (g >= 0) & (g < num_groups)
    g = jnp.clip(g, 0, num_groups - 1)
    cols = pl.ds(j * block_n, block_n)

    @pl.when(valid)
    def _():
        def step(s, acc):
            rows = pl.ds(s * block_k, block_k)
            xk = x_ref[:, rows]  # [T, bk]
            wk = w_ref[g, rows, cols] if expert_axis == 0 else w_ref[rows, g, cols]  # [bk, bn]
            return acc + jax.lax.dot_general(xk, wk, (((1,), (0,)), ((), ())), precision=precision,
                                             preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, k_total // block_k, step, jnp.zeros(out_ref.shape, jnp.float32))
        out_ref[...] = acc.astype(out_ref.dtype)

    @pl.when(~valid)
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tile_m", "expert_axis", "block_k", "block_n", "num_warps",
                                             "num_stages", "interpret"))
def grouped_matmul(
    x: Float[Array, "M K"],
    w: Float[Array, "G K N"] | Float[Array, "K G N"],
    tile_group: Int[Array, " num_tiles"],
    *,
    tile_m: int,
    expert_axis: int = 0,
    block_k: int = 64,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
    interpret: bool | None = None,
) -> Float[Array, "M N"]:
    """out[tile t] = x[tile t] @ W[tile_group[t]] (zeros where tile_group[t] is outside [0, G)); out in x's
    dtype, accumulated in f32. See the module docstring for the layout contract."""
    num_tiles, k, n, _ = _dims(x, w, tile_group, tile_m, expert_axis)
    wide = jnp.dtype(x.dtype).itemsize >= 4  # IEEE f32 dots hold more registers: ptxas spills past F32_TILE_ELEMS
    if block_n is None:
        block_n = min(128, max(MIN_DOT_DIM, F32_TILE_ELEMS // tile_m)) if wide else 128
    if num_warps is None:
        num_warps = 8 if wide else 4
    bk, bn = pow2_divisor(k, block_k), pow2_divisor(n, block_n)
    if interpret is None and min(tile_m, bk, bn) < MIN_DOT_DIM:  # no GPU kernel: interpret off-GPU, error on one
        interpret = resolve_interpret(None)
    if interpret is False and min(tile_m, bk, bn) < MIN_DOT_DIM:
        raise ValueError(f"the GPU kernel needs tile_m, K's and N's block >= {MIN_DOT_DIM} (got tile_m={tile_m}, "
                         f"block_k={bk} for K={k}, block_n={bn} for N={n}): use a larger tile_m, or the jnp path "
                         "grouped_matmul_reference")
    if num_tiles == 0:
        return jnp.zeros((0, n), x.dtype)
    kernel = functools.partial(_grouped_matmul_kernel, block_k=bk, block_n=bn, expert_axis=expert_axis,
                               precision=matmul_precision(x.dtype))
    return on_platform(lambda interp: pl.pallas_call(
        kernel,
        grid=(num_tiles, n // bn),
        in_specs=[
            pl.BlockSpec((num_tiles,), lambda t, j: (0,)),  # tile_group: whole vector
            pl.BlockSpec((tile_m, k), lambda t, j: (t, 0)),  # x: tile t's rows
            pl.BlockSpec(w.shape, lambda t, j: (0, 0, 0)),  # W: whole array, indexed by g_t inside
        ],
        out_specs=pl.BlockSpec((tile_m, bn), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((num_tiles * tile_m, n), x.dtype),
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interp,
        name=f"grouped_matmul_t{tile_m}",
    )(tile_group.astype(jnp.int32), x, w), interpret)


@functools.partial(jax.jit, static_argnames=("tile_m", "expert_axis"))
def grouped_matmul_reference(
    x: Float[Array, "M K"],
    w: Float[Array, "G K N"] | Float[Array, "K G N"],
    tile_group: Int[Array, " num_tiles"],
    *,
    tile_m: int,
    expert_axis: int = 0,
) -> Float[Array, "M N"]:
    """Plain-jnp twin of `grouped_matmul` (same contract): one `lax.map` step per tile, a tile of group g a
    [T, K] @ [K, N] dot with W[g] sliced in place, tiles outside [0, G) zeros without touching W."""
    num_tiles, k, n, num_groups = _dims(x, w, tile_group, tile_m, expert_axis)
    precision = matmul_precision(x.dtype)

    def one(args: tuple[Array, Array]) -> Array:
        xt, g = args  # [T, K], scalar

        def run() -> Array:
            wg = jax.lax.dynamic_index_in_dim(w, g, axis=expert_axis, keepdims=False)  # [K, N]
            return jnp.dot(xt, wg, precision=precision, preferred_element_type=jnp.float32).astype(x.dtype)

        return jax.lax.cond((g >= 0) & (g < num_groups), run, lambda: jnp.zeros((tile_m, n), x.dtype))

    out = jax.lax.map(one, (x.reshape(num_tiles, tile_m, k), tile_group.astype(jnp.int32)))
    return out.reshape(num_tiles * tile_m, n)
