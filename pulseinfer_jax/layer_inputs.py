"""What a sparse layer's selection call (`layer_ops.sparse_pre`) reads, grouped by how long it lives.

- `ScoringBounds`: the engine's key bounds of every sparse layer (block rows, and two-level scoring's group rows);
  updated when blocks leave the window, read by every step.
- `SparseRows`: one micro-batch's step, the same for each of its sparse layers (host-built by
  `step_inputs.micro_batch_inputs`, numpy there, device arrays in the call): the new tokens' positions and window
  blocks, the candidates to score (`Candidates`), the always-kept blocks scored from their keys (`KeptBlocks`).
- `SparseLayerRefs`: where one sparse layer's slices sit (device scalars made once per layer), so a step sends no
  per-layer data.
- `SelectSpec`: the static shape of the selection (budget, sinks, window, variant, scoring); part of the compile key.

The array classes are registered dataclass pytrees: a jitted call takes them as they are, with their fields named.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jaxtyping import Array, Float, Int

from pulseinfer_jax.host_offload.placement import SparsePlan
from pulseinfer_jax.sparse import BlockScoring

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
    num_blocks: Int[IntArray, " B"]  # logical blocks of each row (0: padding row)
    groups: Int[IntArray, "B G"]  # two-level scoring: layer-relative coarse row of each group, -1 = none


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeptBlocks:
    """The always-kept blocks (sinks, window) that SoloHead's softmax scores from their resident keys (kept_scores.py);
    a single -1 column when the variant does not score them."""

    logical: Int[IntArray, "B KK"]  # logical block, -1 = none
    gpu: Int[IntArray, "B KK"]  # its GPU block (layer-relative)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SparseRows:
    """One micro-batch's per-step inputs to each of its sparse layers' selection calls (see the module docstring)."""

    positions: Int[IntArray, " B"]  # position of each row's new token (its length - 1)
    newest: Int[IntArray, " B"]  # GPU block of each row's newest logical block (-1: padding row)
    candidates: Candidates
    kept: KeptBlocks


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
    coarse: int = 0  # two-level scoring's kept groups (0 = off; step_inputs.micro_batch_inputs decides per step)
    plan_mode: str = "recall"  # slot_plan.layer_plan's mode
    override: bool = False  # middle blocks come from the step's replayed trace (SlotStep.override)

    @staticmethod
    def of(plan: SparsePlan, solohead: str, attention: str, scoring: BlockScoring, *, coarse: int = 0,
           override: bool = False) -> SelectSpec:
        """The spec of `plan`'s requests: offloaded requests plan recalls; device-placed ones keep the slot caches
        only for the resident bonus's bookkeeping (or not at all)."""
        if plan.placement == "host":
            plan_mode = "recall"
        else:
            plan_mode = "bookkeep" if scoring.favours_resident(plan.selection, solohead) else "none"
        return SelectSpec(plan.budget_blocks, plan.sink_blocks, plan.window_blocks, plan.selection, solohead,
                          attention, scoring, coarse, plan_mode, override)

    @property
    def per_head(self) -> bool:
        return self.scoring.per_head(self.mode, self.solohead)

    @property
    def scores_kept(self) -> bool:
        return self.scoring.scores_kept(self.mode, self.solohead)

    @property
    def favours_resident(self) -> bool:
        return self.scoring.favours_resident(self.mode, self.solohead)
