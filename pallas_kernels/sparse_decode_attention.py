"""Sparse paged decode attention: one query token per sequence over an explicit list of KV blocks.

    sparse_decode_attention(q, pool, block_ids, block_lens) -> (o, m, l)

q [B, Hq, hd] attends (GQA, Hq = G * Hkv) to the tokens of the blocks listed in `block_ids`
[B, S, K] of one layer's pool [NB, 2, rows, Hkv, hd] (see pulseinfer_jax/kv/cache.py; rows = bs, or
bs + r for a float8 pool, below). S == 1 is SoloHead (one list per sequence, shared by every KV
head); S == Hkv is headwise selection (one list per (sequence, KV head)). Entry k covers slots
0 .. block_lens[..., k] - 1 of its block; ids < 0 are padding and are never read. The result is the
partial attention (o, m, l) over exactly those tokens (see merge.py), so attention over a union of
disjoint lists equals `merge_attention_partials` of the parts, and listing every block of a sequence
in order (last one partial) is dense decode attention.

Kernel design (Triton lowering of `pl.pallas_call`)
---------------------------------------------------
grid = (B, Hkv, split_k); program (b, h, s) handles sequence b, KV head h, split s, and loads:
  * q_ref    [G, hd]       the G query heads of KV head h (q reshaped, no copy), loaded as Gp =
                           max(16, next_pow2(G)) rows (Triton dots need every dim >= 16), the rows past G
                           masked to zero; they compute garbage-free zeros, sliced off by the wrapper.
  * k_ref    [NB, bs, hd]  K of every pool block for head h: the BlockSpec squeezes the K|V and head
  * v_ref    [NB, bs, hd]  axes (block index 0 / 1 and h), so no copy; the pool is passed twice.
  * ids_ref  [Ks]          split s of list row (b, h) (headwise) or (b, 0) (SoloHead);
  * lens_ref [Ks]          Ks = steps_per_split * blocks_per_step (the wrapper pads with -1 / 0).
and writes this split's unnormalised accumulator [G, hd] f32 plus running max m and sum l [G] (the G real rows:
masked stores), or with one split the normalised attention itself in the output dtype (no merge after the kernel).
It walks its Ks entries `blocks_per_step` (P) blocks, i.e. T = P * bs tokens, at a time (static
trip count). Per step, for every token t of the step it gathers the entry's id and length from
ids_ref / lens_ref (T int32 loads, P distinct addresses), then K and V tiles [T, hd] with ONE
masked load each whose pointers come from the loaded ids
(`k_ref.at[id_t[:, None], slot_t[:, None], feat[None, :]]`; every index an integer array, so the
same indexer also runs in interpret mode; hd contiguous elements per token), mask = id >= 0 and
slot < len, other = 0. Masked slots are never fetched (padding entries, the unwritten tail of a
partial block, stale or NaN data). Then one online-softmax step: s = dot(q, K^T) * scale (f32
accumulation; IEEE f32 for f32 pools, never TF32), masked to -inf, p = exp(s - m_new),
acc = acc * alpha + dot(p, V). A fully masked step or split leaves m = -inf and l = 0 without NaN
(the exponent offset is 0 while m is -inf). With one split (the grid already holds B * Hkv >= TARGET_PROGRAMS
programs) the kernel divides by l itself. With several the splits are merged inside the kernel (`merge="inside"`,
the default; `_merge_last`): each program stores its partial into a [split_k, B, Hkv, G(, hd)] scratch output, a
block barrier orders every thread's stores before one atomic add (acquire-release, GPU scope) on the (b, h) arrival
counter, and the program that counts last reads every split's partial (volatile loads: not L1), merges them as
merge.py does and stores the normalised attention, then sets the counter back to 0. No program waits on another, so
the grid's order and occupancy do not matter, and the call is one kernel (`program_order` permutes which program
computes which (b, h, s): interpret mode runs programs in launch order, so tests permute it to make other splits arrive
last). The counters ([N] int32, N >= B * Hkv, all 0) come from the caller (`arrivals`: the sparse decoder keeps one
buffer and donates it from call to call) or from one memset per call. `merge="after"` keeps the partials and merges
them with `merge_stacked_partials` in XLA (two more kernels). The engine's start-up probe (`backends.probe_pallas`)
runs a four-split merge on the GPU against the jnp reference before the kernel is used; bench/merge_stress.py races
many splits, sequences and heads on reused counters.

float8 pools (`kv_quant`: e4m3 bytes stored as uint8, rows = bs + r) hold each token's K and V as float8
values in rows 0..bs-1 (loaded as bytes, viewed as e4m3 by a free bitcast) and, in the r scale rows after
them, one bfloat16 scale per (token, head) as two bytes (`kv_quant.scale_position`). The kernel loads the
float8 [T, hd] tiles as above and converts them to the compute dtype (exact: e4m3 fits bfloat16 and float32),
and per token the two scale bytes of K and of V (one masked [T] load each), joined into float32 scales by
integer shifts and a bitcast (`kv_quant.scale_from_bytes`: all of which Triton lowers). The scales are folded
into the [Gp, T] scores and probabilities instead of the [T, hd] tiles: s = dot(q, K8^T) * scale * kscale[t],
and the second dot takes p * vscale[t] (l sums the unscaled p): hd times fewer multiplies than dequantising
the tiles, each in float32. The compute dtype is q's (float32 queries) or bfloat16 (other queries: float16
lacks the scales' exponent range), and q is cast to it, not to float8. The stored values are in the cache's
rotated basis (`kv_quant.rotate`, a Hadamard matrix per head). Under bfloat16 compute each program rotates its q
rows (`_rotate`: [Gp, hd] x [hd, hd] bfloat16 dots with the +-1 matrix) and its accumulator back at the end (the split
merge is linear, so it merges rotated-back accumulators unchanged): no rotation kernel runs outside. Under float32
compute the wrapper rotates q (fused with its padding) and the merged output (fused with the merge). The scores are
unchanged by the rotation.

Defaults: P gives about 64 tokens per step (P >= 16 / bs, P <= next_pow2(K)); split_k aims for
about 256 programs (B * Hkv * split_k) with at least 2 steps per split, at most 16 splits;
num_warps 4, or 8 for 64 x 128 tiles; num_stages 2 (1 for a float8 pool under float32 queries: with
two stages ptxas spills ~400 bytes of registers there, compiled for sm_90a; one stage spills none).

Triton constraints, and how they are met:
  * no scalar prefetch: block tables are ordinary inputs loaded inside the kernel;
  * every loaded / stored tensor is a power of two in size: Gp, hd, bs and P are powers of two
    (checked), the pool's NB and Ks are never loaded whole, only indexed; no reshapes in the body;
  * dot operands >= 16 in every dim: Gp >= 16, hd >= 16, T = P * bs >= 16 (P is raised to fit);
  * both dot operands share a dtype: q is cast to the pool dtype (float8 pools: the compute dtype, and
    the tiles are converted to it); p is cast to V's dtype for the second dot (as in jax's
    paged_attention), accumulation is f32;
  * compiler params are explicit (`triton_params(num_warps, num_stages)`).

Assumptions: hd and bs are powers of two, hd >= 16; ids < NB (not
checked on device: an id >= NB reads out of bounds); block_lens in [0, bs]; q is cast to the pool's
dtype, or the compute dtype for float8 (o comes back in q.dtype). With S == 1 the Hkv programs of
one (sequence, split) read different heads of the same blocks, each only its own head's [bs, hd]
strided tile: every K/V byte is read once, but a block's bytes are spread over Hkv programs (one
program per block for all heads would be the next step if profiles show short-burst reads).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int
from pulseinfer_jax.pallas_kernels.common import (
    SHARED_MEMORY_PER_BLOCK,
    matmul_precision,
    next_pow2,
    on_platform,
    tile,
    traced_zero,
    triton_params,
)
from pulseinfer_jax.pallas_kernels.merge import merge_stacked_partials

from pulseinfer_jax.kv import quant as kv_quant

MIN_DOT_DIM = 16  # Triton's tensor-core dots want every operand dim >= 16
TOKENS_PER_STEP = 64  # default tokens gathered per online-softmax step (P = TOKENS_PER_STEP // bs)
TARGET_PROGRAMS = 256  # auto split-K aims for about two waves of programs on a 132-SM H100/H200
MAX_SPLIT_K = 16
UNROLLED_MERGE = 4  # the merge inside joins up to this many splits unrolled, more in a loop (register spills otherwise)
MIN_STEPS_PER_SPLIT = 2
# Triton stages a step's K and V tiles in shared memory: measured for sm_90a (ptxas via the compile-only H200,
# bench/results/h200_compile.json) 1.08-1.2x the two [P * bs, hd] tiles' bytes; over SHARED_MEMORY_PER_BLOCK the
# compiler rejects the kernel (bf16, bs 16, hd 128: P = 16 needs 143,360 bytes, P = 32 282,624)
SHARED_BYTES_PER_TILE_BYTE = 1.2


# --------------------------------------------------------------------------------------------------
# 1. kernel body
# --------------------------------------------------------------------------------------------------
def _dot_f32(a: Array, b: Array, *, trans_b: bool, precision: jax.lax.Precision | None) -> Array:
    """2-D matmul with f32 accumulation: a [M, K] @ b [K, N] (or b [N, K] with trans_b).

    Plain `lax.dot_general` (what the deprecated `pl.dot` expanded to), which the Triton lowering maps
    onto `tt.dot`; HIGHEST precision lowers to IEEE f32 (no TF32).
    """
    contract_b = 1 if trans_b else 0
    return jax.lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _rotate(x: Array, signs: Array, parts: int) -> Array:
    """x [M, hd] (float32) times the cache's orthonormal rotation H = signs / sqrt(hd) (`kv_quant.hadamard`; signs
    [hd, hd] bfloat16 +-1) in float32: x split into `parts` bfloat16 terms (1 holds a bfloat16 x exactly, 3 a float32
    x to float32's precision), each dotted with the signs on the tensor cores (exact products, float32 sums). A
    float32 [hd, hd] operand spills registers (ptxas, sm_90a); these stay in bfloat16."""
    hd = x.shape[-1]
    out, rest = None, x
    for _ in range(parts):
        term = rest.astype(jnp.bfloat16)
        dot = _dot_f32(term, signs, trans_b=False, precision=None)
        out = dot if out is None else out + dot
        rest = rest - term.astype(jnp.float32)
    return out * (hd ** -0.5)


def _sparse_decode_kernel(
    q_ref,  # [G, hd]      query group of (b, h) (loaded as Gp rows, those >= G zero)
    k_ref,  # [NB, rows, hd] K of head h for every pool block (rows = bs, or bs + float8's scale rows)
    v_ref,  # [NB, rows, hd] V of head h for every pool block
    ids_ref,  # [Ks] int32 this split's block ids, < 0 = padding
    lens_ref,  # [Ks] int32 valid tokens of each entry
    *refs,  # (`rotating`: h_ref [hd, hd] bf16 +-1, the cache's rotation x sqrt(hd)) (`merging`: the arrival counters
    # [N] int32, aliased to the last output) then acc_ref, m_ref, l_ref (`merging`: then the split partials
    # acc_p [splits, G, hd], m_p / l_p [splits, G] f32 of (b, h), and the counters again)
    # outputs: acc_ref [G, hd] f32 unnormalised sum_j exp(s_j - m) v_j (float8: rotated back; `normalize`: divided
    # by l, in the output dtype), m_ref [G] f32 max scaled score (-inf if nothing attended), l_ref [G] f32
    # sum_j exp(s_j - m) (0 if nothing attended)
    scale: float,
    blocks_per_step: int,
    gp: int,
    cdt: jnp.dtype,
    precision: jax.lax.Precision | None,
    normalize: bool,
    rotating: bool,
    merging: bool,
    barrier: bool,
    grid: tuple[int, int, int],
    order: tuple[int, int] | None,
):
    g, hd = q_ref.shape
    refs = list(refs)
    h_ref = refs.pop(0) if rotating else None  # float8 pools under bfloat16 compute rotate here (`_rotates_inside`)
    if merging:
        refs.pop(0)  # the counters' input (aliased: read and written through the last output)
        acc_ref, m_ref, l_ref, acc_p, m_p, l_p, arrivals = refs
    else:
        acc_ref, m_ref, l_ref = refs
    quantized = kv_quant.is_quantized(k_ref.dtype)
    bs = kv_quant.block_tokens(k_ref.shape[1], hd, k_ref.dtype)  # (float8: rows past bs hold the scales)
    num_steps = ids_ref.shape[0] // blocks_per_step
    zero = traced_zero()  # (the start of the padded tiles' slices)
    tokens = blocks_per_step * bs
    if g == gp:
        q = q_ref[...]  # [Gp, hd]
    else:  # (the dots need >= 16 rows: the padding rows are masked loads, not a padded copy of q)
        q = plt.load(q_ref.at[tile(gp, zero)], mask=jnp.broadcast_to((jnp.arange(gp) < g)[:, None], (gp, hd)),
                     other=0)
    if rotating:  # into the cache's rotated basis (q H, float32), once per program
        q = _rotate(q.astype(jnp.float32), h_ref[...], 1 if q_ref.dtype == jnp.bfloat16 else 2)
    q = q.astype(cdt)
    tok = jnp.arange(tokens, dtype=jnp.int32)  # [T] token index within a step
    tok_entry = tok // bs  # [T] which of the step's P entries the token belongs to
    tok_slot = tok % bs  # [T] its slot in that block
    feat = jnp.arange(hd, dtype=jnp.int32)  # [hd]

    def step(j, carry):
        acc, m_prev, l_prev = carry  # [Gp, hd], [Gp], [Gp]
        entry = j * blocks_per_step + tok_entry  # [T]
        ids = ids_ref[entry]  # [T] block id per token (P distinct loads, L1-served repeats)
        lens = lens_ref[entry]  # [T]
        valid = (ids >= 0) & (tok_slot < lens)  # [T]; padding and unwritten slots are masked
        safe_ids = jnp.maximum(ids, 0)  # address arithmetic only: masked lanes are not fetched
        index = (safe_ids[:, None], tok_slot[:, None], feat[None, :])  # -> [T, hd] pointers
        mask = jnp.broadcast_to(valid[:, None], (tokens, hd))
        k = plt.load(k_ref.at[index], mask=mask, other=0)  # [T, hd]
        v = plt.load(v_ref.at[index], mask=mask, other=0)  # [T, hd]
        if quantized:  # stored bytes -> their e4m3 values (a free bitcast), then exactly into the compute dtype
            k, v = kv_quant.as_float8(k), kv_quant.as_float8(v)
        k, v = k.astype(cdt), v.astype(cdt)

        s = _dot_f32(q, k, trans_b=True, precision=precision) * scale  # [Gp, T] f32
        if quantized:  # each token's bfloat16 scale: two bytes of its head's scale rows (masked lanes: scale 0)
            kscale, vscale = (kv_quant.scale_from_bytes(*(
                plt.load(ref.at[(safe_ids, *kv_quant.scale_position(tok_slot, byte, bs, hd))], mask=valid, other=0)
                for byte in range(kv_quant.SCALE_BYTES))) for ref in (k_ref, v_ref))  # [T] f32 each
            s = s * kscale[None, :]  # K's scales weigh the scores, not the [T, hd] tile
        s = jnp.where(valid[None, :], s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))  # [Gp]
        m_off = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # keeps exp() away from -inf - -inf
        alpha = jnp.exp(m_prev - m_off)  # [Gp]; 0 while nothing was attended
        p = jnp.exp(s - m_off[:, None])  # [Gp, T]; masked tokens give exactly 0
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        pw = p * vscale[None, :] if quantized else p  # V's scales weigh the probabilities, not the [T, hd] tile
        pv = _dot_f32(pw.astype(v.dtype), v, trans_b=False, precision=precision)  # [Gp, hd] f32
        return acc * alpha[:, None] + pv, m_next, l_next

    init = (
        jnp.zeros((gp, hd), jnp.float32),
        jnp.full((gp,), -jnp.inf, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
    )
    acc, m, l = jax.lax.fori_loop(0, num_steps, step, init)  # noqa: E741
    if rotating:  # back from the rotated basis (H is its own inverse); linear, so the split merge is unchanged
        acc = _rotate(acc, h_ref[...], 3)
    real = jnp.arange(gp) < g  # the G real query rows (stores of Gp rows are masked to them, as q was loaded)
    if merging:  # this split's partial, then the last split of (b, h) to arrive merges them all
        b, h, s = _logical_program(pl.program_id(0), pl.program_id(1), pl.program_id(2), grid, order)
        _store_rows(acc_p, m_p, l_p, acc, m, l, real, zero, lead=(s,))
        _merge_last(acc_p, m_p, l_p, arrivals, acc_ref, m_ref, l_ref, real, zero, program=(b, h), barrier=barrier)
        return
    if normalize:  # one split: the attention itself (no merge after the kernel), 0 where nothing was attended
        acc = jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    _store_rows(acc_ref, m_ref, l_ref, acc.astype(acc_ref.dtype), m, l, real, zero)


def _store_rows(acc_ref, m_ref, l_ref, acc: Array, m: Array, l: Array, real: Array, zero: Array,  # noqa: E741
                lead: tuple = ()) -> None:
    """Store [Gp, hd] / [Gp] values into the [G, hd] / [G] refs (after the `lead` indices): only the real rows
    (masked stores when G < Gp). One indexer per access (the Triton lowering takes no chained `.at`)."""
    gp, hd = acc.shape
    if not lead and acc_ref.shape[0] == gp:
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
        return
    plt.store(acc_ref.at[(*lead, tile(gp, zero))], acc, mask=jnp.broadcast_to(real[:, None], (gp, hd)))
    plt.store(m_ref.at[(*lead, tile(gp, zero))], m, mask=real)
    plt.store(l_ref.at[(*lead, tile(gp, zero))], l, mask=real)


def _logical_program(i, h, s, grid: tuple[int, int, int], order: tuple[int, int] | None) -> tuple:
    """The (sequence, KV head, split) that launched program (i, h, s) of `grid` = (B, Hkv, split_k) computes: itself,
    or with `order` = (stride, offset) the one numbered (stride * n + offset) mod N in row-major order, n being
    (i, h, s)'s number (`sparse_decode_attention`'s `program_order`; index maps and the kernel body share it)."""
    if order is None:
        return i, h, s
    _, hkv, splits = grid
    stride, offset = order
    n = (stride * ((i * hkv + h) * splits + s) + offset) % math.prod(grid)
    return n // (hkv * splits), n // splits % hkv, n % splits


def _arrived_last(arrivals, counter, splits: int, *, barrier: bool) -> Array:
    """Count this program in its arrival counter (`arrivals[counter]`, an atomic add, acquire-release at GPU scope,
    after a block barrier so that every thread's stores precede it): whether it is the last of `splits` to arrive."""
    if barrier:  # (interpret mode runs the programs one after another: nothing to order)
        plt.debug_barrier()
    arrived = plt.atomic_add(arrivals, (counter,), jnp.ones((1,), jnp.int32))[0]
    return arrived == splits - 1


def _merge_last(acc_p, m_p, l_p, arrivals, o_ref, m_ref, l_ref, real: Array, zero: Array, *, program: tuple,
                barrier: bool) -> None:
    """The split-K merge inside the kernel: each program of (b, h) = `program` has stored its partial; it counts
    itself in (b, h)'s arrival counter (`_arrived_last`), and the last to arrive reads every split's partial, merges
    them (merge.py's rule, online: weights exp(m_i - m), l = sum l_i exp(m_i - m)), stores the normalised attention
    and sets the counter back to 0 for the next call. No program waits on another, so any grid order and occupancy
    is safe: the last to arrive need not be the last split, nor the last program in the grid."""
    splits, gp, hd = acc_p.shape[0], real.shape[0], acc_p.shape[-1]
    (b, h), hkv = program, pl.num_programs(1)
    counter = pl.ds(b * hkv + h, 1)

    @pl.when(_arrived_last(arrivals, counter, splits, barrier=barrier))
    def _merge():
        rows = jnp.broadcast_to(real[None, :, None], (1, gp, hd))

        def join(i, carry):  # one split at a time, rescaled online
            m_run, l_run, acc = carry
            at = (pl.ds(i, 1), tile(gp, zero))  # volatile loads: the other programs' stores, never a stale L1 line
            m_i = plt.load(m_p.at[at], mask=real[None, :], other=-jnp.inf, volatile=True)[0]
            l_i = plt.load(l_p.at[at], mask=real[None, :], other=0.0, volatile=True)[0]
            a_i = plt.load(acc_p.at[at], mask=rows & (l_i > 0)[None, :, None], other=0.0, volatile=True)[0]
            m_new = jnp.maximum(m_run, m_i)
            m_off = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # exp(-inf - m_off) = 0: empty splits weigh nothing
            w_run, w_i = jnp.exp(m_run - m_off), jnp.exp(m_i - m_off)
            return m_new, l_run * w_run + l_i * w_i, acc * w_run[:, None] + a_i * w_i[:, None]

        init = (jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32), jnp.zeros((gp, hd), jnp.float32))
        if splits <= UNROLLED_MERGE:  # (ptxas, sm_90a: a loop spills under float32 tiles, 16 unrolled splits spill)
            carry = init
            for i in range(splits):
                carry = join(i, carry)
            m_all, l_all, acc = carry
        else:
            m_all, l_all, acc = jax.lax.fori_loop(0, splits, join, init)
        o = jnp.where(l_all[:, None] > 0, acc / jnp.where(l_all > 0, l_all, 1.0)[:, None], 0.0)
        _store_rows(o_ref, m_ref, l_ref, o.astype(o_ref.dtype), m_all, l_all, real, zero)
        arrivals[counter] = jnp.zeros((1,), jnp.int32)


# --------------------------------------------------------------------------------------------------
# 2. pallas_call wrapper
# --------------------------------------------------------------------------------------------------
def _sparse_decode_call(
    q_grouped: Float[Array, "B Hkv G hd"],
    pool: Float[Array, "NB 2 rows Hkv hd"],
    block_ids: Int[Array, "B S Kp"],
    block_lens: Int[Array, "B S Kp"],
    arrivals: Int[Array, " N"] | None = None,
    *,
    scale: float,
    split_k: int,
    blocks_per_step: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    out_dtype: jnp.dtype | None = None,
    program_order: tuple[int, int] | None = None,
) -> tuple[Array, ...]:
    """Run the kernel on grid (B, Hkv, split_k) (`program_order`: which program computes what, see
    `sparse_decode_attention`). Returns per-split (acc, m, l) [split_k, B, Hkv, G(, hd)], acc
    unnormalised; with `out_dtype` (split_k 1) the normalised attention in that dtype. With `arrivals` (several
    splits: N >= B * Hkv int32 counters, all 0) the kernel merges the splits itself (`_merge_last`) and returns
    (o [B, Hkv, G, hd] normalised in `out_dtype`, m, l, arrivals (0 again)). The dots run in `_compute_dtype`; a
    float8 pool's kernel rotates q into the cache's basis and acc back (`kv_quant.hadamard`)."""
    b, hkv, g, hd = q_grouped.shape
    rotating = _rotates_inside(q_grouped.dtype, pool.dtype)
    merging = arrivals is not None
    gp = max(MIN_DOT_DIM, next_pow2(g))
    nb, _, rows, _, _ = pool.shape
    bs = kv_quant.tokens_per_block(pool)
    s_rows, kp = block_ids.shape[1], block_ids.shape[2]
    ks = kp // split_k  # entries per split

    grid = (b, hkv, split_k)
    _check_program_order(program_order, grid)

    def at(index_map):  # index maps of the logical (sequence, KV head, split) a launched program computes
        return lambda i, h, s: index_map(*_logical_program(i, h, s, grid, program_order))

    if s_rows == hkv:
        list_map = lambda i, h, s: (i, h, s)  # noqa: E731  headwise: own list per KV head
    else:
        list_map = lambda i, h, s: (i, 0, s)  # noqa: E731  SoloHead: every head reads row 0

    if out_dtype is not None and split_k != 1 and not merging:
        raise ValueError(f"a normalised output needs one split or the merge inside, got {split_k=}")
    if merging and out_dtype is None:
        raise ValueError("the merge inside stores the normalised attention: give its out_dtype")
    if merging and (split_k == 1 or arrivals.shape[0] < b * hkv):
        raise ValueError(f"the merge inside needs several splits and B * Hkv = {b * hkv} arrival counters; got "
                         f"{split_k=}, {arrivals.shape[0]} counters")
    kernel = functools.partial(
        _sparse_decode_kernel,
        scale=scale,
        blocks_per_step=blocks_per_step,
        gp=gp,
        cdt=_compute_dtype(q_grouped.dtype, pool.dtype),
        precision=matmul_precision(_compute_dtype(q_grouped.dtype, pool.dtype)),
        normalize=out_dtype is not None,
        rotating=rotating,
        merging=merging,
        barrier=not interpret,
        grid=grid,
        order=program_order,
    )
    in_specs = [
        pl.BlockSpec((None, None, g, hd), at(lambda i, h, s: (i, h, 0, 0))),  # q   -> [G, hd]
        pl.BlockSpec((nb, None, rows, None, hd), at(lambda i, h, s: (0, 0, 0, h, 0))),  # K -> [NB, rows, hd]
        pl.BlockSpec((nb, None, rows, None, hd), at(lambda i, h, s: (0, 1, 0, h, 0))),  # V -> [NB, rows, hd]
        pl.BlockSpec((None, None, ks), at(list_map)),  # block_ids  -> [Ks]
        pl.BlockSpec((None, None, ks), at(list_map)),  # block_lens -> [Ks]
    ]
    args = [q_grouped, pool, pool, block_ids, block_lens]
    if rotating:  # the rotation's signs, read once per program (L2-resident)
        in_specs.append(pl.BlockSpec((hd, hd), lambda i, h, s: (0, 0)))
        args.append(jnp.asarray(np.sign(kv_quant.hadamard(hd)), jnp.bfloat16))
    if merging:  # the arrival counters, whole (each program indexes its (b, h) one)
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        args.append(arrivals)
    if merging:  # the merged attention per (b, h), then every split's partial of (b, h) and the counters
        out_specs = [
            pl.BlockSpec((None, None, g, hd), at(lambda i, h, s: (i, h, 0, 0))),  # o -> [G, hd]
            pl.BlockSpec((None, None, g), at(lambda i, h, s: (i, h, 0))),  # m -> [G]
            pl.BlockSpec((None, None, g), at(lambda i, h, s: (i, h, 0))),  # l -> [G]
            pl.BlockSpec((split_k, None, None, g, hd), at(lambda i, h, s: (0, i, h, 0, 0))),  # acc_p [splits, G, hd]
            pl.BlockSpec((split_k, None, None, g), at(lambda i, h, s: (0, i, h, 0))),  # m_p -> [splits, G]
            pl.BlockSpec((split_k, None, None, g), at(lambda i, h, s: (0, i, h, 0))),  # l_p -> [splits, G]
            pl.BlockSpec(memory_space=pl.ANY),  # the counters
        ]
        out_shape = [
            jax.ShapeDtypeStruct((b, hkv, g, hd), out_dtype),
            jax.ShapeDtypeStruct((b, hkv, g), jnp.float32),
            jax.ShapeDtypeStruct((b, hkv, g), jnp.float32),
            jax.ShapeDtypeStruct((split_k, b, hkv, g, hd), jnp.float32),
            jax.ShapeDtypeStruct((split_k, b, hkv, g), jnp.float32),
            jax.ShapeDtypeStruct((split_k, b, hkv, g), jnp.float32),
            jax.ShapeDtypeStruct(arrivals.shape, jnp.int32),
        ]
    else:
        out_specs = [
            pl.BlockSpec((None, None, None, g, hd), at(lambda i, h, s: (s, i, h, 0, 0))),  # acc -> [G, hd]
            pl.BlockSpec((None, None, None, g), at(lambda i, h, s: (s, i, h, 0))),  # m -> [G]
            pl.BlockSpec((None, None, None, g), at(lambda i, h, s: (s, i, h, 0))),  # l -> [G]
        ]
        out_shape = [
            jax.ShapeDtypeStruct((split_k, b, hkv, g, hd), out_dtype or jnp.float32),
            jax.ShapeDtypeStruct((split_k, b, hkv, g), jnp.float32),
            jax.ShapeDtypeStruct((split_k, b, hkv, g), jnp.float32),
        ]
    out = pl.pallas_call(
        kernel,
        grid=(b, hkv, split_k),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={len(args) - 1: len(out_shape) - 1} if merging else {},
        compiler_params=triton_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"sparse_decode_attention_bs{bs}_p{blocks_per_step}" + ("_f8" if rows > bs else "")
             + ("_merged" if merging else ""),
    )(*args)
    if merging:
        o, m, l, _, _, _, arrivals = out  # noqa: E741
        return o, m, l, arrivals
    return tuple(out)


# --------------------------------------------------------------------------------------------------
# 3. public jitted function
# --------------------------------------------------------------------------------------------------
def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _compute_dtype(q_dtype, pool_dtype) -> jnp.dtype:
    """The dots' operand dtype: the pool's; for a float8 pool float32 (float32 queries) or bfloat16 (others: the
    scales folded into scores and probabilities need float32's exponent range, which float16 lacks)."""
    if not kv_quant.is_quantized(pool_dtype):
        return jnp.dtype(pool_dtype)
    return jnp.dtype(jnp.float32) if jnp.dtype(q_dtype) == jnp.float32 else jnp.dtype(jnp.bfloat16)


def _rotates_inside(q_dtype, pool_dtype) -> bool:
    """Whether the kernel rotates q into a float8 pool's basis and its output back: under bfloat16 compute. Under
    float32 compute the wrapper does (with the rotation inside, ptxas spills ~330 bytes of registers, sm_90a)."""
    return kv_quant.is_quantized(pool_dtype) and _compute_dtype(q_dtype, pool_dtype) == jnp.bfloat16


def _check_inputs(q, pool, block_ids, block_lens) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, hd]; got shape {q.shape}")
    if pool.ndim != 5 or pool.shape[1] != 2:
        raise ValueError(f"pool must be one layer's [NB, 2, rows, Hkv, hd]; got shape {pool.shape}")
    if not (jnp.issubdtype(pool.dtype, jnp.floating) or kv_quant.is_quantized(pool.dtype)):
        raise ValueError(f"pool must be floating point, or a float8 cache's bytes (kv_quant); got {pool.dtype}")
    b, hq, hd = q.shape
    _, _, _, hkv, hd_pool = pool.shape
    bs = kv_quant.tokens_per_block(pool)
    if hd != hd_pool:
        raise ValueError(f"head_dim of q ({hd}) != head_dim of pool ({hd_pool})")
    if hq % hkv:
        raise ValueError(f"{hq=} must be divisible by {hkv=}")
    if not _is_pow2(hd) or hd < MIN_DOT_DIM:
        raise ValueError(f"head_dim={hd} must be a power of two >= {MIN_DOT_DIM} (Triton tensor sizes)")
    if not _is_pow2(bs):
        raise ValueError(f"block_size={bs} must be a power of two (Triton tensor sizes)")
    # (a float8 pool's rows are bs + its scale rows: tokens_per_block refuses a row count no block size gives)
    if block_ids.ndim != 3:
        raise ValueError(f"block_ids must be [B, S, K]; got shape {block_ids.shape}")
    if block_lens.shape != block_ids.shape:
        raise ValueError(f"block_lens shape {block_lens.shape} != block_ids shape {block_ids.shape}")
    if block_ids.shape[0] != b:
        raise ValueError(f"block_ids batch {block_ids.shape[0]} != q batch {b}")
    if block_ids.shape[1] not in (1, hkv):
        raise ValueError(f"block_ids.shape[1]={block_ids.shape[1]} must be 1 (SoloHead) or Hkv={hkv} (headwise)")
    if block_ids.shape[2] < 1:
        raise ValueError("block_ids must list at least one entry per row (pad with -1)")
    for name, x in (("block_ids", block_ids), ("block_lens", block_lens)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array; got {x.dtype}")


def _check_program_order(order, grid: tuple[int, int, int]) -> None:
    if order is None:
        return
    n = math.prod(grid)
    if (len(order) != 2 or not all(isinstance(x, int) for x in order) or not 0 < order[0] < n or not 0 <= order[1] < n
            or math.gcd(order[0], n) != 1):
        raise ValueError(f"program_order={order} must be (stride, offset) with 0 < stride < N, gcd(stride, N) = 1 and "
                         f"0 <= offset < N, N = B * Hkv * split_k = {n} programs")
    if (n - 1) * n >= 2 ** 31:  # (stride * n + offset in int32)
        raise ValueError(f"program_order needs N * N < 2 ** 31 (int32 program numbers); got N = {n} programs")


def max_blocks_per_step(bs: int, hd: int, itemsize: int, shared_memory: int = SHARED_MEMORY_PER_BLOCK) -> int:
    """The largest power-of-two blocks per step whose K and V tiles fit a program's shared memory."""
    p = 1
    while 2 * (2 * p) * bs * hd * itemsize * SHARED_BYTES_PER_TILE_BYTE <= shared_memory:
        p *= 2
    return p


def _pick_blocks_per_step(bs: int, k: int, blocks_per_step: int | None, hd: int, itemsize: int) -> int:
    min_blocks = max(1, -(-MIN_DOT_DIM // bs))  # T = P * bs >= 16
    most = max_blocks_per_step(bs, hd, itemsize)
    if blocks_per_step is None:
        return max(min_blocks, min(max(1, TOKENS_PER_STEP // bs), next_pow2(k), most))
    if not _is_pow2(blocks_per_step) or blocks_per_step < min_blocks:
        raise ValueError(f"{blocks_per_step=} must be a power of two >= {min_blocks} for block_size={bs} "
                         f"(Triton dots need >= {MIN_DOT_DIM} tokens per step)")
    if blocks_per_step > most:
        need = int(2 * blocks_per_step * bs * hd * itemsize * SHARED_BYTES_PER_TILE_BYTE)
        raise ValueError(f"{blocks_per_step=} stages ~{need} bytes of K/V tiles in shared memory per program, over the "
                         f"{SHARED_MEMORY_PER_BLOCK} a block may use on an H100/H200: use blocks_per_step <= {most} "
                         f"for block_size={bs}, head_dim={hd}, {itemsize}-byte KV")
    return blocks_per_step


def _pick_split_k(num_steps: int, programs: int, split_k: int | None) -> int:
    if split_k is None:
        want = -(-TARGET_PROGRAMS // programs)  # enough programs to fill the GPU
        split_k = min(MAX_SPLIT_K, want, num_steps // MIN_STEPS_PER_SPLIT)
        return max(1, split_k)
    if split_k < 1:
        raise ValueError(f"{split_k=} must be >= 1")
    return split_k


@functools.partial(
    jax.jit,
    static_argnames=("scale", "split_k", "blocks_per_step", "num_warps", "num_stages", "merge", "interpret",
                     "program_order"),
)
def sparse_decode_attention(
    q: Float[Array, "B Hq hd"],
    pool: Float[Array, "NB 2 rows Hkv hd"],
    block_ids: Int[Array, "B S K"],
    block_lens: Int[Array, "B S K"],
    arrivals: Int[Array, " N"] | None = None,
    *,
    scale: float | None = None,
    split_k: int | None = None,
    blocks_per_step: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    merge: str = "inside",
    interpret: bool | None = None,
    program_order: tuple[int, int] | None = None,
) -> tuple[Array, ...]:
    """Partial attention of one query token per sequence over the listed KV blocks.

    Args:
      q: [B, Hq, hd] queries (RoPE applied), Hq = G * Hkv.
      pool: [NB, 2, rows, Hkv, hd] one layer's KV blocks (K at [:, 0], V at [:, 1]); rows = bs, or bs + r for
        a float8 cache's bytes: e4m3 values and their bfloat16 scales in the scale rows after them (`kv_quant`).
      block_ids: int [B, S, K] physical block ids; S == 1 (SoloHead) or Hkv (headwise); < 0 = padding.
      block_lens: int [B, S, K] valid tokens (slots 0..len-1) of each entry, in [0, bs].
      arrivals: int32 [N] arrival counters for the merge inside, N >= B * Hkv, every one 0 (each call leaves them 0
        again: a caller keeps one buffer, donated from call to call); None: a fresh zeroed buffer where the merge
        is inside (one memset).
      scale: score scale, default hd ** -0.5.
      split_k: number of programs the K entries are split over (None: picked from K and B * Hkv).
      blocks_per_step: blocks gathered per online-softmax step, a power of two with
        blocks_per_step * bs >= 16 and at most `max_blocks_per_step` (its K / V tiles fit a program's shared
        memory, counted in the compute dtype for float8 pools; more is a ValueError) (None: about 64 tokens per
        step).
      num_warps, num_stages: Triton compiler params (num_warps None: 4, or 8 when a step's K tile
        has >= 8192 elements, e.g. 64 tokens x hd 128; num_stages None: 2, or 1 for a float8 pool under
        float32 queries).
      merge: with several splits, "inside": the last program of each (sequence, KV head) to finish merges the
        splits' partials in the kernel (`_merge_last`: one kernel in all); "after": an XLA fusion after the kernel
        merges them (two more kernels).
      interpret: Pallas interpret mode (None: where the program is compiled for a CPU; the Triton kernel
        where it is compiled for a GPU, `pallas_kernels.common.on_platform`).
      program_order: None, or (stride, offset) with stride coprime to N = B * Hkv * split_k: the program launched
        n-th (row-major over the grid) computes the (sequence, KV head, split) numbered (stride * n + offset) mod N.
        The result does not depend on it. Interpret mode runs the programs one at a time in launch order, so a
        permuted order makes a program other than the last split of a (sequence, KV head) arrive last: tests run
        the merge inside that way, where it must rely on its arrival counters alone.

    Returns:
      o [B, Hq, hd] (q.dtype, softmax-normalised; 0 where nothing was attended),
      m [B, Hq] f32 max scaled score (-inf where nothing was attended),
      l [B, Hq] f32 sum of exp(score - m) (0 where nothing was attended),
      and where `arrivals` is given, the counters (all 0) to hand to the next call.
    """
    _check_inputs(q, pool, block_ids, block_lens)
    if merge not in ("inside", "after"):
        raise ValueError(f"merge must be 'inside' or 'after', got {merge!r}")
    if arrivals is not None and (arrivals.ndim != 1 or arrivals.dtype != jnp.int32):
        raise ValueError(f"arrivals must be int32 [N] counters; got {arrivals.dtype} {arrivals.shape}")
    b, hq, hd = q.shape
    hkv = pool.shape[3]
    bs = kv_quant.tokens_per_block(pool)
    k = block_ids.shape[2]
    g = hq // hkv
    scale = float(hd ** -0.5 if scale is None else scale)
    cdt = _compute_dtype(q.dtype, pool.dtype)

    # float8 tiles are converted to the compute dtype before the dots: budget shared memory at its width
    bps = _pick_blocks_per_step(bs, k, blocks_per_step, hd, max(cdt.itemsize, jnp.dtype(pool.dtype).itemsize))
    num_steps = -(-k // bps)
    split_k = _pick_split_k(num_steps, b * hkv, split_k)
    steps_per_split = -(-num_steps // split_k)
    kp = split_k * steps_per_split * bps
    if num_warps is None:
        num_warps = 8 if bps * bs * hd >= 8192 else 4
    if num_stages is None:  # float8 tiles converted to float32 spill registers when software-pipelined
        num_stages = 1 if kv_quant.is_quantized(pool.dtype) and cdt == jnp.float32 else 2
    ids = jnp.pad(block_ids.astype(jnp.int32), ((0, 0), (0, 0), (0, kp - k)), constant_values=-1)
    lens = jnp.pad(block_lens.astype(jnp.int32), ((0, 0), (0, 0), (0, kp - k)))

    # [B, Hkv, G, hd]: a free reshape (float8 pools: rotated into their basis by the kernel, or for float32 compute
    # here, fused with its padding)
    rotating = _rotates_inside(q.dtype, pool.dtype)
    q_grouped = q.reshape(b, hkv, g, hd)
    if not rotating:
        q_grouped = kv_quant.cache_basis(q_grouped, pool.dtype).astype(cdt)

    rotate_here = kv_quant.is_quantized(pool.dtype) and not rotating  # (float32 compute: the output rotated back here)
    out_dtype = jnp.float32 if rotate_here else q.dtype
    inside = split_k > 1 and merge == "inside"  # (too few counters: `_sparse_decode_call` says so)
    counters = (arrivals if arrivals is not None else jnp.zeros((b * hkv,), jnp.int32)) if inside else None
    out = on_platform(lambda interp: _sparse_decode_call(
        q_grouped, pool, ids, lens, counters,
        scale=scale, split_k=split_k, blocks_per_step=bps,
        num_warps=num_warps, num_stages=num_stages, interpret=interp,
        out_dtype=out_dtype if split_k == 1 or inside else None,  # (normalised in the kernel, nothing to merge after)
        program_order=program_order,
    ), interpret)
    if inside:
        o, m, l, counters = out  # noqa: E741
    elif split_k == 1:
        o, m, l = out[0][0], out[1][0], out[2][0]  # noqa: E741
    else:
        o, m, l = merge_stacked_partials(*out, out_dtype=out_dtype, normalized=False)  # noqa: E741
    if rotate_here:
        o = kv_quant.cache_basis(o, pool.dtype).astype(q.dtype)
    result = (o.reshape(b, hq, hd), m.reshape(b, hq), l.reshape(b, hq))
    if arrivals is None:
        return result
    return (*result, counters if inside else arrivals)


# --------------------------------------------------------------------------------------------------
# 4. reference in plain jnp
# --------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("scale",))
def sparse_decode_attention_reference(
    q: Float[Array, "B Hq hd"],
    pool: Float[Array, "NB 2 rows Hkv hd"],
    block_ids: Int[Array, "B S K"],
    block_lens: Int[Array, "B S K"],
    *,
    scale: float | None = None,
) -> tuple[Float[Array, "B Hq hd"], Float[Array, "B Hq"], Float[Array, "B Hq"]]:
    """Same contract as `sparse_decode_attention`, by gathering the listed blocks with jnp (f32 math; a float8
    pool's gathered values and scale bytes are dequantised with `kv_quant.scale_from_bytes`, the pool itself never
    is, and attended in the pool's rotated basis)."""
    _check_inputs(q, pool, block_ids, block_lens)
    b, hq, hd = q.shape
    hkv = pool.shape[3]
    bs = kv_quant.tokens_per_block(pool)
    k = block_ids.shape[2]
    g = hq // hkv
    scale = float(hd ** -0.5 if scale is None else scale)

    ids = jnp.broadcast_to(block_ids, (b, hkv, k)).astype(jnp.int32)  # SoloHead rows shared by heads
    lens = jnp.where(ids >= 0, jnp.broadcast_to(block_lens, (b, hkv, k)), 0)
    valid = jnp.arange(bs)[None, None, None, :] < lens[..., None]  # [B, Hkv, K, bs]
    safe = jnp.maximum(ids, 0)[..., None]  # [B, Hkv, K, 1]
    heads = jnp.arange(hkv)[None, :, None, None]
    slots = jnp.arange(bs)[None, None, None, :]
    read = kv_quant.as_float8 if kv_quant.is_quantized(pool.dtype) else (lambda x: x)  # (stored bytes -> e4m3)
    kk = read(pool[safe, 0, slots, heads]).astype(jnp.float32)  # [B, Hkv, K, bs, hd]
    vv = read(pool[safe, 1, slots, heads]).astype(jnp.float32)
    if kv_quant.is_quantized(pool.dtype):  # token t's scale bytes sit in its head's scale rows: gathered, then exact
        def scales(c):
            parts = []
            for byte in range(kv_quant.SCALE_BYTES):
                row, col = kv_quant.scale_position(slots, byte, bs, hd)
                parts.append(pool[safe, c, row, heads, col])  # [B, Hkv, K, bs]
            return kv_quant.scale_from_bytes(*parts)[..., None]

        kk, vv = kk * scales(0), vv * scales(1)
    kk = jnp.where(valid[..., None], kk, 0.0).reshape(b, hkv, k * bs, hd)
    vv = jnp.where(valid[..., None], vv, 0.0).reshape(b, hkv, k * bs, hd)
    valid = valid.reshape(b, hkv, 1, k * bs)

    qg = kv_quant.cache_basis(q, pool.dtype).astype(jnp.float32).reshape(b, hkv, g, hd)  # (float8: rotated)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, kk, precision=hi) * scale
    s = jnp.where(valid, s, -jnp.inf)
    m = jnp.max(s, axis=-1)  # [B, Hkv, G]
    m_off = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.where(valid, jnp.exp(s - m_off[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)  # noqa: E741
    o = jnp.einsum("bhgt,bhtd->bhgd", p, vv, precision=hi) / jnp.where(l > 0, l, 1.0)[..., None]
    o = kv_quant.cache_basis(o, pool.dtype)  # (float8: rotated back)
    return o.reshape(b, hq, hd).astype(q.dtype), m.reshape(b, hq), l.reshape(b, hq)


__all__ = ["max_blocks_per_step", "sparse_decode_attention", "sparse_decode_attention_reference"]
