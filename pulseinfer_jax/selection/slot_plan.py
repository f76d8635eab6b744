"""Slot-cache planning on the device: the `SlotTable` contract (selection/slot_table.py, the numpy reference)
in jnp, fused into a sparse layer's selection call (`sparse_layer.sparse_pre` / `ahead_layer`); the Pallas backend
runs the selection and this plan as one kernel (`pallas_kernels/select_plan.py`) and `fused_layer_plan` assembles its
`LayerPlan`.

Why on the device: a decode step plans every sparse layer of every request. Done on the host (numpy over the
micro-batch) it costs a few hundred microseconds per layer in fixed per-call overhead (`bench/host_overhead.py`),
which on a GPU sits between the layer's selection and its attention; here it is a few small fused ops, and the
host only reads back what it must act on: the misses' host rows (to gather) and per-lane counts.

State (one array pair for every sparse layer, table row = request, lane = KV head for headwise, 0 for SoloHead):
    stamp [SL, R, S, C] int32  recency rank of each slot, 0 = next victim; free slots rank lowest, in slot order
    key   [SL, R, S, C] int32  logical block held by each slot, -1 = free
Ranks are recomputed every plan (no clock to overflow): the slots neither hit nor filled keep their order, then
come this step's hits (in selection order), then its misses (in selection order), exactly the reference's order.
Slots at or past a request's capacity are never victims.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from pulseinfer_jax.pallas_kernels.select_plan import SelectPlanOut

IntArray = Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotStep:
    """A step's inputs to every sparse layer's plan (host-built: `sparse_inputs.slot_step_inputs`), per batch row."""

    rows: Int[IntArray, " B"]  # slot-table row of each batch row (padding rows: the table's last row)
    capacity: Int[IntArray, " B"]  # its slot-cache size
    gpu: Int[IntArray, "B K"]  # GPU block of each resident logical block, -1 = not resident
    host: Int[IntArray, "B K"]  # host row of each logical block
    slots: Int[IntArray, "B C"]  # GPU block of each slot
    lengths: Int[IntArray, " B"]  # tokens (0 for padding rows)
    # the middle blocks a replayed trace selects instead of the scorer ([sparse layers, B, lanes, M], -1 padded)
    override: Int[IntArray, "SL B S M"] | None = None
    # step-ahead recall: the logical block that just left each row's window and still sits whole in its spare GPU
    # block (-1 = none), and that block; a miss on it is filled on the GPU instead of recalled
    spare: tuple[Int[IntArray, " B"], Int[IntArray, " B"]] | None = None

    def on(self, device: jax.Device | jax.sharding.Sharding) -> SlotStep:
        return jax.tree.map(lambda a: jax.device_put(a, device), self)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """A sparse layer's slot-cache plan (`layer_plan`): its attention entries, its misses and what the host reads."""

    early: tuple[Int[Array, "B S N"], Int[Array, "B S N"]]  # (units, valid tokens) of resident blocks and hits
    late: tuple[Int[Array, "B S N"], Int[Array, "B S N"]]  # the same for the misses (recalled into their slots)
    misses: Int[Array, "B S N"]  # each lane's misses' slot blocks, in selection order, 0 padded: where recalls land
    # what the host reads in one copy, per lane: the misses' host rows (selection order, 0 padded), then hits (GPU
    # fills included), misses, the fill's slot block and its source block (-1 = none)
    info: Int[Array, "B S M"]  # M = N + 4
    # with `SlotStep.spare`: (slot block, spare block) per row and lane of the miss filled on the GPU, -1 = none
    fill: tuple[Int[Array, "B S"], Int[Array, "B S"]] | None = None


def init_state(sparse_layers: int, table_rows: int, lanes: int, capacity: int) -> tuple[Array, Array]:
    """Every slot of every row free: (stamp, key)."""
    shape = (sparse_layers, table_rows, lanes, capacity)
    return (jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), shape), jnp.full(shape, -1, jnp.int32))


@jax.jit
def reset_rows(stamp: Int[Array, "SL R S C"], key: Int[Array, "SL R S C"],
               rows: Int[Array, " n"]) -> tuple[Array, Array]:
    """Free every slot of table rows `rows` (a new request; out-of-range entries are padding)."""
    c = stamp.shape[-1]
    stamp = stamp.at[:, rows].set(jnp.arange(c, dtype=jnp.int32), mode="drop")
    return stamp, key.at[:, rows].set(-1, mode="drop")


def _rank(values: Int[Array, "... C"], among: Bool[Array, "... C"] | None = None) -> Int[Array, "... C"]:
    """Per entry, how many entries of its row (those in `among`, default all) hold a smaller value: its position in
    the row sorted ascending where the values are distinct. Compare-and-count: one fused reduction on a GPU where a
    sort is several kernels (C is a slot cache or a selection, a few hundred at most)."""
    less = values[..., None, :] < values[..., :, None]  # [..., i, j]: value j < value i
    if among is not None:
        less = less & among[..., None, :]
    return less.sum(axis=-1, dtype=jnp.int32)


def _place(dest: Int[Array, "... N"], values: Int[Array, "... N"], size: int, fill: int) -> Int[Array, "... P"]:
    """out[..., p] = values[..., i] for the entry i with dest[..., i] == p (dests distinct; others ignored), `fill`
    where no entry lands: a scatter written as one fused select-and-reduce (`values` >= fill)."""
    at = dest[..., None, :] == jnp.arange(size)[:, None]  # [..., p, i]
    return jnp.max(jnp.where(at, values[..., None, :], fill), axis=-1, initial=fill)


def plan(stamp: Int[Array, "SL R S C"], key: Int[Array, "SL R S C"], layer: Int[Array, ""], rows: Int[Array, " B"],
         capacity: Int[Array, " B"], wanted: Int[Array, "B S N"]
         ) -> tuple[Array, Array, Int[Array, "B S N"], Bool[Array, "B S N"]]:
    """Sparse layer `layer`'s plan for the requests in table rows `rows` (each row at most once; padding rows must
    name a row no real request uses and want nothing): `wanted` are the middle blocks each lane needs (distinct,
    -1 = none; at most `capacity` per lane, which the caller guarantees: the selection's middle part never exceeds
    it). Returns (stamp, key, slot of each wanted block (-1 for none), hit), the state updated in place (one gather
    and one scatter of the rows). Misses are the wanted blocks that are not hits; each took the slot returned for
    it. Written with compare-and-count reductions instead of sorts and scatters (a dozen small kernels fewer per
    sparse layer on a GPU); the slot stamps of a lane are a permutation of 0..C-1, which makes every rank exact."""
    c = stamp.shape[-1]
    st, ky = stamp[layer, rows], key[layer, rows]  # [B, S, C]
    valid = wanted >= 0
    eq = (wanted[..., :, None] == ky[..., None, :]) & valid[..., None]  # [B, S, N, C]
    hit = eq.any(axis=-1)
    pos = jnp.argmax(eq, axis=-1).astype(jnp.int32)
    miss = valid & ~hit
    held = eq.any(axis=-2)  # [B, S, C] slots hit now
    # victims: the free slots (neither hit now nor past the capacity) by rank, the i-th miss takes the i-th
    free = ~held & (jnp.arange(c) < capacity[:, None, None])
    free_rank = _rank(st, free)
    rank = jnp.cumsum(miss, axis=-1, dtype=jnp.int32) - 1
    takes = miss[..., :, None] & free[..., None, :] & (free_rank[..., None, :] == rank[..., :, None])  # [B, S, N, C]
    victim = jnp.argmax(takes, axis=-1).astype(jnp.int32)
    slot = jnp.where(hit, pos, jnp.where(miss, victim, -1))
    # per slot, what lands in it (each slot is hit or filled by at most one wanted block): its new key and a value
    # whose rank is its new stamp. Untouched slots keep their order below this step's hits, then its misses (hits
    # and misses in selection order; all values distinct)
    hit_rank = jnp.cumsum(hit, axis=-1, dtype=jnp.int32) - 1
    new_key = jnp.max(jnp.where(takes, wanted[..., :, None], -1), axis=-2)  # [B, S, C], -1 = not filled
    order = jnp.max(jnp.where(takes, 2 * c + rank[..., :, None], jnp.where(eq, c + hit_rank[..., :, None], -1)),
                    axis=-2)
    new_ky = jnp.where(new_key >= 0, new_key, ky)
    comp = jnp.where(order >= 0, order, st)
    new_st = _rank(comp)
    return stamp.at[layer, rows].set(new_st), key.at[layer, rows].set(new_ky), slot, hit


def layer_plan(stamp: Int[Array, "SL R S C"], key: Int[Array, "SL R S C"], layer: Int[Array, ""],
               sel: Int[Array, "B S N"], step: SlotStep, unit_offset: Int[Array, ""], *, block_size: int,
               sink: int, window: int, mode: str) -> tuple[Array, Array, LayerPlan]:
    """Sparse layer `layer`'s selection -> its slot-cache plan, attention entries and miss lists, on the device.

    `sel`: the selected logical blocks per row and lane (-1 = none); `step`: the step's `SlotStep` (the same for every
    layer of a step). GPU block g of this layer is flat unit `unit_offset + g`.
    mode: "recall" (offloaded: every selected block that is not resident is looked up in the slot cache, misses
    are recalled), "bookkeep" (every block resident; the slot caches still track what "recall" would hold, for the
    resident-block bonus), "none" (every block resident, no slot caches).

    Returns (stamp, key, `LayerPlan`): the entry lists in selection order, padded with (-1, 0); per lane its misses'
    slot blocks and, in `info` (read by the host in one copy, `recall_lanes`), the counts and the misses' host rows.
    Misses are recalled and landed in row / lane / selection order.
    """
    b, s, n = sel.shape
    valid = sel >= 0
    safe = jnp.clip(sel, 0, step.gpu.shape[1] - 1)
    ri = jnp.arange(b)[:, None, None]
    gpu = step.gpu[ri, safe]
    resident = valid & (gpu >= 0)
    lengths = step.lengths[:, None, None]
    if mode == "none":
        hit = miss = jnp.zeros_like(valid)
        slot = jnp.full(sel.shape, -1, jnp.int32)
    else:
        if mode == "recall":
            wanted = valid & ~resident
        else:  # bookkeep: the blocks "recall" would look up (neither sink nor window)
            nblk = -(-lengths // block_size)
            wanted = valid & (sel >= sink) & (sel < nblk - window)
        stamp, key, slot, hit = plan(stamp, key, layer, step.rows, step.capacity, jnp.where(wanted, sel, -1))
        if mode == "bookkeep":
            hit = jnp.zeros_like(valid)
        miss = wanted & ~hit if mode == "recall" else jnp.zeros_like(valid)
    slot_block = step.slots[ri, jnp.clip(slot, 0, step.slots.shape[1] - 1)]
    fill, filled = None, jnp.zeros_like(valid)
    if step.spare is not None and mode == "recall":
        # a miss on the block that just left the window is copied from its spare GPU block into its slot (the
        # caller does it before attending), not recalled: at most one per row and lane
        spare_block, spare_gpu = (a[:, None, None] for a in step.spare)
        filled = miss & (sel == spare_block) & (spare_block >= 0)
        # (materialised here: fused into the miss lists' reductions they spill registers at 256 blocks, H200)
        miss, filled = jax.lax.optimization_barrier((miss & ~filled, filled))
        fill = (jnp.max(jnp.where(filled, slot_block, -1), axis=-1),
                jnp.max(jnp.where(filled, jnp.broadcast_to(spare_gpu, sel.shape), -1), axis=-1))  # [B, S] each
    units = jnp.where(resident, unit_offset + gpu, unit_offset + slot_block)
    lens = jnp.where(resident, jnp.clip(lengths - sel * block_size, 0, block_size), block_size)
    # early = resident + hits (+ GPU fills) (resident first, then the rest), late = misses; both in selection
    # order, compacted to the front: each entry's place is its rank among the entries taken (one [2, B, S, N] pass)
    pos = jnp.arange(n)
    early = resident | hit | filled
    take = jnp.stack([early, miss])
    order = jnp.stack([jnp.where(resident, 0, n) + pos, jnp.broadcast_to(pos, sel.shape)])
    dest = jnp.where(take, _rank(order, take), n)
    entries = jnp.stack([_place(dest, jnp.broadcast_to(units, take.shape), n, -1),
                         _place(dest, jnp.broadcast_to(lens, take.shape), n, 0)], axis=1)  # [2 lists, 2, B, S, N]
    # per lane: the misses' slot blocks and host rows in selection order (the late list's places), and the counts
    host = step.host[ri, safe]
    miss_slots = _place(dest[1], slot_block, n, 0)
    miss_hosts = _place(dest[1], host, n, 0)
    fills = fill if fill is not None else (jnp.full((b, s), -1, jnp.int32),) * 2
    counts = jnp.stack([(hit | filled).sum(axis=-1), miss.sum(axis=-1), *fills], axis=-1).astype(jnp.int32)
    info = jnp.concatenate([miss_hosts.astype(jnp.int32), counts], axis=-1)  # [B, S, N + 4]
    # each list as its own (units, valid tokens) arrays: the attention kernel takes them as separate operands (a
    # stacked [2, ...] array would be sliced into copies by every consumer)
    early_list = (entries[0, 0], entries[0, 1])
    late_list = (entries[1, 0], entries[1, 1])
    return stamp, key, LayerPlan(early_list, late_list, miss_slots.astype(jnp.int32), info, fill)


def fused_layer_plan(out: SelectPlanOut, spare: bool) -> LayerPlan:
    """The `LayerPlan` of a fused selection and plan (`pallas_kernels.select_plan`, the same rules as `layer_plan` in
    "recall" mode): its lists and info as they are; `fill` for the caller to copy unless the kernel did (`out.kv`)."""
    fill = (out.info[..., -2], out.info[..., -1]) if spare and out.kv is None else None
    return LayerPlan((out.early_units, out.early_lens), (out.late_units, out.late_lens), out.miss_slot, out.info, fill)


def step_recall(info: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A step's plans as the host reads them (every sparse layer's `LayerPlan.info`, numpy [SL, B, S, N + 4]): the
    (sparse layer, host row, lane) of each miss, in layer / row / lane / selection order (each layer's part as
    `recall_lanes` gives it), and the misses per sparse layer."""
    n = info.shape[3] - 4
    taken = np.arange(n) < info[..., -3:-2]  # [SL, B, S, N]
    layer, _, lane, _ = np.nonzero(taken)
    return (layer.astype(np.int32), info[..., :n][taken], lane.astype(np.int32),
            taken.sum(axis=(1, 2, 3)).astype(np.int64))


def recall_lanes(info: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A plan's misses as the host reads them (`LayerPlan.info`, numpy [B, S, N + 4]): (host row, lane) of each, in
    row / lane / selection order, the order recalls are staged and landed in (`sparse_layer._land`)."""
    _, rows, lanes, _ = step_recall(info[None])
    return rows, lanes
