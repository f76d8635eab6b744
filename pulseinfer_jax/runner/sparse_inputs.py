"""What a sparse layer's selection call (`sparse_layer.sparse_pre`) reads, grouped by how long it lives.

- `ScoringBounds`: the engine's key bounds of every sparse layer (block rows, and two-level scoring's group rows);
  every block's rows kept current as its tokens are written (the prompt's at prefill, each decoded key by the
  scoring kernel that reads them, `block_scoring.append_and_score`), read by every step.
- `SparseRows`: one micro-batch's step, the same for each of its sparse layers (host-built by
  `sparse_inputs.micro_batch_inputs`, numpy there, device arrays in the call): the new tokens' positions and window
  blocks, the candidates to score (`Candidates`), where the new keys join the key bounds (`KeyAppend`).
- `SparseLayerRefs`: where one sparse layer's slices sit (device scalars made once per layer), so a step sends no
  per-layer data.
- `SelectSpec`: the static shape of the selection (budget, sinks, window, variant, scoring); part of the compile key.

- `micro_batch_inputs` / `slot_step_inputs`: the one place these shapes and values are made (numpy, on the host):
  the sparse decoder puts them on the device, the ahead-of-time compile check (bench/aot/programs.py) builds the
  same arrays at real sizes and compiles the layer calls for them, so the two cannot drift apart. bp =
  bucket(requests) rows, kc = bucket_blocks(most logical blocks) columns; padding rows want nothing and write into
  the null block.

The array classes are registered dataclass pytrees: a jitted call takes them as they are, with their fields named.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jaxtyping import Array, Float, Int

from pulseinfer_jax.host_offload.placement import SparseKV, SparsePlan
from pulseinfer_jax.kv.blocks import blocks_for, bucket
from pulseinfer_jax.kv.cache import bucket_blocks
from pulseinfer_jax.pallas_kernels.block_scoring import KeyAppend
from pulseinfer_jax.pallas_kernels.select_plan import SCORER
from pulseinfer_jax.selection.policy import BlockScoring
from pulseinfer_jax.selection.slot_plan import SlotStep

IntArray = Array | np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyBounds:
    """Element-wise min / max of the keys of each metadata row (a block's token slice, or a group of blocks)."""

    lo: Float[Array, "R Hkv hd"]
    hi: Float[Array, "R Hkv hd"]

    @property
    def nbytes(self) -> int:
        return self.lo.nbytes + self.hi.nbytes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScoringBounds:
    """The key bounds scoring reads: per block (`fine`, `sub_blocks` rows each) and per group of blocks (`coarse`,
    two-level scoring; a one-row placeholder never read when it is off)."""

    fine: KeyBounds
    coarse: KeyBounds


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Candidates:
    """The blocks a step scores, per batch row: the middle ones (neither sink nor window)."""

    rows: Int[IntArray, "B K"]  # layer-relative metadata (= host) row of each logical block, -1 = not a candidate
    # (the middle blocks; where SoloHead scores the always-kept ones (`BlockScoring.scores_kept`) every block)
    num_blocks: Int[IntArray, " B"]  # logical blocks of each row (0: padding row)
    groups: Int[IntArray, "B G"]  # two-level scoring: layer-relative coarse row of each group, -1 = none


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseRows:
    """One micro-batch's per-step inputs to each of its sparse layers' selection calls (see the module docstring)."""

    positions: Int[IntArray, " B"]  # position of each row's new token (its length - 1)
    newest: Int[IntArray, " B"]  # GPU block of each row's newest logical block (-1: padding row)
    candidates: Candidates
    append: KeyAppend  # where each row's new key joins its block's key bounds (its metadata row and slice)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseLayerRefs:
    """Where sparse layer `index`'s slices sit: offsets of its metadata rows, flat GPU units (layer * NB) and coarse
    rows, and its retrieval head (solohead="retrieval_head")."""

    meta_offset: Int[IntArray, ""]
    unit_offset: Int[IntArray, ""]
    retrieval_head: Int[IntArray, ""]
    index: Int[IntArray, ""]
    coarse_offset: Int[IntArray, ""]

    @staticmethod
    def of(plan: SparsePlan, sparse_layer: int, host_rows: int, gpu_blocks: int, group_rows: int,
           retrieval_head: int = 0) -> SparseLayerRefs:
        """Host values for sparse layer `sparse_layer` of a pool of `host_rows` rows per layer, a GPU cache of
        `gpu_blocks` blocks per layer, and `group_rows` coarse rows per layer."""
        sl = sparse_layer
        return SparseLayerRefs(*(np.int32(v) for v in (
            sl * host_rows, (plan.dense_layers + sl) * gpu_blocks, retrieval_head, sl, sl * group_rows)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Landing:
    """A sparse layer's recall issued one step ahead (`recall="ahead"`), landed by that layer's next call: the
    copied blocks (or (block, head) units) and the plan that listed them (`LayerPlan.misses`, `LayerPlan.info`)."""

    staging: Float[Array, "n 2 bs Hkv hd"] | Float[Array, "n 2 bs hd"]
    misses: Int[Array, "B S N"]  # each lane's misses' slot blocks
    info: Int[Array, "B S M"]  # per lane: hits, misses, ... (slot_plan.LayerPlan.info)


@dataclasses.dataclass(frozen=True)
class SelectSpec:
    """The static shape of a sparse layer's selection and slot plan (hashable: a static argument)."""

    budget: int  # blocks attended per row and layer
    sink: int
    window: int
    mode: str  # "solohead" | "headwise"
    solohead: str  # SoloHead's aggregation variant
    attention: str  # "pallas" | "jnp": the scoring kernel follows the attention backend
    scoring: BlockScoring
    coarse: int = 0  # two-level scoring's kept groups (0 = off; sparse_inputs.micro_batch_inputs decides per step)
    plan_mode: str = "recall"  # slot_plan.layer_plan's mode

    @staticmethod
    def of(plan: SparsePlan, solohead: str, attention: str, scoring: BlockScoring, *, coarse: int = 0) -> SelectSpec:
        """The spec of `plan`'s requests: offloaded requests plan recalls; device-placed ones keep the slot caches
        only for the resident bonus's bookkeeping (or not at all)."""
        if plan.placement == "host":
            plan_mode = "recall"
        else:
            plan_mode = "bookkeep" if scoring.favours_resident(plan.selection, solohead) else "none"
        return SelectSpec(plan.budget_blocks, plan.sink_blocks, plan.window_blocks, plan.selection, solohead,
                          attention, scoring, coarse, plan_mode)

    @property
    def per_head(self) -> bool:
        return self.scoring.per_head(self.mode, self.solohead)

    @property
    def scores_kept(self) -> bool:
        return self.scoring.scores_kept(self.mode, self.solohead)

    @property
    def favours_resident(self) -> bool:
        return self.scoring.favours_resident(self.mode, self.solohead)

    @property
    def fused(self) -> bool:
        """Selection and slot plan in one kernel (`pallas_kernels.select_plan`): the Pallas backend's recall plans
        (the device placements' bookkeeping keeps the jnp path). A replayed trace's selections are data
        (`SlotStep.override`), not another program."""
        return self.attention == "pallas" and self.plan_mode == "recall"

    @property
    def select(self) -> str:
        """The selection rule by name: "headwise", or SoloHead's variant."""
        return "headwise" if self.mode == "headwise" else self.solohead


@dataclasses.dataclass(frozen=True)
class StepTables:
    """Host tables of one micro-batch's decode step, shared by its layers' plans (bp rows, kc logical blocks)."""

    host: np.ndarray  # [bp, kc] host row of each logical block, -1 = none
    gpu: np.ndarray  # [bp, kc] GPU block of each resident logical block (sinks, window), -1 = not resident
    slots: np.ndarray  # [bp, C] GPU block of each slot of the row's slot cache, -1 = none
    lengths: np.ndarray  # [b_real] tokens of each real row
    block_size: int
    num_gpu_blocks: int

    @staticmethod
    def of(sparse: list[SparseKV], lengths: np.ndarray, block_size: int, num_gpu_blocks: int) -> StepTables:
        """The tables of requests `sparse` holding `lengths` tokens: bp = bucket(len(sparse)) rows, kc =
        bucket_blocks(most logical blocks) columns."""
        n_blocks = -(-np.asarray(lengths, np.int64) // block_size)
        bp, kc = bucket(len(sparse)), bucket_blocks(int(n_blocks.max()))
        host = np.full((bp, kc), -1, np.int32)
        gpu = np.full((bp, kc), -1, np.int32)
        slots = np.full((bp, max(len(s.slot_block_arr) for s in sparse) or 1), -1, np.int32)
        for b, (s, n) in enumerate(zip(sparse, n_blocks, strict=True)):
            host[b, :n] = s.host_row_arr[:n]
            gpu[b, :n] = s.gpu_arr[:n]
            slots[b, : len(s.slot_block_arr)] = s.slot_block_arr
        return StepTables(host, gpu, slots, np.asarray(lengths, np.int64), block_size, num_gpu_blocks)

    @property
    def num_blocks(self) -> np.ndarray:  # [bp] logical blocks of each row (0 for padding rows)
        n = np.zeros(self.host.shape[0], np.int64)
        n[: len(self.lengths)] = -(-self.lengths // self.block_size)
        return n


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseRows:
    """A step's inputs to the dense layers (`sparse_layer.dense_layer`): each layer reads its own packs."""

    lens: Int[IntArray, "bp 1 kc"]  # valid tokens per block (the same in every dense layer)
    ids: tuple[Int[IntArray, "bp 1 kc"], ...]  # per dense layer: the flat unit of every logical block
    write: tuple[Int[IntArray, " bp"], ...]  # per dense layer: the flat unit the new token goes to


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlacedRows:
    """Dense-placed requests decoding in the offloaded requests' layer pass (recall ahead: one weight pass a step).
    Each row attends its whole block table in every layer. bd = bucket(requests) rows, mb = bucket_blocks(most
    blocks) columns; padding rows and columns list the null block with no tokens (a padding row writes into it)."""

    positions: Int[IntArray, " bd"]  # position of each row's new token (its length - 1)
    tables: Int[IntArray, "bd mb"]  # GPU blocks in order, the same in every layer
    lens: Int[IntArray, "bd 1 mb"]  # tokens of each block once the new token is in (0: not attended)

    @staticmethod
    def of(tables: list[list[int]], positions: list[int], block_size: int) -> PlacedRows:
        n = len(positions)
        if n == 0 or len(tables) != n:
            raise ValueError(f"PlacedRows needs one block table per position; got {len(tables)} and {n}")
        bd, mb = bucket(n), bucket_blocks(max(len(t) for t in tables))
        tab = np.zeros((bd, mb), np.int32)
        pos = np.zeros(bd, np.int32)
        for i, (t, p) in enumerate(zip(tables, positions, strict=True)):
            if blocks_for(p + 1, block_size) > len(t):
                raise ValueError(f"row {i}: position {p} needs {blocks_for(p + 1, block_size)} blocks, its table "
                                 f"has {len(t)}")
            tab[i, : len(t)], pos[i] = t, p
        lens = np.clip(pos[:, None] + 1 - np.arange(mb) * block_size, 0, block_size)
        lens[n:] = 0
        return PlacedRows(pos, tab, lens[:, None, :].astype(np.int32))


@dataclasses.dataclass(frozen=True)
class MicroBatchInputs:
    """One micro-batch's per-step inputs (see the module docstring); `coarse` is static (two-level scoring's kept
    groups, 0 = off)."""

    tokens: Int[np.ndarray, " bp"]
    rows: SparseRows  # what every sparse layer's selection call reads
    dense: DenseRows
    coarse: int
    tables: StepTables


def micro_batch_inputs(plan: SparsePlan, scoring: BlockScoring, solohead: str, num_gpu_blocks: int,
                       sparse: list[SparseKV], tokens: list[int], lengths: list[int]) -> MicroBatchInputs:
    """The inputs of a decode step of requests `sparse` whose new tokens `tokens` sit at `lengths` - 1."""
    p, nb, bs = plan, num_gpu_blocks, plan.block_size
    b_real = len(sparse)
    bp = bucket(b_real)
    lengths_np = np.asarray(lengths, np.int64)
    n_blocks = [blocks_for(length, bs) for length in lengths]
    kc = bucket_blocks(max(n_blocks))
    positions = np.zeros(bp, np.int32)
    positions[:b_real] = lengths_np - 1
    tok = np.zeros(bp, np.int32)
    tok[:b_real] = tokens
    tables = StepTables.of(sparse, lengths_np, bs, nb)
    nblk = np.zeros(bp, np.int32)
    nblk[:b_real] = n_blocks
    # the middle blocks are scored from their metadata rows; sinks and window are always selected (by position),
    # and scored from theirs too where SoloHead's softmax counts their mass (their rows are as current as any)
    col = np.arange(kc)
    listed = (col >= p.sink_blocks) & (col < nblk[:, None] - p.window_blocks)  # [bp, kc]
    if scoring.scores_kept(p.selection, solohead):
        listed = col < nblk[:, None]
    cand = np.where(listed, tables.host, -1)
    newest = np.full(bp, -1, np.int32)
    newest[:b_real] = tables.gpu[np.arange(b_real), nblk[:b_real] - 1]
    newest_row = np.full(bp, -1, np.int32)
    newest_row[:b_real] = tables.host[np.arange(b_real), nblk[:b_real] - 1]
    f = scoring.coarse_group
    coarse = scoring.coarse_groups(p.budget_blocks, p.sink_blocks, p.window_blocks, kc)
    groups = np.full((bp, -(-kc // f) if coarse else 1), -1, np.int32)
    if coarse:  # each group holding a middle block -> its coarse row (its extent: host row // f)
        for b, s in enumerate(sparse):
            lo, hi = p.sink_blocks, n_blocks[b] - p.window_blocks  # middle blocks lo..hi-1
            g = np.arange(lo // f, -(-hi // f) if hi > lo else 0)
            groups[b, g] = s.host_row_arr[g * f] // f
    dense_lens = np.clip(lengths_np[:, None] - np.arange(kc) * bs, 0, bs) * (np.arange(kc) < np.asarray(
        n_blocks)[:, None])
    dense_lens = np.pad(dense_lens, ((0, bp - b_real), (0, 0))).astype(np.int32)[:, None, :]
    dense_ids, dense_write = [], []
    units = [s.dense_units(n, nb) for s, n in zip(sparse, n_blocks, strict=True)]  # [D, n] per row
    for d in range(p.dense_layers):
        ids = np.full((bp, 1, kc), -1, np.int32)
        write = np.zeros(bp, np.int32)
        for b, u in enumerate(units):
            ids[b, 0, : u.shape[1]] = u[d]
            write[b] = u[d, -1]
        dense_ids.append(ids)
        dense_write.append(write)
    rows = SparseRows(positions=positions, newest=newest,
                      candidates=Candidates(rows=cand.astype(np.int32), num_blocks=nblk, groups=groups),
                      append=KeyAppend(newest_row, newest.copy(), (positions % bs).astype(np.int32)))
    dense = DenseRows(lens=dense_lens, ids=tuple(dense_ids), write=tuple(dense_write))
    return MicroBatchInputs(tokens=tok, rows=rows, dense=dense, coarse=coarse, tables=tables)


def slot_step_inputs(sparse: list[SparseKV], tables: StepTables, bp: int, table_rows: int, capacity: int,
                     override: np.ndarray | None = None, spare: bool = False) -> SlotStep:
    """The device slot plan's per-step inputs (`slot_plan.layer_plan`'s `step`) for a slot table of `table_rows`
    rows (the last is the padding rows' own) and `capacity` slots per lane; `override`: the middle blocks a
    replayed trace selects instead ([sparse layers, bp, lanes, M], -1 padded), else `scored_middle` (the scorer's
    selection, the same shapes: one program either way); `spare`: the blocks that left the window and still sit in
    the spare GPU block (step-ahead recall)."""
    spares = None
    if spare:
        spares = (np.full(bp, -1, np.int32), np.full(bp, -1, np.int32))
        for b, s in enumerate(sparse):
            if s.leaving is not None:
                spares[0][b], spares[1][b] = s.leaving
    r = np.full(bp, table_rows - 1, np.int32)
    r[: len(sparse)] = [s.slot_row for s in sparse]
    cap = np.full(bp, capacity, np.int32)
    cap[: len(sparse)] = [s.slot_capacity for s in sparse]
    lengths = np.zeros(bp, np.int32)
    lengths[: len(sparse)] = tables.lengths
    if override is None:
        override = scored_middle(sparse[0].plan, bp)
    return SlotStep(r, cap, tables.gpu, tables.host, tables.slots, lengths, override, spares)


def scored_middle(plan: SparsePlan, bp: int) -> np.ndarray:
    """`SlotStep.override` of a step that keeps the scorer's selection: every lane `SCORER` ([sparse layers, bp,
    lanes, middle blocks], a read-only view; the decoder keeps one device copy per shape)."""
    return np.broadcast_to(np.int32(SCORER), (plan.sparse_layers, bp, plan.lanes, plan.middle_blocks))
