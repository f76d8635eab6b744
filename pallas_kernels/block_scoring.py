"""Quest block scores: an upper bound of q.k over every key of a candidate block, from its min/max metadata.

For a query head q and a block with per-feature key bounds kmin <= k <= kmax (`block_metadata`),

    bound(q, block) = sum_d max(q_d * kmax_d, q_d * kmin_d)  >=  q . k   for every key k in the block.

The score of (sequence b, KV head h, candidate c) sums the bound over the G = Hq / Hkv query heads that
share KV head h, so it upper-bounds the sum over those heads of each head's max q.k inside the block.

Because kmin <= kmax, max(q_d kmax_d, q_d kmin_d) = q+_d kmax_d + q-_d kmin_d with q+ = max(q, 0),
q- = min(q, 0) (exactly, term by term). Summed over the group, the score is therefore the two dot products

    score = (sum_g q+_g) . kmax + (sum_g q-_g) . kmin

so a program first folds its G query rows into two [hd] vectors and then does one multiply-add and one row
reduction over a gathered [TK, hd] tile of each bound: no matmul (so no TF32 and no >= 16 dot-shape rule),
and the metadata, the only large operand, is read once per (sequence, KV head).

`beta` (default 1) weighs the bound's optimism. Writing the bound with the block's key midpoint and half range,
mid = (kmax + kmin) / 2, half = (kmax - kmin) / 2:

    score_beta = sum_d q_d mid_d + beta |q_d| half_d          (beta = 1: the bound above; 0: q . mid)

which is still two dot products, score = a . kmax + c . kmin with a = ((1+beta) q+ + (1-beta) q-) / 2 and
c = ((1-beta) q+ + (1+beta) q-) / 2 (folded the same way; at beta = 1, a = q+ and c = q- exactly). A bound
is an upper estimate of a block's best logit; SoloHead turns scores into estimated attention shares, where
the full range overrates wide blocks (measured: beta 0.5 drops the KL to dense by 25-50%, bench/RESULTS.md, "Accuracy
of sparse decoding against the budget" and bench/notes/accuracy_history.md).

Sub-blocks (`sub_blocks` = m > 1): the metadata then holds the bounds of m equal slices of every block (rows
id * m + j, j < m, as `block_metadata.block_key_bounds(..., sub_blocks=m)` writes them), and a block's score
is the log-sum-exp of its slices' scores at the softmax temperature `scale`, in q.k units:

    score = log(sum_j exp(scale * s_j)) / scale          (s_j: the score above, of slice j)

so softmax(scale * score) over blocks, which SoloHead's normalized_sum takes, is the sum of the slices'
estimated attention shares. Finer bounds estimate a block's mass better (one outlier key no longer widens
the whole block's range) at m times the metadata bytes, while recall and attention keep whole blocks.

Kernel (Triton lowering through `pl.pallas_call`; ids are an ordinary input, no scalar prefetch):
    grid = (B, Hkv, Kp // TK)            Kp = K rounded up to the tile TK (a power of two)
    program (b, h, t):
      q rows   q[b, h*G:(h+1)*G, :]      [G, hd]  (loaded one row at a time, so G needs no padding)
      ids      cand_ids[b, t*TK:+TK]     [TK]     (+ id_offset where >= 0; -1 / out of range -> score -inf, row 0
                                                  read instead)
      per slice j < m:
        gathers  meta_min[ids*m + j, h, :], meta_max[ids*m + j, h, :]   [TK, hd] each (hd contiguous floats)
        work     2*TK*hd multiply-adds + a [TK, hd] -> [TK] reduction (then a running log-sum-exp if m > 1)
      writes   out[b, h, (0 | g), t*TK:+TK]
With `per_head=True` the program writes one [TK] row per query head (G times the arithmetic, same loads):
scores [B, Hq, K] for policies that normalise per query head.

Padding ids and NaN metadata rows: an id < 0 or >= NB is replaced by 0 for the load and its score is
then overwritten with -inf by a select, so whatever row 0 (or any unlisted row) holds cannot leak.
Only rows named by `cand_ids` are ever read.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int
from pulseinfer_jax.pallas_kernels.block_metadata import round_bounds_outward, set_rows, take_rows
from pulseinfer_jax.pallas_kernels.common import next_pow2, on_platform, resolve_interpret, triton_params

from pulseinfer_jax.kv import quant as kv_quant

# Elements of one gathered [TK, hd] bound tile (TK = _TILE_ELEMS // hd candidates per program, 64 at hd = 128), for
# group sums. Per-query-head scores keep G running rows per slice: ptxas (sm_90a, bench/results/h200_compile.json)
# reports 234 registers per thread at TK = 64 and 119 at 32, and a spill at 64 with 2 sub-blocks, so they use half
# the tile, and half again with sub-blocks (a quarter of the registers a block may hold, no spill).
_TILE_ELEMS = 8192
_DOT_ROWS = 16  # a float8 pool's key is rotated back by a bfloat16 dot: Triton dots need >= 16 rows


def _fold(qpos: Array, qneg: Array, beta: float) -> tuple[Array, Array]:
    """(q+, q-) -> the weights (a, c) of kmax and kmin for score_beta (see the module docstring)."""
    if beta == 1.0:
        return qpos, qneg
    return ((1 + beta) * qpos + (1 - beta) * qneg) * 0.5, ((1 - beta) * qpos + (1 + beta) * qneg) * 0.5


def _lse_combine(parts: list[Array], scale: float) -> Array:
    """log(sum_j exp(scale * s_j)) / scale of same-shape slice scores (one part: returned unchanged)."""
    if len(parts) == 1:
        return parts[0]
    top = parts[0]
    for p in parts[1:]:
        top = jnp.maximum(top, p)
    acc = jnp.zeros_like(top)
    for p in parts:
        acc = acc + jnp.exp((p - top) * scale)
    return top + jnp.log(acc) / scale


def _block_scores_kernel(
    q_ref,  # [G, hd]      the query heads of one KV head group, any float dtype
    ids_ref,  # [TK]       int32 physical block ids of this candidate tile (-1 = padding)
    off_ref,  # [1]        added to every id >= 0
    min_ref,  # [NB*m, hd] meta_min[:, h, :] (the whole pool's rows of KV head h, m slices per block)
    max_ref,  # [NB*m, hd] meta_max[:, h, :]
    *rest,  # o_ref [R, TK] (R = 1: group sum, or G: per query head); when appending (`append_and_score`) before
    #         it row_ref / block_ref / slot_ref [1] (sequence b's KeyAppend), unit_ref [1] (the pool's unit offset),
    #         k_ref [U, rows, hd] (the pool's K of head h) and for a float8 pool rot_ref [hd, hd] (its rotation x
    #         sqrt(p)); after it the aliased bounds min_out / max_out [NB*m, hd]
    group: int,
    num_blocks: int,
    per_head: bool,
    beta: float,
    sub: int,
    scale: float,
    append: bool = False,
):
    if append:
        row_ref, block_ref, slot_ref, unit_ref, k_ref, *rot, o_ref, min_out, max_out = rest
    else:
        (o_ref,) = rest
    ids = ids_ref[...]
    ids = jnp.where(ids >= 0, ids + off_ref[0], -1)
    valid = (ids >= 0) & (ids < num_blocks)
    safe = jnp.where(valid, ids, 0) * sub
    qs = [q_ref[g, :].astype(jnp.float32) for g in range(group)]  # static unroll, G <= 16 in practice
    if per_head:
        folds = [_fold(jnp.maximum(qg, 0.0), jnp.minimum(qg, 0.0), beta) for qg in qs]
    else:
        qpos, qneg = jnp.maximum(qs[0], 0.0), jnp.minimum(qs[0], 0.0)
        for qg in qs[1:]:
            qpos, qneg = qpos + jnp.maximum(qg, 0.0), qneg + jnp.minimum(qg, 0.0)
        folds = [_fold(qpos, qneg, beta)]
    if append:  # the new key joins its slice's bounds: every program scores with them, tile 0's stores them
        blk = row_ref[0]
        blk = jnp.where(blk >= 0, blk + off_ref[0], -1)
        live = (blk >= 0) & (blk < num_blocks)
        bs = kv_quant.block_tokens(k_ref.shape[1], k_ref.shape[2], k_ref.dtype)
        slot = slot_ref[0]
        new_slice, fresh = slot // (bs // sub), slot % (bs // sub) == 0
        target = jnp.where(live, blk * sub + new_slice, 0) + jnp.zeros((1,), jnp.int32)  # [1]
        key = _written_key(k_ref, rot[0] if rot else None, block_ref[0], unit_ref[0], slot, bs)  # [1, hd]
        lo = jnp.where(fresh, key, jnp.minimum(min_ref[target].astype(jnp.float32), key))
        hi = jnp.where(fresh, key, jnp.maximum(max_ref[target].astype(jnp.float32), key))
        lo, hi = round_bounds_outward(lo, hi, min_out.dtype)
        mask = jnp.broadcast_to(live & (pl.program_id(2) == 0), lo.shape)
        at = (target[:, None], jnp.arange(lo.shape[1], dtype=jnp.int32)[None, :])  # [1, hd] (index arrays only)
        plt.store(min_out.at[at], lo, mask=mask)
        plt.store(max_out.at[at], hi, mask=mask)
        lo, hi = lo.astype(jnp.float32), hi.astype(jnp.float32)
        in_block = valid & live & (ids == blk)  # [TK]: the candidate that is the key's block
    parts: list[list[Array]] = [[] for _ in folds]
    for j in range(sub):
        kmin = min_ref[safe + j].astype(jnp.float32)  # [TK, hd] gather
        kmax = max_ref[safe + j].astype(jnp.float32)
        if append:  # (tile 0's program may have stored the row already: the same values)
            hit = (in_block & (new_slice == j))[:, None]
            kmin, kmax = jnp.where(hit, lo, kmin), jnp.where(hit, hi, kmax)
        for r, (a, c) in enumerate(folds):
            part = jnp.sum(kmax * a[None, :] + kmin * c[None, :], axis=1)  # [TK]
            if append and j:  # the key's block holds no token past the key's slice yet
                part = jnp.where(in_block & (new_slice < j), -jnp.inf, part)
            parts[r].append(part)
    for r, p in enumerate(parts):
        o_ref[r, :] = jnp.where(valid, _lse_combine(p, scale), -jnp.inf)


def _written_key(k_ref, rot_ref, block: Array, unit_offset: Array, slot: Array, bs: int) -> Array:
    """The key at token `slot` of pool unit `unit_offset + block` (block >= 0), as float32 [1, hd]: a float8 pool's
    e4m3 value x its bfloat16 scale, rotated back (as `kept_scores` reads keys: a [16, hd] tile, its row 0 real, so
    that the rotation's bfloat16 dot has the 16 rows Triton needs; exact products, float32 sums)."""
    hd = k_ref.shape[2]
    quantized = kv_quant.is_quantized(k_ref.dtype)
    rows = _DOT_ROWS if quantized else 1
    real = jnp.arange(rows, dtype=jnp.int32) == 0
    unit = jnp.maximum(block, 0) + unit_offset + jnp.zeros((rows,), jnp.int32)
    at = slot + jnp.zeros((rows,), jnp.int32)
    feat = jnp.arange(hd, dtype=jnp.int32)
    keys = plt.load(k_ref.at[(unit[:, None], at[:, None], feat[None, :])],
                    mask=jnp.broadcast_to(real[:, None], (rows, hd)), other=0)
    if not quantized:
        return keys.astype(jnp.float32)
    scales = kv_quant.scale_from_bytes(*(
        plt.load(k_ref.at[(unit, *kv_quant.scale_position(at, byte, bs, hd))], mask=real, other=0)
        for byte in range(kv_quant.SCALE_BYTES)))  # [rows]
    p = hd & -hd
    vals = kv_quant.as_float8(keys).astype(jnp.bfloat16)
    keys = jax.lax.dot_general(vals, rot_ref[...], (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32) * (scales / np.sqrt(p))[:, None]
    return jnp.sum(jnp.where(real[:, None], keys, 0.0), axis=0)[None, :]


def _block_scores_pallas(
    q: Float[Array, "B Hq hd"],
    meta_min: Float[Array, "NBm Hkv hd"],
    meta_max: Float[Array, "NBm Hkv hd"],
    cand_ids: Int[Array, "B Kp"],
    id_offset: Int[Array, "1"],
    append: KeyAppend | None = None,
    pool: Float[Array, "U 2 rows Hkv hd"] | None = None,
    unit_offset: Int[Array, "1"] | None = None,
    *,
    tile_k: int,
    per_head: bool,
    beta: float,
    sub: int,
    scale: float,
    num_warps: int,
    interpret: bool,
) -> Float[Array, "B Hkv R Kp"] | tuple[Float[Array, "B Hkv R Kp"], Array, Array]:
    b, hq, hd = q.shape
    nr, hkv, _ = meta_min.shape
    g = hq // hkv
    kp = cand_ids.shape[1]
    rows = g if per_head else 1
    q4 = q.reshape(b, hkv, g, hd)
    kernel = functools.partial(_block_scores_kernel, group=g, num_blocks=nr // sub, per_head=per_head, beta=beta,
                               sub=sub, scale=scale, append=append is not None)
    meta_spec = pl.BlockSpec((nr, None, hd), lambda i, h, t: (0, h, 0))
    in_specs = [
        pl.BlockSpec((None, None, g, hd), lambda i, h, t: (i, h, 0, 0)),  # q4 [B, Hkv, G, hd]
        pl.BlockSpec((None, tile_k), lambda i, h, t: (i, t)),  # cand_ids [B, Kp]
        pl.BlockSpec((1,), lambda i, h, t: (0,)),  # id_offset
        meta_spec,  # meta_min [NB, Hkv, hd]
        meta_spec,  # meta_max [NB, Hkv, hd]
    ]
    scores_spec = pl.BlockSpec((None, None, rows, tile_k), lambda i, h, t: (i, h, 0, t))
    scores_shape = jax.ShapeDtypeStruct((b, hkv, rows, kp), jnp.float32)
    name = f"block_scores_{tile_k=}_{per_head=}_{sub=}"  # beta is folded into q: same kernel shape
    common = dict(grid=(b, hkv, kp // tile_k), interpret=interpret,
                  compiler_params=triton_params(num_warps=num_warps, num_stages=1))
    if append is None:
        return pl.pallas_call(kernel, in_specs=in_specs, out_specs=scores_spec, out_shape=scores_shape, name=name,
                              **common)(q4, cand_ids, id_offset, meta_min, meta_max)
    one = pl.BlockSpec((1,), lambda i, h, t: (i,))  # [B] -> sequence i's entry
    u, _, rows_p, _, _ = pool.shape
    quantized = kv_quant.is_quantized(pool.dtype)
    rot = [jnp.asarray(np.round(kv_quant.hadamard(hd) * np.sqrt(hd & -hd)), jnp.bfloat16)] if quantized else []
    return pl.pallas_call(
        kernel,
        in_specs=in_specs + [one, one, one, pl.BlockSpec((1,), lambda i, h, t: (0,)),
                             pl.BlockSpec((u, None, rows_p, None, hd), lambda i, h, t: (0, 0, 0, h, 0))]  # K, head h
        + [pl.BlockSpec((hd, hd), lambda i, h, t: (0, 0))] * quantized,
        out_specs=(scores_spec, meta_spec, meta_spec),
        out_shape=(scores_shape, jax.ShapeDtypeStruct(meta_min.shape, meta_min.dtype),
                   jax.ShapeDtypeStruct(meta_max.shape, meta_max.dtype)),
        input_output_aliases={3: 1, 4: 2},  # the bounds are updated in place
        name=name + "_append",
        **common,
    )(q4, cand_ids, id_offset, meta_min, meta_max, *(x.astype(jnp.int32) for x in (
        append.rows, append.blocks, append.slots)), unit_offset, pool, *rot)


def _check_inputs(q: Array, meta_min: Array, meta_max: Array, cand_ids: Array) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, hd] (one decode token per sequence), got shape {q.shape}")
    if meta_min.ndim != 3 or meta_min.shape != meta_max.shape:
        raise ValueError(f"meta_min {meta_min.shape} and meta_max {meta_max.shape} must both be [NB, Hkv, hd]")
    b, hq, hd = q.shape
    nb, hkv, hd_m = meta_min.shape
    if hd_m != hd:
        raise ValueError(f"head_dim of q ({hd}) must equal the metadata's ({hd_m})")
    if hq % hkv:
        raise ValueError(f"num_q_heads={hq} must be divisible by num_kv_heads={hkv} (metadata axis 1)")
    if cand_ids.ndim != 2 or cand_ids.shape[0] != b:
        raise ValueError(f"cand_ids must be [B, K] with B={b} (q's batch), got shape {cand_ids.shape}")
    if not jnp.issubdtype(cand_ids.dtype, jnp.integer):
        raise ValueError(f"cand_ids must be an integer array of block ids (-1 = padding), got {cand_ids.dtype}")


def _check_options(beta: float, sub_blocks: int, meta_rows: int) -> None:
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta!r} must be in [0, 1] (1 = Quest's upper bound, 0 = the block midpoint)")
    if isinstance(sub_blocks, bool) or not isinstance(sub_blocks, int) or sub_blocks < 1:
        raise ValueError(f"sub_blocks={sub_blocks!r} must be a positive int (metadata slices per block)")
    if meta_rows % sub_blocks:
        raise ValueError(f"the metadata has {meta_rows} rows, not a multiple of sub_blocks={sub_blocks}: write it "
                         "with block_key_bounds(..., sub_blocks=sub_blocks) (sub_blocks rows per block)")


def default_scale(head_dim: int, group: int, per_head: bool) -> float:
    """The softmax temperature of scores in q.k units: 1/sqrt(hd) per query head, 1/(G sqrt(hd)) for group sums
    (a group sum adds G logits). What SoloHead's normalized_sum and the sub-block log-sum-exp use."""
    return 1.0 / ((1 if per_head else group) * head_dim ** 0.5)


@functools.partial(jax.jit, static_argnames=("per_head", "beta", "sub_blocks", "scale", "tile_k", "num_warps",
                                             "interpret"))
def block_scores(
    q: Float[Array, "B Hq hd"],
    meta_min: Float[Array, "NBm Hkv hd"],
    meta_max: Float[Array, "NBm Hkv hd"],
    cand_ids: Int[Array, "B K"],
    id_offset: Int[Array, ""] | None = None,
    *,
    per_head: bool = False,
    beta: float = 1.0,
    sub_blocks: int = 1,
    scale: float | None = None,
    tile_k: int | None = None,
    num_warps: int = 4,
    interpret: bool | None = None,
) -> Float[Array, "B S K"]:
    """Quest scores of the candidate blocks `cand_ids` (physical ids, -1 = padding -> -inf; `id_offset` added to every
    id >= 0 inside the kernel: a layer's rows of a metadata array shared by layers, without a kernel to add it).

    Returns float32 [B, Hkv, K] (group sums; the default) or [B, Hq, K] with `per_head=True` (one bound
    per query head; summing each group's G rows gives the default up to rounding, at sub_blocks = 1).
    Requires meta_min <= meta_max element-wise on the listed rows (true by construction). Scores are raw q.k
    bounds (no 1/sqrt(hd)); `beta` < 1 shrinks the key-range term (module docstring). `sub_blocks` = m reads
    m metadata rows per block (NBm = NB * m) and combines them by a log-sum-exp at temperature `scale`
    (default `default_scale`; unused at m = 1). `tile_k` (a power of two, default 8192 // hd capped at 128, halved
    for per-head scores and again for sub-blocks: see _TILE_ELEMS) is the number of candidates per program; the
    head dim must be a power of two on GPU (Triton loads need power-of-two sizes).
    """
    return _scores(q, meta_min, meta_max, cand_ids, id_offset, None, None, per_head=per_head, beta=beta,
                   sub_blocks=sub_blocks, scale=scale, tile_k=tile_k, num_warps=num_warps, interpret=interpret)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyAppend:
    """Where each sequence's new key sits and whose key bounds it joins (`append_and_score`); made on the host."""

    rows: Int[Array, " B"]  # metadata block row (+ id_offset) of the block the key is written to, -1 = none
    blocks: Int[Array, " B"]  # that block in the pool (+ unit_offset)
    slots: Int[Array, " B"]  # the key's token slot in it (its slice: slot // (bs / m); later slices hold no token)


@functools.partial(jax.jit, static_argnames=("per_head", "beta", "sub_blocks", "scale", "tile_k", "num_warps",
                                             "interpret"))
def append_and_score(
    q: Float[Array, "B Hq hd"],
    meta_min: Float[Array, "NBm Hkv hd"],
    meta_max: Float[Array, "NBm Hkv hd"],
    cand_ids: Int[Array, "B K"],
    id_offset: Int[Array, ""] | None,
    append: KeyAppend,
    pool: Float[Array, "U 2 rows Hkv hd"],
    unit_offset: Int[Array, ""] | int = 0,
    *,
    per_head: bool = False,
    beta: float = 1.0,
    sub_blocks: int = 1,
    scale: float | None = None,
    tile_k: int | None = None,
    num_warps: int = 4,
    interpret: bool | None = None,
) -> tuple[Float[Array, "B S K"], Float[Array, "NBm Hkv hd"], Float[Array, "NBm Hkv hd"]]:
    """Decode's scoring with its key bounds kept current, in the one kernel: sequence b's new key, read where the
    step wrote it (token `append.slots[b]` of block `unit_offset + append.blocks[b]` of the flat `pool`; a float8
    pool's dequantised, as `block_key_bounds` reads keys), joins the bounds of its slice of metadata block
    `append.rows[b]` (+ `id_offset`; -1 = none): element-wise min / max with them, or the key alone where it is the
    slice's first token, rounded outward to the metadata's dtype; then `block_scores` of `cand_ids` with those bounds,
    where the key's block scores only its slices up to the key's (the later ones hold no token yet: no mass, as an
    empty slice in `kept_scores`). Returns (scores, meta_min, meta_max), the bounds updated in place when the caller's
    jit donates them. So a block's bounds are complete when it fills, and the sink and window blocks are scored from
    their rows like any other."""
    _check_pool(q, meta_min, pool, sub_blocks)
    return _scores(q, meta_min, meta_max, cand_ids, id_offset, append, (pool, unit_offset), per_head=per_head,
                   beta=beta, sub_blocks=sub_blocks, scale=scale, tile_k=tile_k, num_warps=num_warps,
                   interpret=interpret)


def _check_pool(q: Array, meta_min: Array, pool: Array, sub_blocks: int) -> None:
    if pool.ndim != 5 or pool.shape[1] != 2 or pool.shape[3:] != meta_min.shape[1:]:
        raise ValueError(f"pool {pool.shape} must be a flat [U, 2, rows, Hkv, hd] cache with the metadata's heads and "
                         f"head_dim {meta_min.shape[1:]}")
    bs = kv_quant.tokens_per_block(pool)
    if bs % sub_blocks or bs & (bs - 1):
        raise ValueError(f"the pool's block size {bs} must be a power of two that sub_blocks={sub_blocks} divides")


def _scores(q, meta_min, meta_max, cand_ids, id_offset, append, source, *, per_head, beta, sub_blocks, scale, tile_k,
            num_warps, interpret):
    """block_scores / append_and_score (`source`: (pool, unit_offset) of the appended keys, None without)."""
    _check_inputs(q, meta_min, meta_max, cand_ids)
    _check_options(beta, sub_blocks, meta_min.shape[0])
    b, hq, hd = q.shape
    if interpret is None and hd & (hd - 1):  # no GPU kernel for this shape: interpret off-GPU, the error on one
        interpret = resolve_interpret(None)
    if scale is None:
        scale = default_scale(hd, hq // meta_min.shape[1], per_head)
    k = cand_ids.shape[1]
    if interpret is False and hd & (hd - 1):
        raise ValueError(f"head_dim={hd} must be a power of two for the Triton lowering; allocate the metadata "
                         "(and pad q) with next_pow2(head_dim) features: zero features add nothing to a score")
    if tile_k is None:
        shrink = (2 if per_head else 1) * (2 if sub_blocks > 1 else 1)
        tile_k = max(16, min(128, _TILE_ELEMS // next_pow2(hd) // shrink))
    if tile_k <= 0 or tile_k & (tile_k - 1):
        raise ValueError(f"tile_k={tile_k} must be a positive power of two (Triton tile sizes)")
    tile_k = min(tile_k, next_pow2(max(k, 1)))
    kp = -(-max(k, 1) // tile_k) * tile_k
    ids = jnp.pad(cand_ids.astype(jnp.int32), ((0, 0), (0, kp - k)), constant_values=-1)
    off = jnp.zeros((1,), jnp.int32) if id_offset is None else jnp.asarray(id_offset, jnp.int32).reshape(1)
    pool, unit_off = source or (None, 0)
    unit_off = jnp.asarray(unit_off, jnp.int32).reshape(1)
    out = on_platform(lambda interp: _block_scores_pallas(
        q, meta_min, meta_max, ids, off, append, pool, unit_off, tile_k=tile_k, per_head=per_head, beta=float(beta),
        sub=sub_blocks, scale=float(scale), num_warps=num_warps, interpret=interp), interpret)  # [B, Hkv, R, Kp]
    if append is None:
        return out.reshape(b, -1, kp)[:, :, :k]
    return out[0].reshape(b, -1, kp)[:, :, :k], out[1], out[2]


def block_scores_reference(
    q: Float[Array, "B Hq hd"],
    meta_min: Float[Array, "NBm Hkv hd"],
    meta_max: Float[Array, "NBm Hkv hd"],
    cand_ids: Int[Array, "B K"],
    id_offset: Int[Array, ""] | None = None,
    *,
    per_head: bool = False,
    beta: float = 1.0,
    sub_blocks: int = 1,
    scale: float | None = None,
) -> Float[Array, "B S K"]:
    """Plain jnp: the literal formulas on gathered rows: sum_g sum_d max(q_d * kmax_d, q_d * kmin_d) at beta = 1,
    else sum_g sum_d q_d mid_d + beta |q_d| half_d; with sub_blocks = m, that score of each of the block's m
    slices (rows id * m + j), combined by logsumexp(scale * s_j) / scale."""
    return _reference(q, meta_min, meta_max, cand_ids, id_offset, None, per_head=per_head, beta=beta,
                      sub_blocks=sub_blocks, scale=scale)


def append_and_score_reference(
    q: Float[Array, "B Hq hd"],
    meta_min: Float[Array, "NBm Hkv hd"],
    meta_max: Float[Array, "NBm Hkv hd"],
    cand_ids: Int[Array, "B K"],
    id_offset: Int[Array, ""] | None,
    append: KeyAppend,
    pool: Float[Array, "U 2 rows Hkv hd"],
    unit_offset: Int[Array, ""] | int = 0,
    *,
    per_head: bool = False,
    beta: float = 1.0,
    sub_blocks: int = 1,
    scale: float | None = None,
) -> tuple[Float[Array, "B S K"], Float[Array, "NBm Hkv hd"], Float[Array, "NBm Hkv hd"]]:
    """Plain jnp, same contract as `append_and_score`: the keys read from the pool (`kv_quant.unpack_blocks`), the
    rows updated by a scatter (`update_bounds`' outward rounding), then `block_scores_reference` with the key's
    block's later slices at -inf."""
    m = sub_blocks
    _check_options(beta, m, meta_min.shape[0])
    _check_pool(q, meta_min, pool, m)
    bs = kv_quant.tokens_per_block(pool)
    slices = append.slots // (bs // m)
    nr = meta_min.shape[0]
    blk = append.rows if id_offset is None else jnp.where(append.rows >= 0, append.rows + id_offset, -1)
    live = (blk >= 0) & (blk < nr // m)
    target = jnp.where(live, blk * m + slices, nr)  # (out of range: dropped)
    now = jnp.where(live, target, 0)
    unit = jnp.maximum(append.blocks, 0) + unit_offset
    k = jnp.take_along_axis(kv_quant.unpack_blocks(pool[unit, 0], jnp.float32), append.slots[:, None, None, None],
                            axis=1)[:, 0]  # [B, Hkv, hd]
    k = jax.lax.optimization_barrier(k)  # one read: XLA:CPU fused it into each consumer and then copied the pool
    start = (append.slots % (bs // m) == 0)[:, None, None]
    lo = jnp.where(start, k, jnp.minimum(take_rows(meta_min, now).astype(jnp.float32), k))
    hi = jnp.where(start, k, jnp.maximum(take_rows(meta_max, now).astype(jnp.float32), k))
    lo, hi = round_bounds_outward(lo, hi, meta_min.dtype)
    meta_min, meta_max = set_rows(meta_min, target, lo), set_rows(meta_max, target, hi)
    ids = cand_ids if id_offset is None else jnp.where(cand_ids >= 0, cand_ids + id_offset, -1)
    in_block = live[:, None] & (ids >= 0) & (ids == blk[:, None])  # [B, K]
    empty = in_block[:, :, None] & (jnp.arange(m) > slices[:, None, None])  # [B, K, m]
    s = _reference(q, meta_min, meta_max, cand_ids, id_offset, empty, per_head=per_head, beta=beta, sub_blocks=m,
                   scale=scale)
    return s, meta_min, meta_max


def _reference(q, meta_min, meta_max, cand_ids, id_offset, empty, *, per_head, beta, sub_blocks, scale):
    """block_scores_reference; `empty` [B, K, m] (None: none) marks slices that score -inf."""
    _check_inputs(q, meta_min, meta_max, cand_ids)
    _check_options(beta, sub_blocks, meta_min.shape[0])
    if id_offset is not None:
        cand_ids = jnp.where(cand_ids >= 0, cand_ids + id_offset, -1)
    b, hq, hd = q.shape
    nr, hkv, _ = meta_min.shape
    g = hq // hkv
    m = sub_blocks
    valid = (cand_ids >= 0) & (cand_ids < nr // m)  # [B, K]
    rows = jnp.where(valid, cand_ids, 0)[:, :, None] * m + jnp.arange(m)  # [B, K, m]
    kmin = take_rows(meta_min, rows).astype(jnp.float32)[:, :, :, :, None]  # [B, K, m, Hkv, 1, hd]
    kmax = take_rows(meta_max, rows).astype(jnp.float32)[:, :, :, :, None]
    q6 = q.astype(jnp.float32).reshape(b, 1, 1, hkv, g, hd)  # [B, 1, 1, Hkv, G, hd]
    if beta == 1.0:
        prod = jnp.maximum(q6 * kmax, q6 * kmin)  # [B, K, m, Hkv, G, hd]
    else:
        prod = q6 * ((kmax + kmin) / 2) + beta * jnp.abs(q6) * ((kmax - kmin) / 2)
    s = jnp.sum(prod, axis=-1)  # [B, K, m, Hkv, G]
    s = s.reshape(b, -1, m, hq) if per_head else jnp.sum(s, axis=-1)  # [B, K, m, S]
    if empty is not None:
        s = jnp.where(empty[..., None], -jnp.inf, s)
    if m > 1:
        t = default_scale(hd, g, per_head) if scale is None else scale
        s = jax.nn.logsumexp(s * t, axis=2) / t
    else:
        s = s[:, :, 0]
    s = jnp.where(valid[:, :, None], s, -jnp.inf)
    return jnp.transpose(s, (0, 2, 1))
