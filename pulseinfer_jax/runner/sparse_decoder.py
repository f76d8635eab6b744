"""Layer-wise decode of sparse requests, driven from Python with asynchronous dispatch and interruptible recall.

One decode step of the sparse requests (`SparseDecoder.decode`):

  0. bookkeeping (host): each request's newest block becomes resident; a block that left the recent window
     is written back to its host row (async device->host copy) and gets its key metadata (`refresh_meta`):
     both are dispatched before any selection of this step, so the step can select and recall it.
  recall ahead (`recall="ahead"`, the default): the batch runs as one, and the whole step is ONE program that never
     waits on the host (`sparse_step.ahead_step`), after a small one that lands the blocks the previous step's recall
     brought (`sparse_step.land_step`: its shapes follow the recall's size); the step: embed, the dense layers, then
     each sparse layer writes the token, scores, selects and plans against the slot caches,
     copies a miss on the block that just left the window from its spare GPU block, attends over the resident
     blocks, the hits and that copy, and finishes the layer; then logits and sampling (only token ids come back).
     The other misses are not attended in this step: the driver reads the step's plan once (every layer's) and
     issues ONE recall of every layer's misses (one host gather into one staging buffer, one copy; with the numpy
     pool on the pool's recall thread, so the driver only hands over the rows), which lands before the next step's
     program (the driver waits there only if that gather is still running: `recall_wait_s`). The per-head
     baseline's fragmented copies (`io="fragmented"`) keep one call per sparse layer and one recall per layer.
     A request's first decode step has nothing prefetched: that step runs the same-layer schedule below (after
     landing the recalls in flight), as do the ablations. Recalls in flight also land before a finished request's
     blocks are freed (`land_pending`).
  same-layer schedules (`recall="interruptible" | "eager" | "sync"`):
  1. the batch is split into `micro_batches` micro-batches; each runs the layer loop below as a coroutine
     that stops where it needs something not yet there;
  2. dense layer l < dense_layers: one jitted call (write the token, attend over every block, MLP);
  3. sparse layer l:
       a. `sparse_pre`: q/k/v, write the token into its window block and its key into that block's key bounds,
          score the middle blocks (neither sink nor window) from their key bounds in the same kernel (two-level
          scoring: groups of blocks first, then only the blocks of the best groups; SoloHead normalized_sum: the
          sinks and window too, for the softmax; with a resident bonus, blocks in the layer's slot cache rank higher),
          select (SoloHead: one set per layer; headwise: one per KV head; sinks and window always), and plan
          it against the slot caches, all in the same call on the device (`slot_plan.layer_plan`): each
          selected block is resident (sink, window), a slot-cache hit, or a miss given a slot (LRU); the
          early (resident + hits) and late (misses) attention entries stay on the device, and one small
          array comes back: per lane its counts and its misses' host rows (`slot_plan.recall_lanes`)
                                                                        -> STOP until that array is on host
       b. host: ISSUE THE RECALL of the misses at once: coalesced = one host gather into one pinned staging
          buffer + one host-to-device copy for the whole micro-batch; fragmented = one copy per (block, head);
       c. interruptible: dispatch attention over the early entries (partial o, m, l) while the copy is in flight
                                                                              -> STOP until the copy landed
          then one call lands the recalled blocks in their slots, attends over them, merges the two partials
          through the softmax residuals and finishes the layer (o-proj, MLP): `sparse_layer.land_attend_finish`;
          synchronous (baseline): STOP until the copy landed, then the same call over everything;
          eager (`recall="eager"`): as interruptible, but the early attention is dispatched right after (a), before
          the driver stops for the plan, so the GPU computes it while the host reads the plan and issues the recall
          (a layer with nothing to recall then costs one more call: the early partial, then the tail over it).
     The host does no work per selected block: a layer costs it four dispatches, one small read and the recall's
     copy (`bench/host_overhead.py`).
  4. logits.

The driver resumes whichever micro-batch's awaited array `is_ready()`; only when none is does it block, on the
oldest. Blocking on a recall is counted as recall wait (`recall_wait_s`) only after the GPU has finished the
work queued ahead of it (the awaited micro-batch's early attention): that interval is time the GPU sits
idle on PCIe. A recall stop is resumed only once its copy landed, so the landing call that donates the shared
cache never makes another micro-batch's queued work wait on this one's copy. Every mechanism is switchable
for ablation: `recall="interruptible"` (same-layer), `recall="sync"`, `micro_batches=1`, `io="fragmented"`,
`selection="headwise"`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Generator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Int

from pulseinfer_jax.backends import ResolvedBackends
from pulseinfer_jax.config import OffloadConfig
from pulseinfer_jax.host_offload.host_pool import HostKVPool
from pulseinfer_jax.host_offload.memory import zeros_on
from pulseinfer_jax.host_offload.placement import SparseKV, SparsePlan
from pulseinfer_jax.host_offload.recall_thread import Recall
from pulseinfer_jax.kv.blocks import bucket
from pulseinfer_jax.models.transformer import Transformer, head_params, split_layers
from pulseinfer_jax.parallel.layout import DeviceLayout
from pulseinfer_jax.runner import sparse_layer, sparse_step
from pulseinfer_jax.runner.sampling import BatchSampling, sample_tokens
from pulseinfer_jax.runner.sparse_inputs import (
    KeyBounds,
    Landing,
    PlacedRows,
    ScoringBounds,
    SelectSpec,
    SparseLayerRefs,
    StepTables,
    micro_batch_inputs,
    slot_step_inputs,
)
from pulseinfer_jax.selection import slot_plan
from pulseinfer_jax.selection.hooks import Selector
from pulseinfer_jax.selection.policy import BlockScoring
from pulseinfer_jax.selection.slot_plan import SlotStep

Stop = tuple[str, jax.Array, jax.Array | None]  # (kind, awaited array, GPU work queued ahead of it)


class SparseDecoder:
    """Decode steps and prompt spills of sparse requests over the shared GPU cache (see module docstring)."""

    def __init__(self, model: Transformer, params: dict, plan: SparsePlan, offload: OffloadConfig,
                 backends: ResolvedBackends, pool: HostKVPool, num_gpu_blocks: int,
                 device: jax.Device | DeviceLayout,
                 split_weights: Callable[[], list[dict]] | None = None, max_requests: int = 8,
                 selector: Selector | None = None):
        c = model.cfg
        ab = offload.ablation
        if ab.solohead == "retrieval_head" and (ab.retrieval_heads is None
                                                or len(ab.retrieval_heads) != plan.sparse_layers):
            raise ValueError(f"solohead='retrieval_head' needs retrieval_heads: one KV head per sparse layer "
                             f"({plan.sparse_layers}); calibrate them with policy.calibrate_retrieval_head")
        self.model, self.params, self.plan, self.ablation = model, params, plan, ab
        self.selector = selector or Selector()  # the scorer's selection, or a strategy given to the engine
        self.selector.bind(plan)
        # as resolved for the device: the scoring (its key-bounds dtype), the attention, the batch split
        self.scoring: BlockScoring = backends.scoring
        self.attention: str = backends.sparse_attention
        self.split_k: int | None = offload.attention_split_k  # (the Pallas attention's splits; None: per call)
        self.micro_batches: int = backends.micro_batches
        # one weight pytree per layer, made on first use: by `split_weights` (the engine's, shared with its
        # layer-wise dense step) or split here
        self._split_weights = split_weights or (lambda: split_layers(params))
        self._layer_params: list[dict] | None = None
        self.pool = pool
        self.nb = num_gpu_blocks
        rows = plan.sparse_layers * pool.num_rows * self.scoring.sub_blocks  # metadata rows (m per block)
        self.scoring.check_block_size(plan.block_size)
        # key bounds in float8 by default (rounded outward: block_metadata.round_bounds_outward) or in the KV dtype
        # (exact: the min / max of bf16 keys are bf16 values): at 128K they are the largest part of an offloaded
        # request's GPU footprint and of what a scoring step reads; scoring computes in float32. "The KV dtype" is the
        # model's: a float8 cache's bounds are those of its dequantised keys (what attention reads), in the model dtype
        meta_dtype = self.scoring.metadata_dtype(model.dtype)
        # two-level scoring: one bound per group of `f` blocks = per aligned extent of f host rows (the pool's
        # ExtentAllocator), coarse row = host row // f; off: a one-row placeholder never read
        f = self.scoring.coarse_group
        if f > 1 and pool.row_align != f:
            raise ValueError(f"score_coarse_group={f} needs a host pool with row_align={f} (got {pool.row_align})")
        self._group_rows = pool.num_rows // f if f > 1 else 1  # coarse rows per sparse layer
        crows = plan.sparse_layers * self._group_rows if f > 1 else 1
        # committed to the device from the start, as the jitted updates' outputs are: an uncommitted first version
        # would give the calls reading it a second cache key (one more compile of each, measured)
        # (tensor parallelism: the key bounds split by KV head like the cache, so each device scores its own heads)
        self.layout = DeviceLayout.on(device)
        self.device = self.layout.device
        on_device = self.layout.kv_heads(3)  # (no host copy either: the key bounds run to GiBs)
        fine, coarse = (KeyBounds(*(zeros_on((n, c.num_kv_heads, c.head_dim), meta_dtype, on_device) for _ in "ab"))
                        for n in (rows, crows))
        self.replicated = rep = self.layout.replicated()  # (made once: per-step inputs go here)
        self.bounds = ScoringBounds(fine, coarse)
        self.kv: jax.Array | None = None
        # where each sparse layer's slices sit, on the device once (sparse_inputs.SparseLayerRefs), so a decode step
        # sends no per-layer scalars
        heads = ab.retrieval_heads or (0,) * plan.sparse_layers
        self._layer_refs = [jax.device_put(SparseLayerRefs.of(plan, sl, pool.num_rows, num_gpu_blocks,
                                                              self._group_rows, heads[sl]), rep)
                            for sl in range(plan.sparse_layers)]
        # the same as constants of the one-program step
        self._step_refs = sparse_step.StepRefs(tuple(
            SparseLayerRefs.of(plan, sl, pool.num_rows, num_gpu_blocks, self._group_rows, heads[sl])
            for sl in range(plan.sparse_layers)))
        self._layer_ids = [jax.device_put(np.int32(layer), rep) for layer in range(plan.num_layers)]
        # each dense layer's first flat unit (layer * NB): where dense-placed rows' blocks sit in that layer
        self._dense_offsets = [jax.device_put(np.int32(layer * num_gpu_blocks), rep)
                               for layer in range(plan.dense_layers)]
        # the slot caches of every sparse request, on the device (slot_plan.py): (stamp, key) [SL, R, lanes, C], one
        # row per concurrent request (`max_requests`) plus the padding rows' own, sized once so that no step
        # recompiles for a larger table (it grows, by doubling, only if more requests ever decode at once)
        self.slot_state: tuple[jax.Array, jax.Array] | None = None
        self._ensure_slot_rows(max_requests + 1)
        # the attention kernel's split-merge counters (sparse_decode_attention's `arrivals`): one buffer, all 0 between
        # calls, handed from layer call to layer call (donated), so that no call zeroes its own; split over devices
        self.arrivals: jax.Array | None = None
        self._ensure_arrivals(max_requests + 1)
        # per decode step: host-to-device copies and bytes issued, recall wait (bounded history); steps logged in all
        self.step_log: collections.deque[dict] = collections.deque(maxlen=65536)
        self.steps_logged = 0
        # recall="ahead": per sparse layer, the recall issued for its next call (None: nothing in flight)
        self._pending: list[Pending | None] = [None] * plan.sparse_layers
        # the one-program step (runner/sparse_step.py): the whole step's recall, landed before the next step's program
        self._step_pending: StepPending | None = None
        self._scored: dict[tuple, jax.Array] = {}  # per shape, the device `scored_middle` (no copy per step)

    @property
    def layer_params(self) -> list[dict]:
        """One weight pytree per layer (see sparse_layer), asked for on first use: the model's own per-layer weights
        in a layer-wise engine; with stacked weights (a scan engine) a second copy, which an engine that never
        decodes a sparse request never pays."""
        if self._layer_params is None:
            self._layer_params = self._split_weights()
        return self._layer_params

    @property
    def metadata_bytes(self) -> int:
        return self.bounds.fine.nbytes + (self.bounds.coarse.nbytes if self.scoring.coarse_group > 1 else 0)

    # ---- prompts -------------------------------------------------------------------------------
    def spill_layer(self, kv: jax.Array, s: SparseKV, layer: int, units: np.ndarray) -> jax.Array:
        """Layer `layer` of an offloaded prompt, computed into flat units `units` (logical block j at units[j];
        runner/offloaded_prefill.py), leaves them: a sparse layer to its host rows (with every block's key bounds,
        the partial last one's over its tokens) and
        its sinks and window to the request's resident blocks, a dense layer to its packs. Returns kv."""
        p, nb = self.plan, self.nb
        n = len(units)
        if layer < p.dense_layers:
            pairs = [(int(units[j]), s.dense_unit(j, layer, nb)) for j in range(n)]
        else:
            sl = layer - p.dense_layers
            self.pool.write_back_units(kv, units.tolist(), s.host_rows[:n], sl)
            self._refresh_meta_units(kv, units.tolist(), [sl * self.pool.num_rows + r for r in s.host_rows[:n]],
                                     s.block_lens(n))
            pairs = [(int(units[j]), layer * nb + g) for j, g in sorted(s.gpu_of.items())]
        return self._copy_units(kv, pairs)

    def prompt_indexed(self, s: SparseKV) -> None:
        """Every sparse layer of the prompt has its key bounds: with two-level scoring, its groups' bounds too."""
        self._refresh_groups([(s, j) for j in range(s.num_blocks) if s.is_middle(j)])

    def index_prompt(self, kv: jax.Array, s: SparseKV, prompt_tokens: int) -> None:
        """Device placement, after the prompt's dense prefill into the request's own blocks: its block roles and
        every block's key bounds (nothing moves)."""
        _, meta_blocks, _ = s.prefill_done(prompt_tokens)
        self._refresh_meta(kv, [(s, j, s.table[j]) for j in meta_blocks])

    def _copy_units(self, kv: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:
        if not pairs:
            return kv
        src, dst = (np.zeros(bucket(len(pairs)), np.int32) for _ in range(2))
        src[: len(pairs)], dst[: len(pairs)] = zip(*pairs, strict=True)
        return sparse_layer.copy_units(kv, jnp.asarray(src), jnp.asarray(dst))

    def _refresh_meta(self, kv: jax.Array, blocks: list[tuple[SparseKV, int, int]]) -> None:
        """Key bounds of a prompt's GPU blocks (their tokens so far) into their metadata rows (the blocks' host rows),
        every sparse layer: [(request, logical block, GPU block)]; with two-level scoring then their groups' bounds."""
        if not blocks:
            return
        p = self.plan
        units = [(p.dense_layers + sl) * self.nb + g for sl in range(p.sparse_layers) for _, _, g in blocks]
        rows = [sl * self.pool.num_rows + s.host_rows[j] for sl in range(p.sparse_layers) for s, j, _ in blocks]
        lens = [s.block_len(j) for _ in range(p.sparse_layers) for s, j, _ in blocks]
        self._refresh_meta_units(kv, units, rows, lens)
        self._refresh_groups([(s, j) for s, j, _ in blocks])

    def _refresh_meta_units(self, kv: jax.Array, units: list[int], rows: list[int], lens: list[int]) -> None:
        """Key bounds of the first `lens` tokens of the blocks at flat units `units` into metadata rows `rows`."""
        if not units:
            return
        n = bucket(len(units))
        u = np.zeros(n, np.int32)
        r = np.full(n, -1, np.int32)
        lb = np.zeros(n, np.int32)
        u[: len(units)], r[: len(rows)], lb[: len(units)] = units, rows, lens
        fine = sparse_layer.refresh_meta(kv, self.bounds.fine, jnp.asarray(u), jnp.asarray(lb), jnp.asarray(r),
                                      sub_blocks=self.scoring.sub_blocks)
        self.bounds = dataclasses.replace(self.bounds, fine=fine)

    def _refresh_groups(self, blocks: list[tuple[SparseKV, int]]) -> None:
        """Two-level scoring: the bounds of the groups of the (request, logical block)s `blocks`, every sparse layer,
        from all of each group's blocks that have metadata (the middle ones): recomputed, not accumulated, so a group
        row never carries a previous owner's bounds. Nothing without two-level scoring."""
        f = self.scoring.coarse_group
        if f == 1 or not blocks:
            return
        p = self.plan
        groups = {(id(s), j // f): s for s, j in blocks}
        members, dst = [], []
        for (_, g), s in groups.items():
            rows_g = [s.host_rows[i] for i in range(g * f, min(g * f + f, len(s.host_rows))) if s.is_middle(i)]
            for sl in range(p.sparse_layers):
                members.append([sl * self.pool.num_rows + x for x in rows_g])
                dst.append(sl * self._group_rows + s.host_rows[g * f] // f)
        width = bucket(len(dst))
        mem = np.full((width, f), -1, np.int32)
        d = np.full(width, -1, np.int32)
        for i, row in enumerate(members):
            mem[i, : len(row)] = row
        d[: len(dst)] = dst
        coarse = sparse_layer.refresh_coarse(self.bounds.fine, self.bounds.coarse, jnp.asarray(mem), jnp.asarray(d),
                                          sub_blocks=self.scoring.sub_blocks)
        self.bounds = dataclasses.replace(self.bounds, coarse=coarse)

    # ---- decode --------------------------------------------------------------------------------
    def joins_dense(self, sparse: list[SparseKV]) -> bool:
        """Whether this step of `sparse` can take dense-placed requests into its layer pass (`decode(placed=...)`):
        a step with every recall ahead (no request's first step, which runs the same-layer schedule)."""
        return self.ablation.recall == "ahead" and not any(s.slot_fresh for s in sparse)

    def decode(self, kv: jax.Array, sparse: list[SparseKV], tokens: list[int], lengths: list[int],
               placed: PlacedRows | None = None, placed_tokens: list[int] = (),
               sampling: BatchSampling | None = None, keep_logits: bool = False
               ) -> tuple[jax.Array, np.ndarray, np.ndarray | None]:
        """One decode step: the token tokens[i] sits at position lengths[i] - 1 of request sparse[i]. With `placed`
        (only where `joins_dense`), dense-placed requests decode in the same layer pass, their tokens
        `placed_tokens`. `sampling`: each row's, offloaded rows first (None: greedy). Returns (kv, the sampled token
        ids [len(sparse) + len(placed_tokens)] numpy, offloaded rows first, and with `keep_logits` their logits
        [rows, V] (parity checks; else None))."""
        if placed is not None and not self.joins_dense(sparse):
            raise ValueError("dense-placed requests join only a step with every recall ahead (see joins_dense)")
        self.selector.begin_step(sparse, lengths)
        write_back, left = [], []
        for s, length in zip(sparse, lengths, strict=True):
            for j, blk in s.advance(length):
                if s.plan.placement == "host":
                    write_back.append((blk, s.host_rows[j]))
                    s.counters.written_back_blocks += 1
                left.append((s, j))
        if write_back:
            self.pool.write_back(kv, [b for b, _ in write_back], [r for _, r in write_back])
        # (a block's key bounds are complete when it leaves the window: each key joined them as it was written)
        self._refresh_groups(left)
        for s in sparse:
            s.counters.last_step_recall_bytes = 0
        # recall ahead: a request's first step has nothing prefetched, so that step recalls in the layer, where only
        # the new requests attend their misses (the others exactly as in a step ahead: the tokens of a request do not
        # depend on who joins the batch)
        fresh = np.array([s.slot_fresh for s in sparse])
        first = None
        if self.ablation.recall == "ahead":
            if not fresh.any():
                self._prepare_slots(sparse)
                if self.ablation.io == "fragmented":  # (the per-head baseline's copies: one per layer and unit)
                    return self._decode_ahead_layerwise(kv, sparse, tokens, lengths, placed, list(placed_tokens),
                                                        sampling, keep_logits)
                return self._decode_ahead(kv, sparse, tokens, lengths, placed, list(placed_tokens), sampling,
                                          keep_logits)
            kv = self.land_pending(kv)
            first = fresh
        self._prepare_slots(sparse)

        k = max(1, min(self.micro_batches, len(sparse)))
        bounds = np.linspace(0, len(sparse), k + 1).astype(int)
        groups = [list(range(bounds[i], bounds[i + 1])) for i in range(k)]
        self.kv = kv
        copies0, bytes0 = self.pool.h2d_copies, self.pool.h2d_bytes
        outs: dict[int, jax.Array] = {}
        coros = {i: self._micro_batch([sparse[j] for j in g], [tokens[j] for j in g], [lengths[j] for j in g],
                                      outs, i, None if first is None else first[g]) for i, g in enumerate(groups)}
        waited = self._drive(coros, {i: [sparse[j] for j in g] for i, g in enumerate(groups)})
        kv, self.kv = self.kv, None
        self.step_log.append({"batch": len(sparse), "micro_batches": k, "h2d_copies": self.pool.h2d_copies - copies0,
                              "h2d_bytes": self.pool.h2d_bytes - bytes0,
                              "recall_wait_s": waited})
        self.steps_logged += 1
        logits = jnp.concatenate([outs[i][: len(g)] for i, g in enumerate(groups)])
        self.selector.end_step(sparse)
        n = len(sparse)
        rows = None if sampling is None else sampling.rows(range(n), n)
        return kv, np.asarray(sample_tokens(logits, rows)), np.asarray(logits) if keep_logits else None

    def _decode_ahead(self, kv: jax.Array, sparse: list[SparseKV], tokens: list[int], lengths: list[int],
                      placed: PlacedRows | None, placed_tokens: list[int], sampling: BatchSampling | None,
                      keep_logits: bool = False) -> tuple[jax.Array, np.ndarray, np.ndarray | None]:
        """A step with every recall one step ahead (`recall="ahead"`) as ONE program (`sparse_step.ahead_step`: every
        layer, logits and sampling; the previous step's recall lands just before it, `land_step`); then the step's
        plan is read once and every layer's misses go to the host pool as one recall, landed by the next step.
        `placed`: dense-placed rows after the offloaded ones (one pass over the weights). Returns (kv, token ids,
        logits or None)."""
        p, ab, model = self.plan, self.ablation, self.model
        mb = micro_batch_inputs(p, self.scoring, ab.solohead, self.nb, sparse, tokens, lengths)
        bp = mb.tokens.shape[0]
        rows, dense = (jax.tree.map(jnp.asarray, t) for t in (mb.rows, mb.dense))
        step = self._step_inputs(sparse, mb.tables, bp, spare=True)
        spec = SelectSpec.of(p, ab.solohead, self.attention, self.scoring, coarse=mb.coarse)
        copies0, bytes0 = self.pool.h2d_copies, self.pool.h2d_bytes
        all_tokens, at = mb.tokens, list(range(len(sparse)))
        if placed is not None:
            extra = np.zeros(placed.positions.shape[0], np.int32)
            extra[: len(placed_tokens)] = placed_tokens
            all_tokens = np.concatenate([mb.tokens, extra])
            at += [bp + i for i in range(len(placed_tokens))]
            placed = jax.device_put(placed, self.replicated)
        self._ensure_arrivals(len(all_tokens))
        kv, ready, waited = self._land_step_recall(kv)
        rows_sampling = None if sampling is None else sampling.rows(at, len(all_tokens))
        kv, self.bounds, self.slot_state, self.arrivals, out, plan, logits = sparse_step.ahead_step(
            model, head_params(self.params), tuple(self.layer_params), kv, self.bounds, self.slot_state,
            self.arrivals, jnp.asarray(all_tokens), rows, dense, step, placed, rows_sampling,
            refs=self._step_refs, spec=spec, attention=self.attention, split_k=self.split_k,
            with_logits=keep_logits, with_sel=self.selector.records_selection)
        out.copy_to_host_async()
        self._issue_step_recall(plan, sparse, lengths)
        self.step_log.append({"batch": len(sparse), "micro_batches": 1, "h2d_copies": self.pool.h2d_copies - copies0,
                              "h2d_bytes": self.pool.h2d_bytes - bytes0, "recall_wait_s": waited,
                              "late_recalls": int(not ready), "dense_rows": len(placed_tokens)})
        self.steps_logged += 1
        self.selector.end_step(sparse)
        return kv, np.asarray(out)[at], None if logits is None else np.asarray(logits)[at]

    def _land_step_recall(self, kv: jax.Array) -> tuple[jax.Array, bool, float]:
        """The step recall issued last step, taken off and landed (`sparse_step.land_step`, a program of its own: its
        shapes follow the recall's size): (kv, whether its staging already sat on the device, seconds waited here for
        the recall thread's gather)."""
        pending, self._step_pending = self._step_pending, None
        if pending is None:
            return kv, True, 0.0
        ready = pending.recall.ready()
        staging, waited = pending.recall.result()
        landing = sparse_step.StepLanding(staging, jax.device_put(pending.offsets, self.replicated), pending.misses,
                                          pending.info)
        kv = sparse_step.land_step(kv, landing, dense_layers=self.plan.dense_layers, width=pending.width)
        return kv, ready, waited

    def _issue_step_recall(self, plan: sparse_step.StepPlan, sparse: list[SparseKV], lengths: list[int]) -> None:
        """The step's plan read once (every sparse layer's), its misses recalled as one gather and one copy
        (`HostKVPool.recall_step`), pending until the next step lands it; counts reuse and recall per request."""
        info = np.asarray(plan.info)  # [SL, bp, S, M]: the one read of the step's plan
        sel = np.asarray(plan.sel) if self.selector.records_selection else None
        n = len(sparse)
        hits, misses = info[:, :n, :, -4].sum(axis=2), info[:, :n, :, -3].sum(axis=2)  # [SL, n]
        for sl in range(info.shape[0]):
            self.selector.observe(sl, sparse, lengths, None if sel is None else sel[sl], hits[sl], misses[sl])
        layers, rows, lanes, counts = slot_plan.step_recall(info)
        total = int(counts.sum())
        solo = self.plan.selection == "solohead"
        unit = self.pool.layer_block_bytes if solo else self.pool.unit_bytes
        per_row, reused = misses.sum(axis=0).astype(np.int64), hits.sum(axis=0).astype(np.int64)
        for b, s in enumerate(sparse):
            c = s.counters
            c.reused_blocks += int(reused[b])
            c.recalled_blocks += int(per_row[b])
            c.recall_transfers += int(per_row[b] > 0)  # (the step's one copy carried the request's blocks)
            c.recall_bytes += int(per_row[b]) * unit
            c.last_step_recall_bytes += int(per_row[b]) * unit
        if not total:
            return
        offsets = (np.cumsum(counts) - counts).astype(np.int32)
        width = bucket(int(counts.max()))
        at_least = total - int(counts[-1]) + width  # every layer's window lies inside the staging
        recall = self.pool.recall_step(layers, rows.astype(np.int32), None if solo else lanes, at_least=at_least)
        self._step_pending = StepPending(recall, offsets, width, plan.misses, plan.info)

    def _decode_ahead_layerwise(self, kv: jax.Array, sparse: list[SparseKV], tokens: list[int], lengths: list[int],
                                placed: PlacedRows | None, placed_tokens: list[int], sampling: BatchSampling | None,
                                keep_logits: bool = False) -> tuple[jax.Array, np.ndarray, np.ndarray | None]:
        """`_decode_ahead` for the per-head baseline's fragmented copies (`io="fragmented"`): one call per sparse
        layer, dispatched without a stop (each lands the recall its layer issued last step); then each layer's plan
        is read as it is ready and its misses recalled for the next step, one copy per unit."""
        p, ab, model, params = self.plan, self.ablation, self.model, self.params
        mb = micro_batch_inputs(p, self.scoring, ab.solohead, self.nb, sparse, tokens, lengths)
        bp = mb.tokens.shape[0]
        rows, dense = (jax.tree.map(jnp.asarray, t) for t in (mb.rows, mb.dense))
        step = self._step_inputs(sparse, mb.tables, bp, spare=True)
        spec = SelectSpec.of(p, ab.solohead, self.attention, self.scoring, coarse=mb.coarse)
        fan = self._fan()
        copies0, bytes0 = self.pool.h2d_copies, self.pool.h2d_bytes
        late = 0  # recalls not landed yet when their layer was dispatched (the GPU waits for them)
        waited = 0.0  # seconds the driver waited for the recall thread to finish a gather it needed
        head = head_params(params)
        all_tokens = mb.tokens
        if placed is not None:
            extra = np.zeros(placed.positions.shape[0], np.int32)
            extra[: len(placed_tokens)] = placed_tokens
            all_tokens = np.concatenate([mb.tokens, extra])
            placed = jax.device_put(placed, self.replicated)
        x = sparse_layer.embed(model, head, jnp.asarray(all_tokens))
        self._ensure_arrivals(len(all_tokens))
        plans = []
        for layer in range(model.cfg.num_layers):
            lp = self.layer_params[layer]
            if layer < p.dense_layers:
                kv, x, self.arrivals = sparse_layer.dense_layer(
                    model, lp, kv, x, rows.positions, dense.write[layer], dense.ids[layer], dense.lens, placed,
                    None if placed is None else self._dense_offsets[layer], self.arrivals, attention=self.attention,
                    split_k=self.split_k)
                continue
            sl = layer - p.dense_layers
            landing, ready, w = self._take_landing(sl)
            late += not ready
            waited += w
            kv, self.bounds, x, self.slot_state, plan, sel, self.arrivals = sparse_layer.ahead_layer(
                model, lp, kv, x, self.bounds, self.slot_state, rows, step, self._layer_refs[sl], landing, placed,
                self.arrivals, spec=spec, attention=self.attention, fan=fan, split_k=self.split_k)
            plans.append((sl, plan, sel))
        out = sparse_layer.logits(model, head, x)
        for sl, plan, sel in plans:  # the GPU is still on the later layers while these are read
            info = self._read_plan(np.asarray(plan.info), sparse)
            self.selector.observe(sl, sparse, lengths, sel, info.hits, info.misses)
            recall = self._issue_recall(sl, info, sparse, start=True)
            if recall is not None:
                self._pending[sl] = Pending(recall, plan.misses, plan.info)
        self.step_log.append({"batch": len(sparse), "micro_batches": 1, "h2d_copies": self.pool.h2d_copies - copies0,
                              "h2d_bytes": self.pool.h2d_bytes - bytes0, "recall_wait_s": waited, "late_recalls": late,
                              "dense_rows": len(placed_tokens)})
        self.steps_logged += 1
        at = list(range(len(sparse))) + [bp + i for i in range(len(placed_tokens))]  # (placed rows follow the padding)
        rows_sampling = None if sampling is None else sampling.rows(at, out.shape[0])
        self.selector.end_step(sparse)
        return kv, np.asarray(sample_tokens(out, rows_sampling))[at], np.asarray(out)[at] if keep_logits else None

    def _take_landing(self, sl: int) -> tuple[Landing | None, bool, float]:
        """Sparse layer `sl`'s recall issued last step, taken off the pending list: (its Landing or None, whether
        its staging already sat on the device, seconds waited here for the recall thread's gather)."""
        pending, self._pending[sl] = self._pending[sl], None
        if pending is None:
            return None, True, 0.0
        ready = pending.recall.ready()
        staging, waited = pending.recall.result()
        return Landing(staging, pending.misses, pending.info), ready, waited

    def land_pending(self, kv: jax.Array) -> jax.Array:
        """Land every recall issued ahead now (before GPU blocks change owner, or a same-layer step): returns kv."""
        kv, _, _ = self._land_step_recall(kv)
        for sl in range(len(self._pending)):
            landing, _, _ = self._take_landing(sl)
            if landing is not None:
                kv = sparse_layer.land(kv, self._layer_ids[self.plan.dense_layers + sl], landing, fan=self._fan())
        return kv

    @property
    def recall_in_flight(self) -> bool:
        return self._step_pending is not None or any(landing is not None for landing in self._pending)

    def _fan(self) -> int:
        """Staging units per miss: SoloHead's blocks sent per (block, head) (io="fragmented") have one per KV head."""
        solo = self.plan.selection == "solohead"
        return self.model.cfg.num_kv_heads if (self.ablation.io == "fragmented" and solo) else 1

    def _drive(self, coros: dict[int, Generator[Stop, None, None]], members: dict[int, list[SparseKV]]) -> float:
        """Run the micro-batch coroutines to completion; returns the seconds spent idle on recall."""
        total = 0.0
        pending: dict[int, Stop] = {}
        for i, co in coros.items():
            stop = next(co, None)
            if stop is not None:
                pending[i] = stop
        while pending:
            ready = [i for i, (_, arr, _) in pending.items() if arr.is_ready()]
            i = ready[0] if ready else min(pending)
            kind, arr, ahead = pending[i]
            if not ready and kind == "recall":
                if ahead is not None:
                    jax.block_until_ready(ahead)  # the GPU's queued work for this micro-batch is done...
                t0 = time.perf_counter()
                jax.block_until_ready(arr)  # ...so from here on it idles on PCIe
                waited = time.perf_counter() - t0
                total += waited
                for s in members[i]:
                    s.counters.recall_wait_s += waited
            stop = next(coros[i], None)
            if stop is None:
                del pending[i]
            else:
                pending[i] = stop
        return total

    def _micro_batch(self, sparse: list[SparseKV], tokens: list[int], lengths: list[int],
                     outs: dict[int, jax.Array], key: int, first: np.ndarray | None = None
                     ) -> Generator[Stop, None, None]:
        """One micro-batch's layer loop (same-layer recall). `first` (recall ahead's step where requests join): which
        rows decode for the first time; only they attend their misses now."""
        p, ab, nb = self.plan, self.ablation, self.nb
        model, params = self.model, self.params
        mb = micro_batch_inputs(p, self.scoring, ab.solohead, nb, sparse, tokens, lengths)
        bp = mb.tokens.shape[0]
        rows, dense = (jax.tree.map(jnp.asarray, t) for t in (mb.rows, mb.dense))
        step = self._step_inputs(sparse, mb.tables, bp, spare=first is not None)
        late_rows = None
        if first is not None:
            late_rows = np.zeros(bp, bool)
            late_rows[: len(first)] = first
            late_rows = jax.device_put(late_rows, self.replicated)
        spec = SelectSpec.of(p, ab.solohead, self.attention, self.scoring, coarse=mb.coarse)

        head = head_params(params)  # embed / logits read no layer weights: do not pass them
        x = sparse_layer.embed(model, head, jnp.asarray(mb.tokens))
        self._ensure_arrivals(bp)
        for layer in range(model.cfg.num_layers):
            lp = self.layer_params[layer]
            if layer < p.dense_layers:
                self.kv, x, self.arrivals = sparse_layer.dense_layer(
                    model, lp, self.kv, x, rows.positions, dense.write[layer], dense.ids[layer], dense.lens,
                    arrivals=self.arrivals, attention=self.attention, split_k=self.split_k)
                continue
            sl = layer - p.dense_layers
            self.kv, self.bounds, q, self.slot_state, plan, sel = sparse_layer.sparse_pre(
                model, lp, self.kv, x, self.bounds, self.slot_state, rows, step, self._layer_refs[sl], spec=spec)
            # eager: the attention over the early entries is queued before the plan is read, so that the GPU works on
            # it while the host reads the plan and issues the recall (one more call on layers with nothing to recall)
            early = sparse_layer.attend(q, self.kv, plan.early, attention=self.attention, split_k=self.split_k) \
                if ab.recall == "eager" else None
            yield "select", plan.info, None
            info = self._read_plan(np.asarray(plan.info), sparse)
            self.selector.observe(sl, sparse, lengths, sel, info.hits, info.misses)
            staging = self._issue_recall(sl, info, sparse)
            lid = self._layer_ids[layer]
            # late entries per lane: as many as the micro-batch's misses (rounded up), never more than the selection.
            # Tied to the recall's count, which also sizes the staging, so that the landing call compiles once per
            # recall size rather than per (recall size, late width) pair
            width = min(bucket(info.count), p.budget_blocks) if staging is not None else 0
            fan = self._fan()
            if staging is None or ab.recall == "sync":
                if staging is not None:
                    yield "recall", staging, q
                self.kv, x = sparse_layer.land_attend_finish(model, lp, x, q, self.kv, lid, plan, staging, early,
                                                             late_rows, attention=self.attention, width=width,
                                                             fan=fan, split_k=self.split_k)
                continue
            if early is None:
                early = sparse_layer.attend(q, self.kv, plan.early, attention=self.attention, split_k=self.split_k)
            yield "recall", staging, early[0]
            self.kv, x = sparse_layer.land_attend_finish(model, lp, x, q, self.kv, lid, plan, staging, early,
                                                         late_rows, attention=self.attention, width=width, fan=fan,
                                                         split_k=self.split_k)
        outs[key] = sparse_layer.logits(model, head, x)

    def _step_inputs(self, sparse: list[SparseKV], tables: StepTables, bp: int, spare: bool = False) -> SlotStep:
        """The device plan's per-step inputs (`slot_plan.layer_plan`'s `step`, sparse_inputs.slot_step_inputs) on the
        device; the padding rows use the slot table's last row (see _prepare_slots)."""
        stamp = self.slot_state[0]
        override = self.selector.override(sparse, tables.lengths, bp)
        step = slot_step_inputs(sparse, tables, bp, stamp.shape[1], stamp.shape[3], override, spare=spare)
        if override is None:  # the scorer's selection: one device array per shape, not a copy per step
            shape = step.override.shape
            if shape not in self._scored:
                self._scored[shape] = jax.device_put(step.override, self.replicated)
            step = dataclasses.replace(step, override=self._scored[shape])
        return step.on(self.replicated)

    def _prepare_slots(self, sparse: list[SparseKV]) -> None:
        """Before a step's micro-batches: the device slot table holds every request's row plus the padding rows'
        own (the last), and requests decoding for the first time start with every slot free."""
        self._ensure_slot_rows(max(s.slot_row for s in sparse) + 2)
        fresh = [s.slot_row for s in sparse if s.slot_fresh]
        if fresh:
            idx = np.full(bucket(len(fresh)), self.slot_state[0].shape[1], np.int32)  # padding: out of range
            idx[: len(fresh)] = fresh
            self.slot_state = slot_plan.reset_rows(*self.slot_state, jnp.asarray(idx))
            for s in sparse:
                s.slot_fresh = False

    def _ensure_arrivals(self, rows: int) -> None:
        """The split-merge counters cover `rows` rows of one call for each device's KV heads (grown by doubling,
        like the slot table, so that a step's row count rarely changes a call's shapes)."""
        tp = self.layout.tp
        need = bucket(rows) * (self.model.cfg.num_kv_heads // tp) * tp
        if self.arrivals is None or self.arrivals.shape[0] < need:
            self.arrivals = zeros_on((need,), jnp.int32, self.layout.split(1, 0))

    def _ensure_slot_rows(self, rows: int) -> None:
        """The device slot-cache table holds at least `rows` rows (grown by doubling, contents kept)."""
        have = 0 if self.slot_state is None else self.slot_state[0].shape[1]
        if have >= rows:
            return
        p = self.plan
        new = slot_plan.init_state(p.sparse_layers, bucket(rows), p.lanes, p.slot_blocks)
        if self.slot_state is not None:  # real rows keep their state (the old padding row is reset at first use)
            new = tuple(n.at[:, :have].set(o) for n, o in zip(new, self.slot_state, strict=True))
        self.slot_state = tuple(jax.device_put(a, self.replicated) for a in new)

    # ---- preemption ----------------------------------------------------------------------------
    def preempt(self, kv: jax.Array, s: SparseKV) -> tuple[jax.Array, SavedSlots]:
        """Before a running request's GPU blocks are copied out: every recall issued ahead lands (some land in its
        slots, and would land in another owner's blocks later), then its row of the slot-cache table is read to the
        host. Its next step then plans against the slot caches it had, holding what they held, as it would have
        unpreempted (a recall landed here is one its next call would have landed first). Returns (kv, the row)."""
        kv = self.land_pending(kv)
        stamp, key = (np.asarray(a)[:, s.slot_row].copy() for a in self.slot_state)  # (whole: no slicing program)
        return kv, SavedSlots(stamp, key)

    def resume(self, s: SparseKV, saved: SavedSlots) -> None:
        """A preempted request's slot-cache state (`preempt`) written into its table row, which may be another one
        now: the whole table goes up again, placed as before (no program compiled for it)."""
        self._ensure_slot_rows(s.slot_row + 2)
        stamp, key = (np.array(a) for a in self.slot_state)
        if saved.stamp.shape != stamp[:, s.slot_row].shape:
            raise ValueError(f"request {s.owner}: saved slot caches of shape {saved.stamp.shape}, the table's rows "
                             f"are {stamp[:, s.slot_row].shape}; resume it in the engine that preempted it")
        stamp[:, s.slot_row], key[:, s.slot_row] = saved.stamp, saved.key
        self.slot_state = tuple(jax.device_put(a, self.replicated) for a in (stamp, key))

    def _read_plan(self, info: np.ndarray, sparse: list[SparseKV]) -> PlanInfo:
        """The plan's host part (`slot_plan.LayerPlan.info`, [bp, S, N + 4]) unpacked; counts each request's reuse."""
        hits, misses = info[:, :, -4].sum(axis=1), info[:, :, -3].sum(axis=1)
        rows, lanes = slot_plan.recall_lanes(info)
        for b, s in enumerate(sparse):
            s.counters.reused_blocks += int(hits[b])
        return PlanInfo(len(rows), hits[: len(sparse)], misses[: len(sparse)], rows, lanes)

    def _issue_recall(self, sl: int, info: PlanInfo, sparse: list[SparseKV], start: bool = False):
        """Start the host-to-device copy (copies) of the layer's misses; returns the device staging (with `start`: a
        `Recall`, gathered on the pool's recall thread where it has one), or None when nothing is missing. Counts
        bytes / transfers / blocks per request."""
        if not info.count:
            return None
        pool, p = self.pool, self.plan
        solo = p.selection == "solohead"
        per_row = info.misses.astype(np.int64)
        if self.ablation.io == "coalesced":
            if solo:
                staging = (pool.recall_blocks if start else pool.gather_blocks)(sl, info.rows)
                unit = pool.layer_block_bytes
            else:
                staging = (pool.recall_units if start else pool.gather_units)(sl, info.rows, info.lanes)
                unit = pool.unit_bytes
            copies = (per_row > 0).astype(np.int64)  # the one copy carried each request's blocks
            units_per_row = per_row
        else:  # fragmented: one copy per (block, head)
            hkv = self.model.cfg.num_kv_heads
            fan = hkv if solo else 1
            rows = np.repeat(info.rows, fan)
            heads = np.tile(np.arange(hkv, dtype=np.int32), info.count) if solo else info.lanes
            staging, unit = pool.fragment_units(sl, rows, heads), pool.unit_bytes
            staging = Recall(made=staging) if start else staging
            copies = units_per_row = per_row * fan
        for b, s in enumerate(sparse):
            c = s.counters
            c.recalled_blocks += int(per_row[b])
            c.recall_transfers += int(copies[b])
            c.recall_bytes += int(units_per_row[b]) * unit
            c.last_step_recall_bytes += int(units_per_row[b]) * unit
        return staging


class SavedSlots(NamedTuple):
    """A preempted request's row of the slot-cache table (slot_plan.py's state), on the host until it resumes."""

    stamp: Int[np.ndarray, "SL S C"]  # recency rank of each slot
    key: Int[np.ndarray, "SL S C"]  # logical block each slot holds, -1 = free


class Pending(NamedTuple):
    """A sparse layer's recall issued one step ahead, until its layer's next call lands it (as a `Landing`)."""

    recall: Recall  # the staging, being gathered and copied
    misses: jax.Array  # the plan that listed it (LayerPlan.misses, LayerPlan.info)
    info: jax.Array


class StepPending(NamedTuple):
    """A whole step's recall (`_issue_step_recall`), until the next step lands it (`sparse_step.land_step`)."""

    recall: Recall  # the staging of every sparse layer's misses, being gathered and copied
    offsets: Int[np.ndarray, " SL"]  # each sparse layer's first staging entry
    width: int  # entries each layer's landing reads from its offset (>= its count)
    misses: jax.Array  # the step's plan that listed them (StepPlan.misses, StepPlan.info)
    info: jax.Array


@dataclasses.dataclass(frozen=True)
class PlanInfo:
    """What the host reads of a layer's device plan (slot_plan.layer_plan's info)."""

    count: int  # misses of the micro-batch (entries recalled)
    hits: np.ndarray  # [b] slot-cache hits per request
    misses: np.ndarray  # [b] misses per request
    rows: np.ndarray  # [count] host row of each miss, in row / lane / selection order
    lanes: np.ndarray  # [count] its lane (headwise: the KV head)
