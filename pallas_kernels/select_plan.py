"""A sparse layer's block selection and slot-cache plan in one kernel: aggregate the block scores, take the top-k
(sinks and window forced), look the selection up in the layer's slot cache, pick LRU victims for the misses,
update the cache's state and write the attention entry lists and the misses' recall entries.

    select_plan(scores, num_blocks, stamp, key, layer, rows, capacity, gpu, host, slots, lengths, ...)
        -> SelectPlanOut

With `middle` (the step's forced middle blocks, [SL, B, S, M] per sparse layer, row and lane) a lane's middle blocks
are its list's instead of the top-k's, sinks and window staying forced: entries >= 0 are blocks (those outside the
middle range ignored, repeats once), -1 pads; a lane holding `SCORER` (-2) keeps the scored selection. The engine
always passes it (`SCORER` everywhere but in a replayed trace's steps), so that a replay runs the same program.

One program per (sequence b, lane s) (lane = KV head for headwise selection, 0 for SoloHead). The contract is
`pulseinfer_jax.selection.policy.select_blocks` followed by `pulseinfer_jax.selection.slot_plan.layer_plan` in
"recall" mode, per row and lane (the host reads `info`: each lane's counts and its misses' host rows; `miss_slot`
lists their slots, for the landing); `select_plan_reference` is the same algorithm in plain jnp, batched.

The block scores come from their own kernel (`block_scoring`: a (B, Hkv, K / TK) grid that streams the key bounds at
full bandwidth; one program per sequence would read a 128K-token sequence's 16 MB of bounds alone), so a sparse layer's
selection is two kernels: score, then this one.

Everything runs in the candidates' logical order (K-space: logical block k of the sequence, KP = next_pow2(K))
or the slots' (C-space), never as an [N, C] compare matrix:
  * selection key: SoloHead normalized_sum = per score head softmax(scale * score) over the valid blocks, summed
    over heads (one pass per head row), x (1 + bonus) for blocks in the slot cache; headwise: lane s's raw row;
    retrieval_head: that head's row;
  * forced middle blocks (`middle`): marked in the logical map (bit 2 of the wanted marks), then forced like the
    sinks and window, and the top-k takes exactly the forced blocks where the lane's list holds no `SCORER`;
  * top-k: each valid block gets an int32 rank value (forced blocks INT32_MAX, others the order-preserving bit
    pattern of the clipped key); the k-th largest value is found bit by bit (31 counts over K), ties go to the
    lower index by a prefix count: exactly `select_blocks`' order (NaN = -inf, -0.0 = 0.0);
  * slot lookup by an inverse map logical -> slot (scattered from the cache's keys), so hits, misses and the
    ranks "in selection order" are prefix sums over K;
  * victims: the free slots (not hit, below the capacity) in stamp order (a stamp -> slot map: stamps are a
    permutation of the slots), the i-th miss takes the i-th; new stamps = untouched slots in their order, then
    hits, then misses (the reference's ranks).
With the cache given (recall ahead's spare fill: a miss on the block that just left the window, still whole in its spare
GPU block), the program that filled it also copies that block into its slot (the cache aliased in place, at most one
block per row and lane), so the layer needs no gather and scatter kernels for it. The copies are independent: each row
owns its slot blocks and spare blocks are never slots (`copy_fills`, the same copy in plain jnp).
Intermediate maps live in small global scratch outputs, written and read back across `debug_barrier`s (one
program's threads; in interpret mode programs run one by one and need none). Scattered writes whose mask is off
go to a dump entry past the data, because interpret mode's masked scatter rewrites the old value at its index.

Triton constraints: every loaded / stored tensor is a power of two (KP, CP = next_pow2(C), NP = next_pow2(N));
K, C and N are loaded through masked slices. The programs write disjoint state rows (padding rows may share one and
write it unchanged).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int
from pulseinfer_jax.pallas_kernels.common import next_pow2, on_platform, tile, traced_zero, triton_params

_INT_MIN = -(2**31)
_INT_MAX = 2**31 - 1
_BIG = float(jnp.finfo(jnp.float32).max)
SCORER = -2  # a lane of `middle` holding it keeps the scored selection


class SelectPlanOut(NamedTuple):
    """Per (row, lane): the selection and its slot plan (see the module docstring)."""

    sel: Int[Array, "B S N"]  # selected logical blocks, ascending, -1 padded
    early_units: Int[Array, "B S N"]  # resident blocks then hits (and the spare fill), flat units, -1 padded
    early_lens: Int[Array, "B S N"]
    late_units: Int[Array, "B S N"]  # misses (recalled into their slots), -1 padded
    late_lens: Int[Array, "B S N"]
    miss_slot: Int[Array, "B S N"]  # each miss's slot GPU block, compacted, 0 padded
    # what the host reads, one row per lane: each miss's host row (compacted, 0 padded), then hits (spare fill
    # included), misses, the spare fill's slot block and its source block (-1 none)
    info: Int[Array, "B S N+4"]
    stamp: Int[Array, "SL R S C"]
    key: Int[Array, "SL R S C"]
    kv: Array | None = None  # the cache with the spare fills copied (when it was given)


def _order_value(key: Array) -> Array:
    """float32 -> int32 with the same order (NaN as -inf, clipped to the finite floats, -0.0 as 0.0)."""
    f = jnp.clip(jnp.where(key != key, -jnp.inf, key), -_BIG, _BIG) + 0.0
    bits = jax.lax.bitcast_convert_type(f, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(_INT_MAX), bits)


def _top_mask(v: Int[Array, " KP"], valid: Array, m: Array) -> Array:
    """The `m` largest of `v` among `valid` entries, ties to the lower index: a mask. Bit-by-bit k-th largest."""
    def count(t):
        return jnp.sum((v >= t).astype(jnp.int32))

    base = jnp.where(count(jnp.int32(0)) >= m, jnp.int32(0), jnp.int32(_INT_MIN))

    def step(i, base):
        cand = base | jax.lax.shift_left(jnp.int32(1), (30 - i).astype(jnp.int32))
        return jnp.where(count(cand) >= m, cand, base)

    t = jax.lax.fori_loop(0, 31, step, base)
    gt, eq = v > t, v == t
    need = m - jnp.sum(gt.astype(jnp.int32))
    return valid & (m > 0) & (gt | (eq & (jnp.cumsum(eq.astype(jnp.int32)) - 1 < need)))


def _softmax_share(x: Array, valid: Array, scale: float) -> Array:
    """One score head's softmax(scale * x) over the valid blocks (NaN = -inf; a head with no finite score: 0)."""
    s = x * scale
    s = jnp.where(s != s, -jnp.inf, s)
    s = jnp.where(s == jnp.inf, _BIG, s)
    s = jnp.where(valid, s, -jnp.inf)
    m = jnp.max(s)
    m = jnp.where(jnp.abs(m) < jnp.inf, m, 0.0)
    e = jnp.where(valid, jnp.exp(s - m), 0.0)
    return e / jnp.maximum(jnp.sum(e), jnp.finfo(jnp.float32).tiny)


def _kernel(layer_ref, unit_ref, rhead_ref, n_ref, row_ref, cap_ref, len_ref, spb_ref, spg_ref,
            scores_ref, gpu_ref, host_ref, slots_ref, stamp_in, key_in, kept_ref, kl_ref, kv_in, mid_ref,
            sel_ref, eu_ref, el_ref, lu_ref, ll_ref, ms_ref, info_ref, stamp_ref, key_ref,
            inv_ref, wm_ref, byst_ref, aux_ref, vict_ref, new_ref, tmp_ref, *kv_out,
            k: int, c: int, n_sel: int, heads: int, table_rows: int, lanes: int, budget: int, sink: int,
            window: int, select: str, scale: float, bonus: float, block_size: int, spare: bool, kept: int,
            fill: tuple[int, int, int, int] | None, middle: int, interpret: bool):
    barrier = (lambda: None) if interpret else plt.debug_barrier
    kp, cp, npad = next_pow2(k), next_pow2(c), next_pow2(n_sel)
    ki = jnp.arange(kp, dtype=jnp.int32)
    ci = jnp.arange(cp, dtype=jnp.int32)
    s_lane = pl.program_id(1)
    layer, unit = layer_ref[0], unit_ref[0]
    srow = (layer * table_rows + row_ref[0]) * lanes + s_lane
    n = jnp.clip(n_ref[0], 0, k)
    cap, length = cap_ref[0], len_ref[0]
    cvalid = ci < c
    zero = traced_zero()
    ky = plt.load(key_in.at[srow, tile(cp, zero)], mask=cvalid, other=-1)
    st = plt.load(stamp_in.at[srow, tile(cp, zero)], mask=cvalid, other=0)

    # P0: initialise the maps
    inv_ref[pl.ds(0, kp)] = jnp.full((kp,), -1, jnp.int32)
    wm_ref[pl.ds(0, kp)] = jnp.zeros((kp,), jnp.int32)
    for r, pad in enumerate((-1, -1, 0, -1, 0, 0, 0)):  # sel, early units / lens, late units / lens, miss lists
        tmp_ref[r, pl.ds(0, npad)] = jnp.full((npad,), pad, jnp.int32)
    vict_ref[pl.ds(0, cp)] = jnp.zeros((cp,), jnp.int32)
    new_ref[1, pl.ds(0, cp)] = ky
    plt.store(byst_ref.at[jnp.where(cvalid, st, cp)], ci, mask=cvalid)  # stamp -> slot
    barrier()
    # P1: logical block -> slot; the forced middle blocks marked (bit 2)
    cached = cvalid & (ky >= 0) & (ky < k)
    plt.store(inv_ref.at[jnp.where(cached, ky, kp)], ci, mask=cached)
    scored = True
    if middle:
        mi = jnp.arange(next_pow2(middle), dtype=jnp.int32)
        mrow = (layer * pl.num_programs(0) + pl.program_id(0)) * lanes + s_lane
        mid = plt.load(mid_ref.at[mrow, tile(next_pow2(middle), zero)], mask=mi < middle, other=-1)
        scored = jnp.sum((mid == SCORER).astype(jnp.int32)) > 0
        listed = (mid >= sink) & (mid < n - window) & ~scored
        plt.store(wm_ref.at[jnp.where(listed, mid, kp)], jnp.full(mi.shape, 2, jnp.int32), mask=listed)
    barrier()
    # P2: select (logical order); the selection list
    valid = ki < n
    if select == "normalized_sum":
        def head(h, acc):
            x = plt.load(scores_ref.at[h, tile(kp, zero)], mask=ki < k, other=-jnp.inf)
            for j in range(kept):  # the always-kept blocks' scores (sinks, window; `with_kept_scores`' rule)
                lj = kl_ref[jnp.int32(j)]
                x = jnp.where((lj >= 0) & (ki == lj), kept_ref[h, jnp.int32(j)], x)
            return acc + _softmax_share(x, valid, scale)

        key = jax.lax.fori_loop(0, heads, head, jnp.zeros((kp,), jnp.float32))
        if bonus:
            key = jnp.where(inv_ref[pl.ds(0, kp)] >= 0, key * (1.0 + bonus), key)
    elif select == "summed":  # shares summed by the caller (tensor parallelism: over devices)
        key = plt.load(scores_ref.at[jnp.int32(0), tile(kp, zero)], mask=ki < k, other=0.0)
        if bonus:
            key = jnp.where(inv_ref[pl.ds(0, kp)] >= 0, key * (1.0 + bonus), key)
    else:
        row = s_lane if select == "headwise" else jnp.clip(rhead_ref[0], 0, heads - 1)
        key = plt.load(scores_ref.at[row, tile(kp, zero)], mask=ki < k, other=-jnp.inf)
    forced = valid & ((ki < sink) | (ki >= n - window))
    m = jnp.minimum(budget, n)
    if middle:  # a replayed lane takes exactly its forced blocks: sinks, window and the listed ones
        forced = forced | ((wm_ref[pl.ds(0, kp)] & 2) > 0)
        m = jnp.where(scored, m, jnp.sum(forced.astype(jnp.int32)))
    v = jnp.where(forced, jnp.int32(_INT_MAX), jnp.where(valid, _order_value(key), jnp.int32(_INT_MIN)))
    selm = _top_mask(v, valid, m)
    spos = jnp.where(selm, jnp.cumsum(selm.astype(jnp.int32)) - 1, npad)
    plt.store(tmp_ref.at[0, spos], ki, mask=selm)
    barrier()
    # P2b: from here on in selection order (N entries): resident / hit / miss; wanted blocks marked by logical block
    sel = tmp_ref[0, pl.ds(0, npad)]
    on = sel >= 0
    safe = jnp.where(on, sel, 0)
    g = plt.load(gpu_ref.at[safe], mask=on, other=-1)
    inv = plt.load(inv_ref.at[safe], mask=on, other=-1)
    res = on & (g >= 0)
    wanted = on & ~res
    hit = wanted & (inv >= 0)
    miss = wanted & ~hit
    misses = jnp.sum(miss.astype(jnp.int32))
    plt.store(wm_ref.at[jnp.where(wanted, sel, kp)], jnp.ones((npad,), jnp.int32), mask=wanted)
    barrier()
    # P3: slots hit now; free slots
    held = (plt.load(wm_ref.at[jnp.where(cached, ky, 0)], mask=cached, other=0) & 1) > 0
    free = cvalid & ~held & (ci < cap)
    aux_ref[pl.ds(0, cp)] = free.astype(jnp.int32) + 2 * held.astype(jnp.int32)
    barrier()
    # P4: in stamp order: free ranks (the victims), untouched slots' new stamps
    byst = plt.load(byst_ref.at[tile(cp, zero)], mask=cvalid, other=0)
    a = plt.load(aux_ref.at[byst], mask=cvalid, other=0)
    fb, hb = (a & 1) > 0, (a & 2) > 0
    fr = jnp.cumsum(fb.astype(jnp.int32)) - 1
    nfree = jnp.sum(fb.astype(jnp.int32))
    taken = fb & (fr < misses)
    untouched = cvalid & ~hb & ~taken
    ur = jnp.cumsum(untouched.astype(jnp.int32)) - 1
    u_count = jnp.sum(untouched.astype(jnp.int32))
    plt.store(new_ref.at[0, jnp.where(untouched, byst, cp)], ur, mask=untouched)
    plt.store(vict_ref.at[jnp.where(taken, fr, cp)], byst, mask=taken)
    barrier()
    # P5: each wanted block's slot; new stamps and keys
    r = jnp.cumsum(miss.astype(jnp.int32)) - 1
    hits = jnp.sum(hit.astype(jnp.int32))
    placed = miss & (r < nfree)  # (always, given the caller's guarantee: misses never exceed the free slots)
    victim = plt.load(vict_ref.at[jnp.where(placed, r, 0)], mask=placed, other=0)
    slot = jnp.where(hit, inv, jnp.where(placed, victim, -1))
    touched = hit | placed
    plt.store(new_ref.at[0, jnp.where(touched, slot, cp)],
              jnp.where(hit, u_count + jnp.cumsum(hit.astype(jnp.int32)) - 1, u_count + hits + r), mask=touched)
    plt.store(new_ref.at[1, jnp.where(placed, victim, cp)], sel, mask=placed)
    # the entry lists and the misses' recall entries
    slot_block = plt.load(slots_ref.at[jnp.where(slot >= 0, slot, 0)], mask=slot >= 0, other=0)
    if spare:
        spb = spb_ref[0]
        filled = miss & (sel == spb) & (spb >= 0)
    else:
        filled = jnp.zeros_like(miss)
    late = miss & ~filled
    units = jnp.where(res, unit + g, unit + slot_block)
    lens = jnp.where(res, jnp.clip(length - sel * block_size, 0, block_size), block_size)
    early = res | hit | filled
    n_res = jnp.sum(res.astype(jnp.int32))
    epos = jnp.where(res, jnp.cumsum(res.astype(jnp.int32)) - 1,
                     n_res + jnp.cumsum((early & ~res).astype(jnp.int32)) - 1)
    epos = jnp.where(early, epos, npad)
    plt.store(tmp_ref.at[1, epos], units, mask=early)
    plt.store(tmp_ref.at[2, epos], lens, mask=early)
    lpos = jnp.where(late, jnp.cumsum(late.astype(jnp.int32)) - 1, npad)
    plt.store(tmp_ref.at[3, lpos], units, mask=late)
    plt.store(tmp_ref.at[4, lpos], lens, mask=late)
    plt.store(tmp_ref.at[5, lpos], slot_block, mask=late)
    plt.store(tmp_ref.at[6, lpos], plt.load(host_ref.at[safe], mask=on, other=0), mask=late)
    any_fill = jnp.sum(filled.astype(jnp.int32)) > 0
    fill_dst = jnp.max(jnp.where(filled, slot_block, -1))
    fill_src = jnp.where(any_fill, spg_ref[0], -1) if spare else jnp.int32(-1)
    if fill is not None:  # copy the filled block from its spare GPU block into its slot (this layer's flat units)
        _copy_fill(kv_in, kv_out[0], unit // fill[0] * fill[0], fill_src, fill_dst, any_fill, s_lane, fill[1:],
                   lanes > 1)
    i4 = jnp.arange(4, dtype=jnp.int32)
    info_ref[pl.ds(n_sel, 4)] = jnp.where(i4 == 0, jnp.sum((hit | filled).astype(jnp.int32)),
                                jnp.where(i4 == 1, jnp.sum(late.astype(jnp.int32)),
                                          jnp.where(i4 == 2, fill_dst, fill_src)))
    barrier()
    # P6: the lists and the state row out
    for out, rr in ((sel_ref, 0), (eu_ref, 1), (el_ref, 2), (lu_ref, 3), (ll_ref, 4), (ms_ref, 5), (info_ref, 6)):
        plt.store(out.at[tile(npad, zero)], tmp_ref[rr, pl.ds(0, npad)], mask=jnp.arange(npad) < n_sel)
    plt.store(stamp_ref.at[srow, tile(cp, zero)], new_ref[0, pl.ds(0, cp)], mask=cvalid)
    plt.store(key_ref.at[srow, tile(cp, zero)], new_ref[1, pl.ds(0, cp)], mask=cvalid)


def _copy_fill(kv_in, kv_out, first: Array, src: Array, dst: Array, on: Array, lane: Array,
               shape: tuple[int, int, int], headwise: bool) -> None:
    """Block `src` -> block `dst` of the layer whose flat units start at `first` (kv as [units, 2 * rows * Hkv * hd]),
    whole (SoloHead) or lane `lane`'s head only (headwise), in power-of-two chunks; nothing unless `on`."""
    rows, hkv, hd = shape
    n = 2 * rows * (1 if headwise else hkv) * hd  # elements copied
    chunk = min(next_pow2(n), 8192)
    u_src, u_dst = first + jnp.maximum(src, 0), first + jnp.maximum(dst, 0)

    def step(j, carry):
        t = j * chunk + jnp.arange(chunk, dtype=jnp.int32)
        if headwise:  # element t of head `lane`: (K|V, row, feature) -> its offset in the block
            kvr, d = t // hd, t % hd
            t_at = (kvr * hkv + lane) * hd + d
        else:
            t_at = t
        live = (t < n) & on
        at = jnp.where(live, t_at, 0)
        plt.store(kv_out.at[u_dst, at], plt.load(kv_in.at[u_src, at], mask=live, other=0), mask=live)
        return carry

    jax.lax.fori_loop(0, -(-n // chunk), step, 0)


def copy_fills(kv: Array, layer: Array | int, dst: Int[Array, "B S"], src: Int[Array, "B S"]) -> Array:
    """The spare fills in plain jnp: block src -> slot block dst of cache layer `layer` (kv [L, NB, 2, rows, Hkv,
    hd]), whole blocks for one lane (SoloHead), head s for lane s (headwise); -1 = none (the null block 0 onto
    itself). Every dst is a different block and no dst is a src (each row owns its slots, spare blocks are no slots)."""
    dst, src = jnp.maximum(dst, 0), jnp.maximum(src, 0)
    if dst.shape[1] == 1:
        return kv.at[layer, dst[:, 0]].set(kv[layer, src[:, 0]])
    h = jnp.broadcast_to(jnp.arange(dst.shape[1]), dst.shape)
    return kv.at[layer, dst, :, :, h].set(kv[layer, src, :, :, h])


def _check(scores, num_blocks, stamp, key, rows, gpu, slots, budget, sink, window, select, kept, middle=None):
    if scores.ndim != 3:
        raise ValueError(f"scores must be [B, H, K], got shape {scores.shape}")
    b, h, k = scores.shape
    if stamp.ndim != 4 or stamp.shape != key.shape:
        raise ValueError(f"stamp {stamp.shape} and key {key.shape} must both be [SL, R, S, C]")
    if num_blocks.shape != (b,) or rows.shape != (b,):
        raise ValueError(f"num_blocks {num_blocks.shape} and rows {rows.shape} must be [B] = [{b}]")
    if gpu.shape != (b, k) or slots.ndim != 2 or slots.shape[0] != b:
        raise ValueError(f"gpu {gpu.shape} must be [B, K] = [{b}, {k}] and slots {slots.shape} [B, C'] (C' >= every "
                         "row's capacity)")
    if budget <= 0:
        raise ValueError(f"budget={budget} must be positive")
    if min(sink, window) < 0 or sink + window > budget:
        raise ValueError(f"sink={sink} + window={window} must fit the budget={budget}")
    lanes = stamp.shape[2]
    if select not in ("normalized_sum", "summed", "retrieval_head", "headwise"):
        raise ValueError(f"select={select!r} must be normalized_sum, summed, retrieval_head or headwise")
    if kept is not None and select != "normalized_sum":
        raise ValueError(f"kept scores are normalized_sum's (SoloHead's softmax over blocks), not {select!r}'s")
    if select == "headwise" and lanes != h:
        raise ValueError(f"headwise selection needs one slot lane per score head: {lanes} lanes, {h} heads")
    if select != "headwise" and lanes != 1:
        raise ValueError(f"SoloHead selection uses one slot lane, got {lanes}")
    if middle is not None and (middle.ndim != 4 or middle.shape[1:3] != (b, lanes)
                               or not 1 <= middle.shape[3] <= budget - sink - window):
        raise ValueError(f"middle {middle.shape} must be [SL, B, S, M] = [SL, {b}, {lanes}, M], 1 <= M <= "
                         f"budget - sink - window = {budget - sink - window}")


@functools.partial(jax.jit, static_argnames=("budget", "sink", "window", "select", "scale", "bonus", "block_size",
                                             "num_warps", "interpret"), donate_argnames=("stamp", "key", "kv"))
def select_plan(
    scores: Float[Array, "B H K"],
    num_blocks: Int[Array, " B"],
    stamp: Int[Array, "SL R S C"],
    key: Int[Array, "SL R S C"],
    layer: Int[Array, ""],
    rows: Int[Array, " B"],
    capacity: Int[Array, " B"],
    gpu: Int[Array, "B K"],
    host: Int[Array, "B K"],
    slots: Int[Array, "B C2"],
    lengths: Int[Array, " B"],
    unit_offset: Int[Array, ""],
    spare: tuple[Int[Array, " B"], Int[Array, " B"]] | None = None,
    retrieval_head: Int[Array, ""] | int = 0,
    kept: tuple[Float[Array, "B H KK"], Int[Array, "B KK"]] | None = None,
    kv: Array | None = None,
    middle: Int[Array, "SL B S M"] | None = None,
    *,
    budget: int,
    sink: int,
    window: int,
    select: str = "normalized_sum",
    scale: float = 1.0,
    bonus: float = 0.0,
    block_size: int,
    num_warps: int | None = None,
    interpret: bool | None = None,
) -> SelectPlanOut:
    """Select and plan every (row, lane) of one sparse layer (module docstring). `select`: "normalized_sum"
    (SoloHead, `scale` its softmax temperature, `bonus` the resident-block bonus), "summed" (SoloHead on the
    shares the caller summed over heads, row 0 of `scores`, with the bonus), "retrieval_head" (SoloHead on
    head `retrieval_head`) or "headwise" (lane s selects on score head s). `kept` = (scores [B, H, KK], logical blocks
    [B, KK], -1 = none): normalized_sum's scores of those blocks replaced by these (`kept_blocks.with_kept_scores`).
    `kv` (the cache [L, NB, 2, rows, Hkv, hd], with `spare`; aliased, updated in place): the kernel also copies each
    spare fill's block into its slot (layer unit_offset // NB), returned as `kv` (else the caller copies it).
    `spare` = (logical block, GPU block) per
    row: a miss on that block is filled from it on the GPU (an early entry, `info[..., -2:]`), not recalled.
    `middle` ([SL, B, S, M], sparse layer `layer`'s rows read): forced middle blocks per lane (module docstring)."""
    _check(scores, num_blocks, stamp, key, rows, gpu, slots, budget, sink, window, select, kept, middle)
    b, h, k = scores.shape
    sl, tr, lanes, c = stamp.shape
    kp, cp = next_pow2(k), next_pow2(c)
    if num_warps is None:  # about 8 elements of each K-space vector per thread; a lone program gets a whole SM's
        # 32 warps (ptxas held it to 64 registers and spilled 8 bytes at 16, B = 1, 2,560 candidates, 40 heads)
        num_warps = 32 if b * lanes == 1 and kp >= 4096 else max(4, min(16, kp // 256))
    i32 = jnp.int32
    one = lambda x: jnp.asarray(x, i32).reshape(1)  # noqa: E731
    # (absent inputs: stand-ins the kernel never reads, not constants, which would each cost a kernel to fill)
    spb, spg = spare if spare is not None else (rows, rows)
    kk = 0 if kept is None else kept[1].shape[1]
    if kv is not None and spare is None:
        raise ValueError("kv is only passed for the spare fill's copy: give spare too")
    fill = None
    flat_kv = scores  # (a stand-in, never read)
    if kv is not None:
        nb_, rows_, hkv_, hd_ = kv.shape[1], kv.shape[3], kv.shape[4], kv.shape[5]
        fill = (nb_, rows_, hkv_, hd_)
        flat_kv = kv.reshape(kv.shape[0] * nb_, -1)  # (a free view: one row per flat unit)
    kept_s, kept_l = kept if kept is not None else (scores, gpu)
    flat_mid = middle.reshape(-1, middle.shape[3]) if middle is not None else gpu  # [SL * B * S, M] (or a stand-in)
    flat_st, flat_ky = stamp.reshape(-1, c), key.reshape(-1, c)
    row_spec = pl.BlockSpec((1,), lambda i, s: (i,))
    whole1 = pl.BlockSpec((1,), lambda i, s: (0,))
    state_spec = pl.BlockSpec(flat_st.shape, lambda i, s: (0, 0))
    lane_out = pl.BlockSpec((None, None, budget), lambda i, s: (i, s, 0))

    def scratch(*shape):
        return (pl.BlockSpec((None, None, *shape), lambda i, s: (i, s) + (0,) * len(shape)),
                jax.ShapeDtypeStruct((b, lanes, *shape), i32))

    scr = [scratch(kp + 1), scratch(kp + 1), scratch(cp + 1), scratch(cp), scratch(cp + 1), scratch(2, cp + 1),
           scratch(7, next_pow2(budget) + 1)]
    lists = jax.ShapeDtypeStruct((b, lanes, budget), i32)

    kv_spec = pl.BlockSpec(flat_kv.shape, lambda i, s: (0,) * flat_kv.ndim)

    def run(interp: bool):
        kernel = functools.partial(
            _kernel, k=k, c=c, n_sel=budget, heads=h, table_rows=tr, lanes=lanes, budget=budget, sink=sink,
            window=window, select=select, scale=float(scale), bonus=float(bonus), block_size=block_size,
            spare=spare is not None, kept=kk, fill=fill, middle=0 if middle is None else middle.shape[3],
            interpret=interp)
        return pl.pallas_call(
            kernel,
            grid=(b, lanes),
            in_specs=[whole1, whole1, whole1] + [row_spec] * 6 + [
                pl.BlockSpec((None, h, k), lambda i, s: (i, 0, 0)),  # scores
                pl.BlockSpec((None, k), lambda i, s: (i, 0)),  # gpu
                pl.BlockSpec((None, k), lambda i, s: (i, 0)),  # host
                pl.BlockSpec((None, slots.shape[1]), lambda i, s: (i, 0)),  # slots
                state_spec, state_spec,
                pl.BlockSpec((None, h, max(kk, 1)), lambda i, s: (i, 0, 0)),  # kept scores
                pl.BlockSpec((None, max(kk, 1)), lambda i, s: (i, 0)),  # kept logical blocks
                kv_spec,  # the cache (the fill's copy), or a stand-in
                pl.BlockSpec(flat_mid.shape, lambda i, s: (0, 0))],  # the forced middle blocks, or a stand-in
            out_specs=[lane_out] * 6 + [pl.BlockSpec((None, None, budget + 4), lambda i, s: (i, s, 0)), state_spec,
                                        state_spec] + [spec for spec, _ in scr] + [kv_spec] * (fill is not None),
            out_shape=[lists] * 6 + [jax.ShapeDtypeStruct((b, lanes, budget + 4), i32),
                                     jax.ShapeDtypeStruct(flat_st.shape, i32), jax.ShapeDtypeStruct(flat_ky.shape, i32)]
            + [shape for _, shape in scr] + [jax.ShapeDtypeStruct(flat_kv.shape, flat_kv.dtype)] * (fill is not None),
            input_output_aliases={13: 7, 14: 8, **({17: 9 + len(scr)} if fill is not None else {})},
            interpret=interp,
            compiler_params=triton_params(num_warps=num_warps, num_stages=1),
            name=f"select_plan_{select}_n{budget}",
        )(one(layer), one(unit_offset), one(retrieval_head), num_blocks.astype(i32), rows.astype(i32),
          capacity.astype(i32), lengths.astype(i32), spb.astype(i32), spg.astype(i32), scores.astype(jnp.float32),
          gpu.astype(i32), host.astype(i32), slots.astype(i32), flat_st, flat_ky, kept_s.astype(jnp.float32),
          kept_l.astype(i32), flat_kv, flat_mid.astype(i32))

    out = on_platform(run, interpret)
    return SelectPlanOut(*out[:7], out[7].reshape(stamp.shape), out[8].reshape(key.shape),
                         out[-1].reshape(kv.shape) if kv is not None else None)


def select_plan_reference(
    scores: Float[Array, "B H K"],
    num_blocks: Int[Array, " B"],
    stamp: Int[Array, "SL R S C"],
    key: Int[Array, "SL R S C"],
    layer: Int[Array, ""],
    rows: Int[Array, " B"],
    capacity: Int[Array, " B"],
    gpu: Int[Array, "B K"],
    host: Int[Array, "B K"],
    slots: Int[Array, "B C2"],
    lengths: Int[Array, " B"],
    unit_offset: Int[Array, ""],
    spare: tuple[Int[Array, " B"], Int[Array, " B"]] | None = None,
    retrieval_head: Int[Array, ""] | int = 0,
    kept: tuple[Float[Array, "B H KK"], Int[Array, "B KK"]] | None = None,
    kv: Array | None = None,
    middle: Int[Array, "SL B S M"] | None = None,
    *,
    budget: int,
    sink: int,
    window: int,
    select: str = "normalized_sum",
    scale: float = 1.0,
    bonus: float = 0.0,
    block_size: int,
) -> SelectPlanOut:
    """Plain jnp, batched over rows and lanes: a sort-based top-k, then the slot plan written with one-hot
    compares over the slots (the literal rules of the module docstring)."""
    _check(scores, num_blocks, stamp, key, rows, gpu, slots, budget, sink, window, select, kept, middle)
    b, h, k = scores.shape
    sl, tr, lanes, c = stamp.shape
    i32 = jnp.int32
    ki = jnp.arange(k, dtype=i32)
    n = jnp.clip(num_blocks.astype(i32), 0, k)[:, None, None]  # [B, 1, 1]
    valid = ki < n  # [B, 1, K]
    st, ky = stamp[layer, rows], key[layer, rows]  # [B, S, C]
    inv_eq = ky[..., :, None] == ki  # [B, S, C, K]
    inv = jnp.where(inv_eq.any(axis=-2), jnp.argmax(inv_eq, axis=-2), -1).astype(i32)  # [B, S, K]
    x = scores.astype(jnp.float32)
    if kept is not None:
        cols = jnp.arange(k, dtype=i32)
        for j in range(kept[1].shape[1]):
            lj = kept[1][:, j, None, None]
            x = jnp.where((lj >= 0) & (cols == lj), kept[0][:, :, j, None].astype(jnp.float32), x)
    if select == "normalized_sum":  # (over K padded to a power of two and head by head, as the kernel sums)
        kp = next_pow2(k)
        xp = jnp.pad(x, ((0, 0), (0, 0), (0, kp - k)), constant_values=-jnp.inf)
        vp = jnp.arange(kp) < n[:, 0]  # [B, KP]
        share = jax.vmap(jax.vmap(_softmax_share, in_axes=(0, None, None)), in_axes=(0, 0, None))(xp, vp, scale)
        sel_key = share[:, 0]
        for hh in range(1, h):
            sel_key = sel_key + share[:, hh]
        sel_key = sel_key[:, None, :k]
        if bonus:
            sel_key = jnp.where(inv >= 0, sel_key * (1.0 + bonus), sel_key)
    elif select == "summed":
        sel_key = x[:, :1]
        if bonus:
            sel_key = jnp.where(inv >= 0, sel_key * (1.0 + bonus), sel_key)
    elif select == "headwise":
        sel_key = x
    else:
        sel_key = jax.lax.dynamic_index_in_dim(x, jnp.clip(jnp.asarray(retrieval_head, i32), 0, h - 1), 1)
    forced = valid & ((ki < sink) | (ki >= n - window))
    finite = jnp.clip(jnp.where(jnp.isnan(sel_key), -jnp.inf, sel_key), -_BIG, _BIG)
    rank = jnp.where(forced, -jnp.inf, jnp.where(valid, -finite, jnp.inf)) + 0.0
    _, order = jax.lax.sort((rank, jnp.broadcast_to(ki, rank.shape)), dimension=2, num_keys=2)
    m = jnp.minimum(budget, n)
    selm = jnp.zeros(rank.shape, bool).at[jnp.arange(b)[:, None, None], jnp.arange(lanes)[None, :, None],
                                          order].set(jnp.arange(k) < m)
    selm = selm & valid
    if middle is not None:  # replayed lanes: sinks, window and the listed middle blocks
        mid = middle[layer].astype(i32)  # [B, S, M]
        ok = (mid >= sink) & (mid < n - window)
        listed = jnp.any((mid[..., None] == ki) & ok[..., None], axis=-2)  # [B, S, K]
        scored = jnp.any(mid == SCORER, axis=-1, keepdims=True)
        selm = jnp.where(scored, selm, valid & (forced | listed))

    def csum(mask):
        return jnp.cumsum(mask.astype(i32), axis=-1) - 1

    def compact(mask, pos, values, fill):
        at = jnp.where(mask, pos, budget)[..., None] == jnp.arange(budget)  # [B, S, K, N]
        return jnp.where(at.any(axis=-2), jnp.max(jnp.where(at, values[..., None], _INT_MIN), axis=-2),
                         fill).astype(i32)

    g = jnp.broadcast_to(gpu[:, None, :], selm.shape)
    res = selm & (g >= 0)
    wanted = selm & ~res
    hit = wanted & (inv >= 0)
    miss = wanted & ~hit
    held = (inv_eq & wanted[..., None, :]).any(axis=-1)  # [B, S, C]
    free = ~held & (jnp.arange(c) < capacity[:, None, None])
    # free slots in stamp order: the i-th free slot (by stamp) is the i-th miss's victim
    free_rank = jnp.sum(free[..., None, :] & (st[..., None, :] < st[..., :, None]), axis=-1)  # [B, S, C]
    misses = jnp.sum(miss, axis=-1, keepdims=True)
    nfree = jnp.sum(free, axis=-1, keepdims=True)
    r, hr = csum(miss), csum(hit)
    placed = miss & (r < nfree)
    takes = free[..., None, :] & (free_rank[..., None, :] == r[..., :, None]) & placed[..., None]  # [B, S, K, C]
    victim = jnp.argmax(takes, axis=-1).astype(i32)
    taken_slot = free & (free_rank < misses)
    untouched = ~held & ~taken_slot
    u_rank = jnp.sum(untouched[..., None, :] & (st[..., None, :] < st[..., :, None]), axis=-1)
    u_count = jnp.sum(untouched, axis=-1, keepdims=True)
    hits = jnp.sum(hit, axis=-1, keepdims=True)
    slot = jnp.where(hit, inv, jnp.where(placed, victim, -1))
    at_slot = (slot[..., :, None] == jnp.arange(c)) & (hit | placed)[..., None]  # [B, S, K, C]
    touched_val = jnp.where(hit, u_count + hr, u_count + hits + r)
    new_st = jnp.where(untouched, u_rank, jnp.max(jnp.where(at_slot, touched_val[..., None], _INT_MIN), axis=-2))
    new_ky = jnp.where(taken_slot, jnp.max(jnp.where(at_slot & placed[..., None], ki[:, None], -1), axis=-2), ky)
    slot_block = jnp.take_along_axis(slots[:, None, :], jnp.clip(slot, 0, slots.shape[1] - 1), axis=-1)
    if spare is not None:
        spb, spg = spare
        filled = miss & (ki == spb[:, None, None]) & (spb[:, None, None] >= 0)
    else:
        filled = jnp.zeros_like(miss)
    late = miss & ~filled
    units = jnp.where(res, unit_offset + g, unit_offset + slot_block)
    lens = jnp.where(res, jnp.clip(lengths[:, None, None] - ki * block_size, 0, block_size), block_size)
    early = res | hit | filled
    n_res = jnp.sum(res, axis=-1, keepdims=True)
    epos = jnp.where(res, csum(res), n_res + csum(early & ~res))
    lpos = csum(late)
    hrow = jnp.broadcast_to(host[:, None, :], selm.shape)
    fill_dst = jnp.max(jnp.where(filled, slot_block, -1), axis=-1)
    fill_src = (jnp.where(filled.any(axis=-1), spare[1][:, None], -1) if spare is not None
                else jnp.full(fill_dst.shape, -1, i32))
    counts = jnp.stack([jnp.sum(hit | filled, axis=-1), jnp.sum(late, axis=-1), fill_dst, fill_src],
                       axis=-1).astype(i32)
    if kv is not None:
        kv = copy_fills(kv, unit_offset // kv.shape[1], fill_dst, fill_src)
    return SelectPlanOut(
        compact(selm, csum(selm), jnp.broadcast_to(ki, selm.shape), -1),
        compact(early, epos, units, -1), compact(early, epos, lens, 0),
        compact(late, lpos, units, -1), compact(late, lpos, lens, 0),
        compact(late, lpos, slot_block, 0), jnp.concatenate([compact(late, lpos, hrow, 0), counts], axis=-1),
        stamp.at[layer, rows].set(new_st.astype(i32)), key.at[layer, rows].set(new_ky.astype(i32)), kv)
