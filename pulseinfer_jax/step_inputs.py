"""What the host builds for one sparse micro-batch's decode step: numpy arrays shared by every layer's calls.

`micro_batch_inputs` is the one place these shapes and values are made: the pipeline puts them on the device
(pipeline.py), the ahead-of-time compile check builds the same arrays at real sizes and compiles the layer calls
for them (pulseinfer_jax/aot/programs.py), so the two cannot drift apart. bp = bucket(requests) rows, kc =
bucket_blocks(most logical blocks) columns; padding rows want nothing and write into the null block.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jaxtyping import Int

from pulseinfer_jax.host_offload.blocks import blocks_for, bucket
from pulseinfer_jax.host_offload.placement import SparseKV, SparsePlan
from pulseinfer_jax.kept_scores import kept_logical
from pulseinfer_jax.kv_cache import bucket_blocks
from pulseinfer_jax.layer_inputs import Candidates, IntArray, KeptBlocks, SparseRows
from pulseinfer_jax.slot_plan import SlotStep
from pulseinfer_jax.sparse import BlockScoring


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
    """A step's inputs to the dense layers (`layer_ops.dense_layer`): each layer reads its own packs."""

    lens: Int[IntArray, "bp 1 kc"]  # valid tokens per block (the same in every dense layer)
    ids: tuple[Int[IntArray, "bp 1 kc"], ...]  # per dense layer: the flat unit of every logical block
    write: tuple[Int[IntArray, " bp"], ...]  # per dense layer: the flat unit the new token goes to


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
    # middle blocks are scored from their metadata rows; sinks and window are always selected (by position)
    # and keep no metadata while resident (-1 here; scored from their keys if scoring.scores_kept)
    col = np.arange(kc)
    is_mid = (col >= p.sink_blocks) & (col < nblk[:, None] - p.window_blocks)  # [bp, kc]
    cand = np.where(is_mid, tables.host, -1)
    newest = np.full(bp, -1, np.int32)
    newest[:b_real] = tables.gpu[np.arange(b_real), nblk[:b_real] - 1]
    f = scoring.coarse_group
    coarse = scoring.coarse_groups(p.budget_blocks, p.sink_blocks, p.window_blocks, kc)
    groups = np.full((bp, -(-kc // f) if coarse else 1), -1, np.int32)
    if coarse:  # each group holding a middle block -> its coarse row (its extent: host row // f)
        for b, s in enumerate(sparse):
            lo, hi = p.sink_blocks, n_blocks[b] - p.window_blocks  # middle blocks lo..hi-1
            g = np.arange(lo // f, -(-hi // f) if hi > lo else 0)
            groups[b, g] = s.host_row_arr[g * f] // f
    # the always-kept blocks' logical indices and GPU blocks (resident: every layer's slice is there)
    if scoring.scores_kept(p.selection, solohead):
        kept_l = kept_logical(nblk, p.sink_blocks, p.window_blocks)
    else:
        kept_l = np.full((bp, 1), -1, np.int32)
    kept_l[b_real:] = -1
    kept_gpu = np.where(kept_l >= 0, np.take_along_axis(tables.gpu, np.clip(kept_l, 0, kc - 1), axis=1), -1)
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
                      kept=KeptBlocks(logical=kept_l.astype(np.int32), gpu=kept_gpu.astype(np.int32)))
    dense = DenseRows(lens=dense_lens, ids=tuple(dense_ids), write=tuple(dense_write))
    return MicroBatchInputs(tokens=tok, rows=rows, dense=dense, coarse=coarse, tables=tables)


def slot_step_inputs(sparse: list[SparseKV], tables: StepTables, bp: int, table_rows: int, capacity: int,
                     override: np.ndarray | None = None) -> SlotStep:
    """The device slot plan's per-step inputs (`slot_plan.layer_plan`'s `step`) for a slot table of `table_rows`
    rows (the last is the padding rows' own) and `capacity` slots per lane; `override`: the middle blocks a
    replayed trace selects instead ([sparse layers, bp, lanes, M], -1 padded)."""
    r = np.full(bp, table_rows - 1, np.int32)
    r[: len(sparse)] = [s.slot_row for s in sparse]
    cap = np.full(bp, capacity, np.int32)
    cap[: len(sparse)] = [s.slot_capacity for s in sparse]
    lengths = np.zeros(bp, np.int32)
    lengths[: len(sparse)] = tables.lengths
    return SlotStep(r, cap, tables.gpu, tables.host, tables.slots, lengths, override)
