"""The decode step with its recall one step ahead as ONE jitted program (`ahead_step`), and its recall's landing.

One call runs the whole step on the device: embed, the dense layers (with the dense-placed rows), every sparse layer
as `sparse_layer.ahead_layer`'s body (write, score, select + plan, attend, o-proj + MLP), logits and sampling. The
cache, key bounds, slot state and split-merge counters are donated. What comes back: the token ids, and the step's
plan of every sparse layer stacked (`StepPlan`), which the host reads once to issue the next recall: one gather of
every layer's misses into one staging buffer, one host-to-device copy (`HostKVPool.recall_step`).

That recall lands before the next step's program, in a program of its own (`land_step`: `StepLanding`, sparse layer
l's entries start at `offsets[l]`; each layer reads a window of `width` entries, those past its own count land in
the null block). The staging's size follows the step's misses (a power of two): inside the step program every new
size compiled the whole step again (17 s at A for the H200; most of the 285 s docs/api.md's SmolLM2 passkey example
took on 2 CPU cores); on its own only a few scatters compile per size, and the step program once per batch shape.

The layers are unrolled inside the program: every layer keeps its own weights (no slice of a stacked copy per
layer), and XLA sees the whole step at once (one dispatch, one command buffer where the target captures it).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pulseinfer_jax.models.transformer import Transformer
from pulseinfer_jax.runner import sparse_layer
from pulseinfer_jax.runner.sampling import SamplingRows, sample_rows
from pulseinfer_jax.runner.sparse_inputs import (
    DenseRows,
    Landing,
    PlacedRows,
    ScoringBounds,
    SelectSpec,
    SparseLayerRefs,
    SparseRows,
)
from pulseinfer_jax.selection.slot_plan import SlotStep

# the layer bodies, traced inside the step program (taken once: a wrapper put on the jitted calls later, such as a
# benchmark's timer, stays outside the program)
_dense_layer = sparse_layer.dense_layer.__wrapped__
_ahead_layer = sparse_layer.ahead_layer.__wrapped__
_land = sparse_layer.land.__wrapped__


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepLanding:
    """The previous step's recall, landing in this step's program: one staging buffer for every sparse layer."""

    staging: Float[Array, "n 2 bs Hkv hd"] | Float[Array, "n 2 bs hd"]
    offsets: Int[Array, " SL"]  # first staging entry of each sparse layer
    misses: Int[Array, "SL B S N"]  # the plan that listed them (StepPlan.misses / .info of that step)
    info: Int[Array, "SL B S M"]

    def layer(self, sl: int, width: int) -> Landing:
        """Sparse layer `sl`'s share: `width` entries from its offset (those past its count are padding)."""
        staging = jax.lax.dynamic_slice_in_dim(self.staging, self.offsets[sl], width)
        return Landing(staging, self.misses[sl], self.info[sl])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepPlan:
    """Every sparse layer's plan of one step (slot_plan.LayerPlan's misses and info, the selection), stacked."""

    misses: Int[Array, "SL B S N"]
    info: Int[Array, "SL B S M"]
    sel: Int[Array, "SL B S K"] | None  # (a recording selector's only)


class StepRefs:
    """Every sparse layer's `SparseLayerRefs` as Python ints: a static argument of the step program, so that each
    layer's offsets are constants in it (a scalar sliced out of a device array is a kernel launch of its own on a
    GPU, one per scalar and layer). Hashed once."""

    __slots__ = ("layers", "_hash")

    def __init__(self, layers: tuple[SparseLayerRefs, ...]):
        self.layers = tuple(tuple(int(v) for v in dataclasses.astuple(r)) for r in layers)
        self._hash = hash(self.layers)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepRefs) and other.layers == self.layers

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:  # (stable across processes: part of the compile check's program keys)
        return f"StepRefs({len(self.layers)} layers, {zlib.crc32(repr(self.layers).encode()):08x})"

    def layer(self, sl: int) -> SparseLayerRefs:
        """Sparse layer `sl`'s refs as constants of the program being traced."""
        return SparseLayerRefs(*(jnp.int32(v) for v in self.layers[sl]))


@functools.partial(jax.jit,
                   static_argnames=("model", "refs", "spec", "attention", "split_k", "with_logits", "with_sel"),
                   donate_argnames=("kv", "bounds", "slot_state", "arrivals"))
def ahead_step(
    model: Transformer,
    head: dict,
    layer_params: tuple[dict, ...],
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    bounds: ScoringBounds,
    slot_state: tuple[Int[Array, "SL R S C"], Int[Array, "SL R S C"]],
    arrivals: Int[Array, " N"],
    tokens: Int[Array, " Bt"],
    rows: SparseRows,
    dense: DenseRows,
    step: SlotStep,
    placed: PlacedRows | None,
    sampling: SamplingRows | None,
    *,
    refs: StepRefs,
    spec: SelectSpec,
    attention: str,
    split_k: int | None = None,
    with_logits: bool = False,
    with_sel: bool = False,
) -> tuple[Array, ScoringBounds, tuple[Array, Array], Array, Int[Array, " Bt"], StepPlan, Array | None]:
    """One decode step of the offloaded rows (and, with `placed`, the dense-placed rows after them: `tokens` holds
    both), every layer in this one program (see the module docstring). `refs`: where each sparse layer's slices sit
    (constants); the previous step's recall has landed before (`land_step`); `sampling`: per-row sampling in
    `tokens`' order (None: greedy). Returns (kv, key bounds, slot state, arrivals, the sampled token of every row,
    the step's plan (its selections only `with_sel`: a recording selector's), the logits where `with_logits`
    (parity checks) else None)."""
    dense_layers = len(dense.write)
    nb = kv.shape[1]
    x = model.embed(head, tokens[:, None])
    for layer in range(dense_layers):
        offset = None if placed is None else jnp.int32(layer * nb)
        kv, x, arrivals = _dense_layer(
            model, layer_params[layer], kv, x, rows.positions, dense.write[layer], dense.ids[layer], dense.lens,
            placed, offset, arrivals, attention=attention, split_k=split_k)
        kv, x, arrivals = jax.lax.optimization_barrier((kv, x, arrivals))
    plans = []
    for sl in range(len(refs)):
        kv, bounds, x, slot_state, plan, sel, arrivals = _ahead_layer(
            model, layer_params[dense_layers + sl], kv, x, bounds, slot_state, rows, step, refs.layer(sl), None,
            placed, arrivals, spec=spec, attention=attention, fan=1, split_k=split_k)
        plans.append((plan.misses, plan.info, sel if with_sel else None))
        # (a layer's end as a program's end was: no read of one layer's cache scheduled past the next one's writes,
        # where XLA would copy the whole cache to keep it)
        kv, bounds, x, slot_state, arrivals = jax.lax.optimization_barrier((kv, bounds, x, slot_state, arrivals))
    logits = model.logits(head, x[:, 0])
    out = sample_rows(logits, sampling)
    misses, info, sels = zip(*plans, strict=True)
    plan = StepPlan(jnp.stack(misses), jnp.stack(info), jnp.stack(sels) if with_sel else None)
    return kv, bounds, slot_state, arrivals, out, plan, logits if with_logits else None


@functools.partial(jax.jit, static_argnames=("dense_layers", "width"), donate_argnames=("kv",))
def land_step(kv: Float[Array, "L NB 2 rows Hkv hd"], landing: StepLanding, *, dense_layers: int, width: int) -> Array:
    """A step's recall landed: every sparse layer's blocks into their slots. Before the next step's program, and
    in `SparseDecoder.land_pending` (before GPU blocks change owner, or a same-layer step)."""
    for sl in range(landing.offsets.shape[0]):
        kv = _land(kv, jnp.int32(dense_layers + sl), landing.layer(sl, width), fan=1)
    return kv
