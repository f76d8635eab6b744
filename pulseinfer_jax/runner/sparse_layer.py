"""Jitted per-layer device steps of the sparse decode pipeline (see sparse_decoder.py for the schedule).

Blocks of the GPU cache `kv: [L, NB, 2, bs, Hkv, hd]` are named by flat *units* `u = layer * NB + block`
(one block of one layer), so one call can touch blocks of any layer mix (dense-layer packs, see
host_offload/placement.py) without slicing a layer out of the cache: reads go through the flat view
`[L * NB, 2, bs, Hkv, hd]` (a free reshape), writes index `(u // NB, u % NB)` of the 6-D cache (see
`_unit_index`). Functions that write the cache donate it (in-place updates).

The model is a static argument (a frozen, hashable `Transformer`); a layer's weights come in as their own
pytree `lp` (one layer, unstacked; every layer has the same structure, so each function compiles once for all
layers, per bucketed shape). Slicing a layer out of the stacked weights inside the call would copy it every
call (measured on CPU: a layer's MLP block 0.31 ms with its own weights, 0.89 ms slicing them). `attention`
picks the attention implementation: "pallas" (the sparse decode kernel; Pallas interpret mode off-GPU) or
"jnp" (its plain-jnp reference). Scoring follows the same switch (`block_scores` kernel or its reference).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from pulseinfer_jax.kv.quant import tokens_per_block, write_tokens
from pulseinfer_jax.models.rope import rope_tables
from pulseinfer_jax.models.transformer import Transformer
from pulseinfer_jax.pallas_kernels.block_metadata import block_key_bounds, take_rows, update_bounds
from pulseinfer_jax.pallas_kernels.block_scoring import (
    append_and_score,
    append_and_score_reference,
    block_scores,
    block_scores_reference,
    default_scale,
)
from pulseinfer_jax.pallas_kernels.merge import merge_attention_partials
from pulseinfer_jax.pallas_kernels.select_plan import copy_fills, select_plan
from pulseinfer_jax.pallas_kernels.sparse_decode_attention import (
    sparse_decode_attention,
    sparse_decode_attention_reference,
)
from pulseinfer_jax.parallel import kernels as tp_kernels
from pulseinfer_jax.runner.sparse_inputs import (
    KeyBounds,
    Landing,
    PlacedRows,
    ScoringBounds,
    SelectSpec,
    SparseLayerRefs,
    SparseRows,
)
from pulseinfer_jax.selection import slot_plan
from pulseinfer_jax.selection.kept_blocks import kept_logical, with_kept_scores
from pulseinfer_jax.selection.policy import (
    BlockScoring,
    resident_mask,
    select_blocks,
    summed_shares,
    top_groups,
    with_middle,
)
from pulseinfer_jax.selection.slot_plan import LayerPlan, SlotStep

Partial = tuple[Array, Array, Array]  # (o [B, Hq, hd], m [B, Hq] f32, l [B, Hq] f32), see pallas_kernels/merge.py


def _flat(kv: Array) -> Array:
    return kv.reshape(kv.shape[0] * kv.shape[1], *kv.shape[2:])


def _attend(attention: str, q: Array, kv: Array, ids: Array, lens: Array, split_k: int | None = None) -> Partial:
    """`split_k`: the kernel's splits (None: its own choice per call); the jnp path has none."""
    if attention == "pallas":  # (per device on its heads under tensor parallelism)
        return tp_kernels.decode_attention(sparse_decode_attention, q, _flat(kv), ids, lens, split_k=split_k)
    return sparse_decode_attention_reference(q, _flat(kv), ids, lens)


def _attend_counted(attention: str, q: Array, kv: Array, ids: Array, lens: Array,
                    arrivals: Int[Array, " N"] | None, split_k: int | None = None) -> tuple[Partial, Array | None]:
    """`_attend` with the kernel's split-merge counters handed in and back (`sparse_decode_attention`'s `arrivals`:
    the driver keeps one buffer, all 0 between calls, so that no memset runs per call); None: the kernel zeroes
    its own. The jnp path does not read them."""
    if arrivals is None or attention != "pallas":
        return _attend(attention, q, kv, ids, lens, split_k), arrivals
    *partial, arrivals = tp_kernels.decode_attention(sparse_decode_attention, q, _flat(kv), ids, lens, arrivals,
                                                     split_k=split_k)
    return tuple(partial), arrivals


def _unit_index(kv: Array, units: Array) -> tuple[Array, Array]:
    """Flat units -> (layer, block) indices into the 6-D cache. Writes index the cache this way: a scatter
    into the reshaped flat view makes XLA:CPU copy the whole (donated) cache (measured: 82 ms vs 0.4 ms)."""
    return units // kv.shape[1], units % kv.shape[1]


def _qkv_and_write(model: Transformer, lp: dict, kv: Array, x: Array, positions: Array,
                   write_unit: Array) -> tuple[Array, Float[Array, "B Hq hd"]]:
    """Project one layer (weights `lp`), write each row's new K/V at flat unit `write_unit[b]`, slot
    positions % bs. Returns (kv, q)."""
    cos, sin = rope_tables(model.cfg, positions[:, None])
    q, k, v = model.layer_qkv(lp, x, cos, sin)  # [B, 1, H, hd]
    li, bi = _unit_index(kv, write_unit)
    kv = write_tokens(kv, li, bi, positions % tokens_per_block(kv), k[:, 0], v[:, 0])  # (float8: quantised here)
    return kv, q[:, 0]


@functools.partial(jax.jit, static_argnames=("model",))
def embed(model: Transformer, params: dict, tokens: Int[Array, " B"]) -> Float[Array, "B 1 D"]:
    return model.embed(params, tokens[:, None])


@functools.partial(jax.jit, static_argnames=("model",))
def logits(model: Transformer, params: dict, x: Float[Array, "B 1 D"]) -> Float[Array, "B V"]:
    return model.logits(params, x[:, 0])


@functools.partial(jax.jit, static_argnames=("model", "attention", "split_k"), donate_argnames=("kv", "arrivals"))
def dense_layer(
    model: Transformer,
    lp: dict,
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    x: Float[Array, "B 1 D"],
    positions: Int[Array, " B"],
    write_unit: Int[Array, " B"],
    ids: Int[Array, "B 1 K"],
    lens: Int[Array, "B 1 K"],
    placed: PlacedRows | None = None,
    unit_offset: Int[Array, ""] | None = None,
    arrivals: Int[Array, " N"] | None = None,
    *,
    attention: str,
    split_k: int | None = None,
) -> tuple[Array, Float[Array, "Bt 1 D"], Array | None]:
    """A whole dense layer: write the new token, attend over every listed unit (all of the sequence), MLP. With
    `placed`, x's rows past B are dense-placed requests (this layer's units from `unit_offset`), in the same call.
    `arrivals`: the attention kernel's split-merge counters (`_attend_counted`; `split_k` its splits). Returns (kv, x,
    arrivals)."""
    if placed is not None:
        ids_d, write_d = _placed_units(placed, unit_offset, tokens_per_block(kv))
        positions, write_unit = _rows(positions, placed.positions), _rows(write_unit, write_d)
        width = max(ids.shape[2], ids_d.shape[2])
        ids = _rows(*(jnp.pad(a, ((0, 0), (0, 0), (0, width - a.shape[2])), constant_values=-1) for a in (ids, ids_d)))
        lens = _rows(*(jnp.pad(a, ((0, 0), (0, 0), (0, width - a.shape[2]))) for a in (lens, placed.lens)))
    kv, q = _qkv_and_write(model, lp, kv, x, positions, write_unit)
    (o, _, _), arrivals = _attend_counted(attention, q, kv, ids, lens, arrivals, split_k)
    return kv, model.layer_finish(lp, x, o[:, None]), arrivals


def _rows(*parts: Array) -> Array:
    return jnp.concatenate(parts, axis=0)


def _placed_units(placed: PlacedRows, unit_offset: Int[Array, ""], block_size: int
                  ) -> tuple[Int[Array, "bd 1 mb"], Int[Array, " bd"]]:
    """Dense-placed rows' flat units in the layer at `unit_offset`: every table entry with tokens (-1: none), and the
    one the new token goes to."""
    ids = jnp.where(placed.lens > 0, unit_offset + placed.tables[:, None, :], -1)
    newest = jnp.take_along_axis(placed.tables, (placed.positions // block_size)[:, None], axis=1)[:, 0]
    return ids, unit_offset + newest


def two_level_scores(score_fn, q, meta_min, meta_max, cand, cmeta_min, cmeta_max, cand_groups, *, keep: int,
                      scoring: BlockScoring, per_head: bool, scale: float) -> Float[Array, "B S K"]:
    """Two-level scoring (BlockScoring.coarse_group): score the groups from their bounds (`cand_groups`: metadata row
    of each sequence's group of blocks, -1 = no scored block), keep the best `keep` (`policy.top_groups`), score only
    their blocks (`cand`: metadata row of each logical block, -1 = none) and return every candidate's score, -inf
    for the blocks of the groups not kept: [B, S, K]. Reads KG + keep * group metadata rows instead of K."""
    f = scoring.coarse_group
    b, k = cand.shape
    coarse = score_fn(q, cmeta_min, cmeta_max, cand_groups, per_head=per_head, beta=scoring.beta, sub_blocks=1,
                      scale=scale)  # [B, S, KG]
    groups = top_groups(coarse, keep, scale)  # [B, keep]
    logical = jnp.where(groups[:, :, None] >= 0, groups[:, :, None] * f + jnp.arange(f), -1).reshape(b, -1)
    inside = (logical >= 0) & (logical < k)
    rows = jnp.where(inside, jnp.take_along_axis(cand, jnp.clip(logical, 0, k - 1), axis=1), -1)  # [B, keep * f]
    fine = score_fn(q, meta_min, meta_max, rows, per_head=per_head, beta=scoring.beta, sub_blocks=scoring.sub_blocks,
                    scale=scale)  # [B, S, keep * f]
    target = jnp.where(rows >= 0, logical, k)  # the other entries land in a dropped column
    out = jnp.full((b, fine.shape[1], k + 1), -jnp.inf, jnp.float32)
    out = out.at[jnp.arange(b)[:, None, None], jnp.arange(fine.shape[1])[None, :, None], target[:, None, :]].set(
        fine.astype(jnp.float32))
    return out[:, :, :k]


@functools.partial(jax.jit, static_argnames=("model", "spec"), donate_argnames=("kv", "bounds", "slot_state"))
def sparse_pre(
    model: Transformer,
    lp: dict,
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    x: Float[Array, "B 1 D"],
    bounds: ScoringBounds,
    slot_state: tuple[Int[Array, "SL R S C"], Int[Array, "SL R S C"]],
    rows: SparseRows,
    step: SlotStep,
    layer: SparseLayerRefs,
    *,
    spec: SelectSpec,
) -> tuple[Array, ScoringBounds, Float[Array, "B Hq hd"], tuple[Array, Array], LayerPlan, Int[Array, "B S N"]]:
    """A sparse layer up to attention (`_select_and_plan`), for the drivers that read the plan before attending."""
    return _select_and_plan(model, lp, kv, x, bounds, slot_state, rows, step, layer, spec=spec)


@functools.partial(jax.jit, static_argnames=("model", "spec", "attention", "fan", "split_k"),
                   donate_argnames=("kv", "bounds", "slot_state", "arrivals"))
def ahead_layer(
    model: Transformer,
    lp: dict,
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    x: Float[Array, "B 1 D"],
    bounds: ScoringBounds,
    slot_state: tuple[Int[Array, "SL R S C"], Int[Array, "SL R S C"]],
    rows: SparseRows,
    step: SlotStep,
    layer: SparseLayerRefs,
    landing: Landing | None,
    placed: PlacedRows | None = None,
    arrivals: Int[Array, " N"] | None = None,
    *,
    spec: SelectSpec,
    attention: str,
    fan: int = 1,
    split_k: int | None = None,
) -> tuple[Array, ScoringBounds, Float[Array, "Bt 1 D"], tuple[Array, Array], LayerPlan, Int[Array, "B S N"],
           Array | None]:
    """A whole sparse layer with its recall one step ahead (`recall="ahead"`), in one call that never waits on the
    host: land the recall the previous step issued for this layer (`landing`, None = nothing), select and plan
    (`_select_and_plan`; `step.spare` set), copy the miss on the block that just left the window from its spare GPU
    block into its slot, attend over the resident blocks, the slot-cache hits and that fill, o-proj and MLP. The
    plan's other misses are not attended now: the caller recalls them after dispatching the step, for this layer's
    next call. With `placed`, x's rows past the offloaded ones are dense-placed requests: projected, written and
    finished with them (one pass over the weights), each attending its whole block table. `arrivals`: the attention
    kernel's split-merge counters (`_attend_counted`; `split_k` its splits). Returns (kv, key bounds, x, slot state,
    plan, selection, arrivals)."""
    if landing is not None:
        kv = _land(kv, layer.unit_offset // kv.shape[1], landing.misses, landing.info, landing.staging, fan)
        if attention != "pallas":  # (XLA:CPU fused the landing into the token write's flat view and then copied the
            kv = jax.lax.optimization_barrier(kv)  # whole cache first: 98 MB a call with SmolLM2's pool)
    if placed is None:
        kv, bounds, q, slot_state, plan, sel = _select_and_plan(model, lp, kv, x, bounds, slot_state, rows, step,
                                                                layer, spec=spec)
        (o, _, _), arrivals = _attend_counted(attention, q, kv, plan.early[0], plan.early[1], arrivals, split_k)
    else:
        b = rows.positions.shape[0]
        ids_d, write_d = _placed_units(placed, layer.unit_offset, tokens_per_block(kv))
        kv, q_all = _qkv_and_write(model, lp, kv, x, _rows(rows.positions, placed.positions),
                                   _rows(_window_unit(rows, layer), write_d))
        q = q_all[:b]
        kv, bounds, slot_state, plan, sel = _plan(model, kv, q, bounds, slot_state, rows, step, layer, spec=spec)
        (o, _, _), arrivals = _attend_counted(attention, q, kv, plan.early[0], plan.early[1], arrivals, split_k)
        (o_d, _, _), arrivals = _attend_counted(attention, q_all[b:], kv, ids_d, placed.lens, arrivals, split_k)
        o = _rows(o, o_d)
    # (the fill is done: not an output, so its per-lane halves are never materialised)
    return (kv, bounds, model.layer_finish(lp, x, o[:, None]), slot_state, dataclasses.replace(plan, fill=None), sel,
            arrivals)


def _select_and_plan(
    model: Transformer,
    lp: dict,
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    x: Float[Array, "B 1 D"],
    bounds: ScoringBounds,
    slot_state: tuple[Int[Array, "SL R S C"], Int[Array, "SL R S C"]],
    rows: SparseRows,
    step: SlotStep,
    layer: SparseLayerRefs,
    *,
    spec: SelectSpec,
) -> tuple[Array, ScoringBounds, Float[Array, "B Hq hd"], tuple[Array, Array], LayerPlan, Int[Array, "B S N"]]:
    """A sparse layer up to attention: write the new token into its window block (GPU block `rows.newest`, -1 for a
    padding row: the null block), add its key to its block's key bounds and score every candidate block from its
    bounds, in one kernel (`block_scoring.append_and_score`: metadata rows `layer.meta_offset +
    rows.candidates.rows`, -1 = none, `scoring.sub_blocks` rows each; the sinks and window among them where the
    variant counts their mass, `spec.scores_kept`), and select. GPU block g of this layer is flat unit
    `layer.unit_offset + g` (layer * NB + g); `rows` and `step` are the same for every layer of a step, only `layer`
    (device scalars) changes. Where `spec.favours_resident`, the
    logical blocks in this layer's slot caches (the slot state `(stamp, key)` of sparse layer `layer.index`, rows
    `step.rows`, see slot_plan.py) get the resident-block bonus. Then the slot-cache plan of the selection
    (`slot_plan.layer_plan`, `spec.plan_mode`), which updates the slot state. With `spec.fused` (the Pallas backend's
    recall plans) selection and plan run as one kernel (`pallas_kernels.select_plan`, the same rules).
    `step.override[layer.index]` ([B, S, M]) forces each lane's middle blocks (the throughput bench's replayed
    selections; sinks and window stay the scorer's), or keeps the scorer's where it holds `SCORER`
    (`policy.with_middle`): data, so a replayed step runs the same programs as the engine's own.
    With `spec.coarse` > 0 (two-level scoring, `BlockScoring.coarse_group`) the groups are scored first from their
    bounds (coarse rows `layer.coarse_offset + rows.candidates.groups`, -1 = none) and only the best `spec.coarse`
    groups' blocks from their own (`two_level_scores`); else the coarse inputs are not read.

    Returns (kv, key bounds, q, slot state, the layer's plan (slot_plan.layer_plan), selected logical blocks
    [B, S, budget] sorted, -1 padded; see policy.select_blocks)."""
    kv, q = _qkv_and_write(model, lp, kv, x, rows.positions, _window_unit(rows, layer))
    kv, bounds, slot_state, plan, sel = _plan(model, kv, q, bounds, slot_state, rows, step, layer, spec=spec)
    return kv, bounds, q, slot_state, plan, sel


def _window_unit(rows: SparseRows, layer: SparseLayerRefs) -> Int[Array, " B"]:
    """The flat unit each row's new token goes to: its window block in this layer (a padding row: the null block)."""
    return jnp.where(rows.newest >= 0, layer.unit_offset + rows.newest, 0)


def _plan(
    model: Transformer,
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    q: Float[Array, "B Hq hd"],
    bounds: ScoringBounds,
    slot_state: tuple[Int[Array, "SL R S C"], Int[Array, "SL R S C"]],
    rows: SparseRows,
    step: SlotStep,
    layer: SparseLayerRefs,
    *,
    spec: SelectSpec,
) -> tuple[Array, ScoringBounds, tuple[Array, Array], LayerPlan, Int[Array, "B S N"]]:
    """`_select_and_plan` after the projection and the write: the new keys (`rows.append`, read where they were
    written) join their key bounds, then score, select and plan from the rows' queries `q`."""
    scoring, cands = spec.scoring, rows.candidates
    pallas = spec.attention == "pallas"
    score_fn = functools.partial(tp_kernels.block_scores, block_scores) if pallas else block_scores_reference
    append_fn = (functools.partial(tp_kernels.append_and_score, append_and_score) if pallas
                 else append_and_score_reference)
    per_head = spec.per_head
    c = model.cfg
    scale = default_scale(c.head_dim, c.group_size, per_head)
    kw = dict(per_head=per_head, beta=scoring.beta, sub_blocks=scoring.sub_blocks, scale=scale)
    fine = bounds.fine
    if spec.coarse:
        # the keys join their bounds with the always-kept blocks' scores (or none: one padding column), then the
        # groups' pass reads the bounds updated
        kept = (kept_logical(cands.num_blocks, spec.sink, spec.window, xp=jnp) if spec.scores_kept
                else jnp.full((cands.rows.shape[0], 1), -1, jnp.int32))
        at = jnp.clip(kept, 0, cands.rows.shape[1] - 1)
        kept_rows = jnp.where(kept >= 0, jnp.take_along_axis(cands.rows, at, axis=1), -1)
        kept_s, lo, hi = append_fn(q, fine.lo, fine.hi, kept_rows, layer.meta_offset, rows.append, _flat(kv),
                                   layer.unit_offset, **kw)
        fine = KeyBounds(lo, hi)
        cand = jnp.where(cands.rows >= 0, cands.rows + layer.meta_offset, -1)
        groups = jnp.where(cands.groups >= 0, cands.groups + layer.coarse_offset, -1)
        scores = two_level_scores(score_fn, q, fine.lo, fine.hi, cand, bounds.coarse.lo, bounds.coarse.hi, groups,
                                  keep=spec.coarse, scoring=scoring, per_head=per_head,
                                  scale=scale)  # [B, Hq or Hkv, K]
        if spec.scores_kept:
            scores = with_kept_scores(scores, kept_s, kept)
    else:
        scores, lo, hi = append_fn(q, fine.lo, fine.hi, cands.rows, layer.meta_offset, rows.append, _flat(kv),
                                   layer.unit_offset, **kw)  # [B, Hq or Hkv, K]
        fine = KeyBounds(lo, hi)
    bounds = dataclasses.replace(bounds, fine=fine)
    stamp, key = slot_state
    if spec.fused:  # selection and slot plan in one kernel (the rules of select_blocks + layer_plan below)
        select = spec.select
        if select == "normalized_sum" and tp_kernels.tp_size() > 1:  # heads split over devices: sum them first
            scores, select = summed_shares(scores, cands.num_blocks, scale), "summed"
        # the spare fill's copy inside the kernel too (one device: under tensor parallelism the cache is split by
        # head and the replicated kernel must not gather it)
        in_kernel_fill = step.spare is not None and tp_kernels.tp_size() == 1
        out = tp_kernels.replicated(
            select_plan, scores, cands.num_blocks, stamp, key, layer.index, step.rows, step.capacity, step.gpu,
            step.host, step.slots, step.lengths, layer.unit_offset, step.spare, layer.retrieval_head, None,
            kv if in_kernel_fill else None, step.override, budget=spec.budget, sink=spec.sink, window=spec.window,
            select=select, scale=scale, bonus=scoring.resident_bonus if spec.favours_resident else 0.0,
            block_size=tokens_per_block(kv))
        stamp, key, sel = out.stamp, out.key, out.sel
        plan = slot_plan.fused_layer_plan(out, step.spare is not None)  # (no fill left when the kernel copied it)
        kv = kv if out.kv is None else out.kv
    else:
        resident = None
        if spec.favours_resident:
            resident = resident_mask(key[layer.index, step.rows, 0], scores.shape[2])  # [B, C] -> [B, K]
        sel = select_blocks(scores, cands.num_blocks, budget_blocks=spec.budget, sink_blocks=spec.sink,
                            window_blocks=spec.window, mode=spec.mode, solohead=spec.solohead,
                            retrieval_head=layer.retrieval_head, score_scale=scale, resident=resident,
                            resident_bonus=scoring.resident_bonus)
        if step.override is not None:
            sel = with_middle(sel, jax.lax.dynamic_index_in_dim(step.override, layer.index, 0, keepdims=False),
                              cands.num_blocks, spec.sink, spec.window)
        stamp, key, plan = slot_plan.layer_plan(stamp, key, layer.index, sel, step, layer.unit_offset,
                                                block_size=tokens_per_block(kv), sink=spec.sink, window=spec.window,
                                                mode=spec.plan_mode)
    if plan.fill is not None:  # (`step.spare`) the block that just left the window: GPU copy
        kv = copy_fills(kv, layer.unit_offset // kv.shape[1], *plan.fill)
    return kv, bounds, (stamp, key), plan, sel


@functools.partial(jax.jit, static_argnames=("attention", "split_k"))
def attend(
    q: Float[Array, "B Hq hd"],
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    entries: tuple[Int[Array, "B S K"], Int[Array, "B S K"]],
    *,
    attention: str,
    split_k: int | None = None,
) -> Partial:
    """Partial attention (o, m, l) over the listed flat units: `entries` = (unit ids (-1 = padding), valid tokens),
    a list of a layer's plan (slot_plan.layer_plan); `split_k`: the kernel's splits (None: its choice)."""
    return _attend(attention, q, kv, entries[0], entries[1], split_k)


@functools.partial(jax.jit, static_argnames=("model", "attention", "width", "fan", "split_k"),
                   donate_argnames=("kv",))
def land_attend_finish(
    model: Transformer,
    lp: dict,
    x: Float[Array, "B 1 D"],
    q: Float[Array, "B Hq hd"],
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    layer: Int[Array, ""],
    plan: LayerPlan,
    staging: Float[Array, "n 2 bs Hkv hd"] | Float[Array, "n 2 bs hd"] | None,
    early: Partial | None,
    late_rows: Bool[Array, " B"] | None = None,
    *,
    attention: str,
    width: int,
    fan: int = 1,
    split_k: int | None = None,
) -> tuple[Array, Float[Array, "B 1 D"]]:
    """The rest of a sparse layer, in one call, from its plan (`slot_plan.layer_plan`, on the device): land the
    recall `staging` (if given) in its slots of `layer`, attend over the late entries (the misses, the first `width`
    of each lane; `width` 0: none) merged with the early partial through the softmax residuals, then o-proj and MLP.
    `early` is the partial over the early entries (resident blocks and hits) computed while the recall was in
    flight, or None: then it is computed here (synchronous recall, or nothing to recall).

    `staging` holds whole blocks [n, 2, bs, Hkv, hd] (SoloHead, coalesced), or (block, head) units [n, 2, bs, hd]:
    unit i is miss i // `fan`, head i % `fan` (SoloHead, fragmented: fan = Hkv) or the miss's lane (headwise,
    fan = 1). Rows past the misses are padding: they land in the null block 0. `late_rows` (recall ahead's first step
    of a request): only these rows attend their misses now. `split_k`: the kernel's splits (None: its choice).
    Returns (kv, x)."""
    if staging is not None:
        kv = _land(kv, layer, plan.misses, plan.info, staging, fan)
    if early is None:
        early = _attend(attention, q, kv, plan.early[0], plan.early[1], split_k)
    parts = [early]
    if width:
        ids, lens = (a[..., :width] for a in plan.late)
        if late_rows is not None:  # the other rows attend their misses from the next step (recall ahead's schedule)
            lens = jnp.where(late_rows[:, None, None], lens, 0)
        parts.append(_attend(attention, q, kv, ids, lens, split_k))
    o = parts[0][0] if len(parts) == 1 else merge_attention_partials(parts)[0]
    return kv, model.layer_finish(lp, x, o[:, None])


def _land(kv: Array, layer: Int[Array, ""], misses: Int[Array, "B S N"], info: Int[Array, "B S M"],
          staging: Float[Array, "n 2 bs Hkv hd"] | Float[Array, "n 2 bs hd"], fan: int) -> Array:
    """Write a recall's staging into its slots of `layer`: the plan's misses in row / lane / selection order (lane
    (b, s) holds `info[b, s, -3]` of them, their slot blocks `misses[b, s]`), as whole blocks [n, 2, bs, Hkv, hd] or
    (block, head) units [n, 2, bs, hd] (unit i: miss i // `fan`, head i % `fan`; headwise, fan 1: the miss's lane).
    Rows past the misses are padding and land in the null block 0."""
    n = staging.shape[0]
    b, s, width = misses.shape
    counts = info[:, :, -3].reshape(-1)  # [B * S]
    ends = jnp.cumsum(counts)
    entry = jnp.arange(n) // fan
    lane = jnp.minimum(jnp.sum(ends[None, :] <= entry[:, None], axis=1), b * s - 1)  # the lane each entry is from
    at = jnp.clip(entry - (ends[lane] - counts[lane]), 0, width - 1)
    real = entry < ends[-1]
    blocks = jnp.where(real, misses.reshape(b * s, width)[lane, at], 0)
    if staging.ndim == 5:
        return kv.at[layer, blocks].set(staging.astype(kv.dtype))
    heads = jnp.arange(n) % fan if fan > 1 else lane % s
    return kv.at[layer, blocks, :, :, jnp.where(real, heads, 0)].set(staging.astype(kv.dtype))


@functools.partial(jax.jit, static_argnames=("fan",), donate_argnames=("kv",))
def land(kv: Float[Array, "L NB 2 rows Hkv hd"], layer: Int[Array, ""], landing: Landing, *, fan: int = 1) -> Array:
    """A recall issued ahead, landed on its own (`SparseDecoder.land_pending`): its blocks into their slots."""
    return _land(kv, layer, landing.misses, landing.info, landing.staging, fan)


@functools.partial(jax.jit, donate_argnames=("kv",))
def copy_units(kv: Float[Array, "L NB 2 rows Hkv hd"], src: Int[Array, " n"], dst: Int[Array, " n"]) -> Array:
    """Flat unit copy kv[dst[i]] = kv[src[i]] (padding: src = dst = 0, the null block of layer 0)."""
    return kv.at[_unit_index(kv, dst)].set(kv[_unit_index(kv, src)])


@functools.partial(jax.jit, static_argnames=("sub_blocks",), donate_argnames=("bounds",))
def refresh_meta(
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    bounds: KeyBounds,
    units: Int[Array, " n"],
    lens: Int[Array, " n"],
    rows: Int[Array, " n"],
    *,
    sub_blocks: int = 1,
) -> KeyBounds:
    """Key bounds of flat units `units` (first `lens` tokens) into metadata blocks `rows` (-1 = skip): block r
    owns rows r * sub_blocks + j, one per token slice j."""
    kmin, kmax = block_key_bounds(_flat(kv), units, lens, sub_blocks=sub_blocks)  # [n * m, Hkv, hd]
    m = sub_blocks
    dst = jnp.where(rows[:, None] >= 0, rows[:, None] * m + jnp.arange(m), -1).reshape(-1)
    return KeyBounds(*update_bounds(bounds.lo, bounds.hi, dst, kmin, kmax))


@functools.partial(jax.jit, static_argnames=("sub_blocks",), donate_argnames=("coarse",))
def refresh_coarse(
    fine: KeyBounds,
    coarse: KeyBounds,
    members: Int[Array, "n F"],
    rows: Int[Array, " n"],
    *,
    sub_blocks: int = 1,
) -> KeyBounds:
    """Two-level scoring's group bounds: coarse row `rows[i]` (-1 = skip) = the element-wise min / max over the
    metadata blocks `members[i]` (-1 = not a member; `sub_blocks` rows each) of their bounds. Exact: the min / max of
    values stored in the metadata dtype is one of them."""
    m = sub_blocks
    idx = jnp.where(members >= 0, members, 0)[:, :, None] * m + jnp.arange(m)  # [n, F, m]
    member = (members >= 0)[:, :, None, None, None]
    lo = jnp.where(member, take_rows(fine.lo, idx).astype(jnp.float32), jnp.inf).min(axis=(1, 2))  # [n, Hkv, hd]
    hi = jnp.where(member, take_rows(fine.hi, idx).astype(jnp.float32), -jnp.inf).max(axis=(1, 2))
    return KeyBounds(*update_bounds(coarse.lo, coarse.hi, rows, lo, hi))
