"""Layer-wise decode of sparse requests, driven from Python with asynchronous dispatch and interruptible recall.

One decode step of the sparse requests (`SparseDecoder.decode`):

  0. bookkeeping (host): each request's newest block becomes resident; a block that left the recent window
     is written back to its host row (async device->host copy) and gets its key metadata (`refresh_meta`):
     both are dispatched before any selection of this step, so the step can select and recall it.
  1. the batch is split into `micro_batches` micro-batches; each runs the layer loop below as a coroutine
     that stops where it needs something not yet there;
  2. dense layer l < dense_layers: one jitted call (write the token, attend over every block, MLP);
  3. sparse layer l:
       a. `sparse_pre`: q/k/v, write the token into its window block, score the middle blocks (neither sink
          nor window) from their key metadata (two-level scoring: groups of blocks first, then only the blocks of
          the best groups; SoloHead normalized_sum: the sinks and window too, from their
          resident keys, for the softmax; with a resident bonus, blocks in the layer's slot cache rank higher),
          select (SoloHead: one set per layer; headwise: one per KV head; sinks and window always)
                                                                                   -> STOP until sel is on host
       b. host: split the selection into resident blocks (sinks, window), slot-cache hits and misses (LRU),
          and ISSUE THE RECALL of the misses at once: coalesced = one host gather into one pinned staging
          buffer + one host-to-device copy for the whole micro-batch; fragmented = one copy per (block, head);
       c. interruptible: dispatch attention over the resident + hit blocks (partial o, m, l) while the copy
          is in flight                                                        -> STOP until the copy landed
          then scatter the recalled blocks into their slots, attend over them, merge the two partials
          through the softmax residuals, finish the layer (o-proj, MLP);
          synchronous (baseline): STOP until the copy landed, scatter, one attention over everything.
  4. logits.

The driver resumes whichever micro-batch's awaited array `is_ready()`; only when none is does it block, on the
oldest. Blocking on a recall is counted as recall wait (`recall_wait_s`) only after the GPU has finished the
work queued ahead of it (the awaited micro-batch's early attention): that interval is time the GPU sits
idle on PCIe. A recall stop is resumed only once its copy landed, so the scatter that donates the shared
cache never makes another micro-batch's queued work wait on this one's copy. Every mechanism is switchable
for ablation: `recall="sync"`, `micro_batches=1`, `io="fragmented"`, `selection="headwise"`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Generator

import jax
import jax.numpy as jnp
import numpy as np

from host_offload.host_pool import HostKVPool
from host_offload.placement import SparseKV, SparsePlan
from models.transformer import Transformer, head_params, split_layers
from pulseinfer_jax import layer_ops
from pulseinfer_jax.kept_scores import kept_logical
from pulseinfer_jax.kv_cache import blocks_for, bucket
from pulseinfer_jax.sparse import BlockScoring

Stop = tuple[str, jax.Array, jax.Array | None]  # (kind, awaited array, GPU work queued ahead of it)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    io: str = "coalesced"  # "coalesced" | "fragmented"
    recall: str = "interruptible"  # "interruptible" | "sync"
    micro_batches: int = 2
    attention: str = "jnp"  # "jnp" | "pallas"
    solohead: str = "normalized_sum"  # "normalized_sum" | "retrieval_head"
    scoring: BlockScoring = BlockScoring()  # how blocks are scored (EngineConfig.scoring)
    retrieval_heads: tuple[int, ...] | None = None  # per sparse layer, for solohead="retrieval_head"


def _pad_rows(rows: list[list[list[int]]], width: int, batch: int, lanes: int, fill: int) -> np.ndarray:
    out = np.full((batch, lanes, width), fill, np.int32)
    for b, per_lane in enumerate(rows):
        for s, vals in enumerate(per_lane):
            out[b, s, : len(vals)] = vals
    return out


class SparseDecoder:
    """Decode steps and prompt spills of sparse requests over the shared GPU cache (see module docstring)."""

    def __init__(self, model: Transformer, params: dict, plan: SparsePlan, config: PipelineConfig,
                 pool: HostKVPool, num_gpu_blocks: int, device: jax.Device,
                 split_weights: Callable[[], list[dict]] | None = None):
        c = model.cfg
        if config.solohead == "retrieval_head" and (config.retrieval_heads is None
                                                    or len(config.retrieval_heads) != plan.sparse_layers):
            raise ValueError(f"solohead='retrieval_head' needs retrieval_heads: one KV head per sparse layer "
                             f"({plan.sparse_layers}); calibrate them with sparse.calibrate_retrieval_head")
        self.model, self.params, self.plan, self.config = model, params, plan, config
        # one weight pytree per layer, made on first use: by `split_weights` (the engine's, shared with its
        # layer-wise dense step) or split here
        self._split_weights = split_weights or (lambda: split_layers(params))
        self._layer_params: list[dict] | None = None
        self.pool = pool
        self.nb = num_gpu_blocks
        rows = plan.sparse_layers * pool.num_rows * config.scoring.sub_blocks  # metadata rows (m per block)
        config.scoring.check_block_size(plan.block_size)
        # key bounds in float8 by default (rounded outward: block_metadata.round_bounds_outward) or in the KV dtype
        # (exact: the min / max of bf16 keys are bf16 values): at 128K they are the largest part of an offloaded
        # request's GPU footprint and of what a scoring step reads; scoring computes in float32
        meta_dtype = config.scoring.metadata_dtype(pool.dtype)
        # two-level scoring: one bound per group of `f` blocks = per aligned extent of f host rows (the pool's
        # ExtentAllocator), coarse row = host row // f; off: a one-row placeholder never read
        f = config.scoring.coarse_group
        if f > 1 and pool.row_align != f:
            raise ValueError(f"score_coarse_group={f} needs a host pool with row_align={f} (got {pool.row_align})")
        self._group_rows = pool.num_rows // f if f > 1 else 1  # coarse rows per sparse layer
        crows = plan.sparse_layers * self._group_rows if f > 1 else 1
        with jax.default_device(device):
            self.meta_min = jnp.zeros((rows, c.num_kv_heads, c.head_dim), meta_dtype)
            self.meta_max = jnp.zeros((rows, c.num_kv_heads, c.head_dim), meta_dtype)
            self.cmeta_min = jnp.zeros((crows, c.num_kv_heads, c.head_dim), meta_dtype)
            self.cmeta_max = jnp.zeros((crows, c.num_kv_heads, c.head_dim), meta_dtype)
        self.kv: jax.Array | None = None
        # per sparse layer, on the device once: (metadata row offset, flat unit offset layer * NB, retrieval head,
        # sparse layer index, coarse metadata row offset), so a decode step sends no per-layer scalars
        heads = config.retrieval_heads or (0,) * plan.sparse_layers
        self._layer_scalars = [
            tuple(jax.device_put(np.int32(v), device)
                  for v in (sl * pool.num_rows, (plan.dense_layers + sl) * num_gpu_blocks, heads[sl], sl,
                            sl * self._group_rows))
            for sl in range(plan.sparse_layers)]
        self._no_slot_keys = jax.device_put(np.full((1, 1, 1), -1, np.int32), device)  # bonus off: never read
        # per decode step: host-to-device copies and bytes issued, recall wait (bounded history)
        self.step_log: collections.deque[dict] = collections.deque(maxlen=65536)

    @property
    def layer_params(self) -> list[dict]:
        """One weight pytree per layer (see layer_ops), asked for on first use: the model's own per-layer weights
        in a layer-wise engine; with stacked weights (a scan engine) a second copy, which an engine that never
        decodes a sparse request never pays."""
        if self._layer_params is None:
            self._layer_params = self._split_weights()
        return self._layer_params

    @property
    def metadata_bytes(self) -> int:
        return 2 * self.meta_min.nbytes + (2 * self.cmeta_min.nbytes if self.config.scoring.coarse_group > 1 else 0)

    # ---- prompt spill --------------------------------------------------------------------------
    def spill_prompt(self, kv: jax.Array, s: SparseKV, prompt_tokens: int) -> jax.Array:
        """After prefill: host rows, metadata, dense-layer packs and resident blocks of the prompt, all read
        from the prefill blocks (the engine's scratch for host placement); returns kv."""
        table = list(s.table)
        spill, meta_blocks, resident = s.prefill_done(prompt_tokens)
        if spill:
            self.pool.write_back(kv, [table[j] for j in spill], [s.host_rows[j] for j in spill])
        self._refresh_meta(kv, [(s, j, table[j]) for j in meta_blocks])
        pairs = [(layer * self.nb + src, layer * self.nb + dst) for src, dst in resident
                 for layer in range(s.plan.num_layers)]
        if s.plan.placement == "host" and s.plan.dense_layers:
            n = blocks_for(prompt_tokens, s.plan.block_size)
            pairs += [(d * self.nb + table[j], s.dense_unit(j, d, self.nb)) for j in range(n)
                      for d in range(s.plan.dense_layers)]
        if pairs:
            src, dst = (np.zeros(bucket(len(pairs)), np.int32) for _ in range(2))
            src[: len(pairs)], dst[: len(pairs)] = zip(*pairs, strict=True)
            kv = layer_ops.copy_units(kv, jnp.asarray(src), jnp.asarray(dst))
        return kv

    def _refresh_meta(self, kv: jax.Array, blocks: list[tuple[SparseKV, int, int]]) -> None:
        """Key bounds of full GPU blocks into their metadata rows (the blocks' host rows), every sparse layer:
        [(request, logical block, GPU block)]; with two-level scoring then their groups' bounds."""
        if not blocks:
            return
        p = self.plan
        units = [(p.dense_layers + sl) * self.nb + g for sl in range(p.sparse_layers) for _, _, g in blocks]
        rows = [sl * self.pool.num_rows + s.host_rows[j] for sl in range(p.sparse_layers) for s, j, _ in blocks]
        n = bucket(len(units))
        u = np.zeros(n, np.int32)
        r = np.full(n, -1, np.int32)
        lens = np.zeros(n, np.int32)
        u[: len(units)], r[: len(rows)], lens[: len(units)] = units, rows, p.block_size
        m = self.config.scoring.sub_blocks
        self.meta_min, self.meta_max = layer_ops.refresh_meta(kv, self.meta_min, self.meta_max, jnp.asarray(u),
                                                              jnp.asarray(lens), jnp.asarray(r), sub_blocks=m)
        f = self.config.scoring.coarse_group
        if f == 1:
            return
        # each touched group's bound from all of its blocks that have metadata (the middle ones): recomputed, not
        # accumulated, so a group row never carries a previous owner's bounds
        groups = {(id(s), j // f): s for s, j, _ in blocks}
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
        self.cmeta_min, self.cmeta_max = layer_ops.refresh_coarse(self.meta_min, self.meta_max, self.cmeta_min,
                                                                  self.cmeta_max, jnp.asarray(mem), jnp.asarray(d),
                                                                  sub_blocks=m)

    # ---- decode --------------------------------------------------------------------------------
    def decode(self, kv: jax.Array, sparse: list[SparseKV], tokens: list[int], lengths: list[int]
               ) -> tuple[jax.Array, np.ndarray]:
        """One decode step: the token tokens[i] sits at position lengths[i] - 1 of request sparse[i].
        Returns (kv, logits [len(sparse), V] numpy)."""
        write_back, meta = [], []
        for s, length in zip(sparse, lengths, strict=True):
            for j, blk in s.advance(length):
                if s.plan.placement == "host":
                    write_back.append((blk, s.host_rows[j]))
                    s.counters.written_back_blocks += 1
                meta.append((s, j, blk))
        if write_back:
            self.pool.write_back(kv, [b for b, _ in write_back], [r for _, r in write_back])
        self._refresh_meta(kv, meta)
        for s in sparse:
            s.counters.last_step_recall_bytes = 0

        k = max(1, min(self.config.micro_batches, len(sparse)))
        bounds = np.linspace(0, len(sparse), k + 1).astype(int)
        groups = [list(range(bounds[i], bounds[i + 1])) for i in range(k)]
        self.kv = kv
        copies0, bytes0 = self.pool.h2d_copies, self.pool.h2d_bytes
        outs: dict[int, jax.Array] = {}
        coros = {i: self._micro_batch([sparse[j] for j in g], [tokens[j] for j in g], [lengths[j] for j in g],
                                      outs, i) for i, g in enumerate(groups)}
        waited = self._drive(coros, {i: [sparse[j] for j in g] for i, g in enumerate(groups)})
        kv, self.kv = self.kv, None
        self.step_log.append({"batch": len(sparse), "micro_batches": k, "h2d_copies": self.pool.h2d_copies - copies0,
                              "h2d_bytes": self.pool.h2d_bytes - bytes0,
                              "recall_wait_s": waited})
        logits = np.concatenate([np.asarray(outs[i])[: len(g)] for i, g in enumerate(groups)])
        return kv, logits

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
                     outs: dict[int, jax.Array], key: int) -> Generator[Stop, None, None]:
        p, cfg, nb = self.plan, self.config, self.nb
        model, params = self.model, self.params
        bs = p.block_size
        b_real = len(sparse)
        bp = bucket(b_real)
        n_blocks = [blocks_for(length, bs) for length in lengths]
        kc = bucket(max(n_blocks))
        positions = np.zeros(bp, np.int32)
        positions[:b_real] = np.asarray(lengths) - 1
        tok = np.zeros(bp, np.int32)
        tok[:b_real] = tokens
        cand = np.full((bp, kc), -1, np.int32)
        nblk = np.zeros(bp, np.int32)
        newest = np.full(bp, -1, np.int32)  # GPU block of each row's newest logical block (-1: padding row)
        for b, s in enumerate(sparse):
            n = n_blocks[b]
            # middle blocks are scored from their metadata rows; sinks and window are always selected (by position)
            # and keep no metadata while resident (-1 here; scored from their keys below if scoring.scores_kept)
            middle = range(p.sink_blocks, max(p.sink_blocks, n - p.window_blocks))
            cand[b, middle] = [s.host_rows[j] for j in middle]
            nblk[b] = n
            newest[b] = s.gpu_of[n - 1]
        f = cfg.scoring.coarse_group
        coarse = cfg.scoring.coarse_groups(p.budget_blocks, p.sink_blocks, p.window_blocks, kc)
        groups = np.full((bp, -(-kc // f) if coarse else 1), -1, np.int32)
        if coarse:  # each group holding a middle block -> its coarse row (its extent: host row // f)
            for b, s in enumerate(sparse):
                lo, hi = p.sink_blocks, n_blocks[b] - p.window_blocks  # middle blocks lo..hi-1
                for g in range(lo // f, -(-hi // f) if hi > lo else 0):
                    groups[b, g] = s.host_rows[g * f] // f
        positions_d, cand_d, nblk_d, newest_d = (jnp.asarray(a) for a in (positions, cand, nblk, newest))
        groups_d = jnp.asarray(groups)
        # the always-kept blocks' logical indices and GPU blocks (resident: every layer's slice is there)
        score_kept = cfg.scoring.scores_kept(p.selection, cfg.solohead)
        kept_l = kept_logical(nblk, p.sink_blocks, p.window_blocks) if score_kept else np.full((bp, 1), -1, np.int32)
        kept_gpu = np.full(kept_l.shape, -1, np.int32)
        for b, s in enumerate(sparse):
            for i, j in enumerate(kept_l[b]):
                if j >= 0:
                    kept_gpu[b, i] = s.gpu_of[int(j)]
        kept_l_d, kept_gpu_d = jnp.asarray(kept_l), jnp.asarray(kept_gpu)
        slot_keys_d = self._no_slot_keys
        if cfg.scoring.favours_resident(p.selection, cfg.solohead):
            # every sparse layer's slot-cache contents as of the previous step (this step's plans run per layer,
            # after that layer's selection): one [SL, bp, C] copy per micro-batch and step
            width = bucket(max(s.slot_keys.shape[2] for s in sparse))  # (slots_for >= 1)
            slot_keys = np.full((p.sparse_layers, bp, width), -1, np.int32)
            for b, s in enumerate(sparse):
                slot_keys[:, b, : s.slot_keys.shape[2]] = s.slot_keys[:, 0]
            slot_keys_d = jnp.asarray(slot_keys)

        dense_lens = np.zeros((bp, 1, kc), np.int32)  # valid tokens per block: the same in every dense layer
        for b in range(b_real):
            dense_lens[b, 0, : n_blocks[b]] = np.clip(lengths[b] - np.arange(n_blocks[b]) * bs, 0, bs)
        dense_lens = jnp.asarray(dense_lens)
        dense_ids, dense_write = [], []
        for d in range(p.dense_layers):
            ids = np.full((bp, 1, kc), -1, np.int32)
            write = np.zeros(bp, np.int32)
            for b, s in enumerate(sparse):
                n = n_blocks[b]
                ids[b, 0, :n] = [s.dense_unit(j, d, nb) for j in range(n)]
                write[b] = s.dense_unit(n - 1, d, nb)
            dense_ids.append(jnp.asarray(ids))
            dense_write.append(jnp.asarray(write))

        head = head_params(params)  # embed / logits read no layer weights: do not pass them
        x = layer_ops.embed(model, head, jnp.asarray(tok))
        for layer in range(model.cfg.num_layers):
            lp = self.layer_params[layer]
            if layer < p.dense_layers:
                self.kv, x = layer_ops.dense_layer(model, lp, self.kv, x, positions_d, dense_write[layer],
                                                   dense_ids[layer], dense_lens, attention=cfg.attention)
                continue
            sl = layer - p.dense_layers
            meta_offset, unit_offset, rh, sl_d, coarse_offset = self._layer_scalars[sl]
            self.kv, q, sel = layer_ops.sparse_pre(
                model, lp, self.kv, self.meta_min, self.meta_max, meta_offset, unit_offset, x, positions_d,
                newest_d, cand_d, nblk_d, rh, kept_l_d, kept_gpu_d, slot_keys_d, sl_d, self.cmeta_min,
                self.cmeta_max, coarse_offset, groups_d, budget=p.budget_blocks, sink=p.sink_blocks,
                window=p.window_blocks, mode=p.selection, solohead=cfg.solohead, attention=cfg.attention,
                scoring=cfg.scoring, coarse=coarse)
            yield "select", sel, None
            res, late, recall = self._plan_layer(np.asarray(sel), sparse, lengths, layer, sl)
            staging = self._issue_recall(sl, recall, sparse)
            if staging is not None and cfg.recall == "sync":
                yield "recall", staging[0], q
            if staging is None or cfg.recall == "sync":
                if staging is not None:
                    self.kv = self._scatter(layer, staging)
                both = [[r + t for r, t in zip(rr, tt, strict=True)] for rr, tt in zip(res, late, strict=True)]
                ids, lens = self._ids(both, bp)
                x = layer_ops.attend_merge_finish(model, lp, x, q, self.kv, ids, lens, None, attention=cfg.attention)
                continue
            ids, lens = self._ids(res, bp)
            early = layer_ops.attend(q, self.kv, ids, lens, attention=cfg.attention)
            yield "recall", staging[0], early[0]
            self.kv = self._scatter(layer, staging)
            ids, lens = self._ids(late, bp)
            x = layer_ops.attend_merge_finish(model, lp, x, q, self.kv, ids, lens, early, attention=cfg.attention)
        outs[key] = layer_ops.logits(model, head, x)

    def _ids(self, entries: list[list[list[tuple[int, int]]]], bp: int) -> tuple[jax.Array, jax.Array]:
        """[(unit, len)] per row and lane -> padded ids / lens [bp, S, W] (W a power of two)."""
        width = bucket(max(len(v) for per in entries for v in per))
        ids = _pad_rows([[[u for u, _ in v] for v in per] for per in entries], width, bp, self.plan.lanes, -1)
        lens = _pad_rows([[[n for _, n in v] for v in per] for per in entries], width, bp, self.plan.lanes, 0)
        return jnp.asarray(ids), jnp.asarray(lens)

    def _plan_layer(self, sel: np.ndarray, sparse: list[SparseKV], lengths: list[int], layer: int, sl: int):
        """Selection [bp, S, N] -> per row and lane: resident entries, late (recalled) entries as (unit, len),
        and the recall list [(row index b, host row, lane, slot block)]."""
        p, nb, bs = self.plan, self.nb, self.plan.block_size
        # device placement: every block is resident, nothing is recalled; the slot caches still track what host
        # placement would hold where selection reads it (the resident-block bonus), so both select the same
        bookkeep = p.placement == "device" and self.config.scoring.favours_resident(p.selection, self.config.solohead)
        res: list[list[list[tuple[int, int]]]] = []
        late: list[list[list[tuple[int, int]]]] = []
        recall: list[tuple[int, int, int, int]] = []
        for b, s in enumerate(sparse):
            res_b, late_b = [], []
            for lane in range(p.lanes):
                chosen = [int(j) for j in sel[b, lane] if j >= 0]
                r = [(layer * nb + s.gpu_of[j], min(bs, lengths[b] - j * bs)) for j in chosen if s.is_resident(j)]
                middle = [j for j in chosen if not s.is_resident(j)]
                if bookkeep:
                    s.caches[sl][lane].plan([j for j in chosen if s.is_middle(j)])
                late_l = []
                if middle:
                    hits, misses = s.caches[sl][lane].plan(middle)
                    s.counters.reused_blocks += len(hits)
                    r += [(layer * nb + s.slot_blocks[slot], bs) for _, slot in hits]
                    for j, slot in misses:
                        recall.append((b, s.host_rows[j], lane, s.slot_blocks[slot]))
                        late_l.append((layer * nb + s.slot_blocks[slot], bs))
                res_b.append(r)
                late_b.append(late_l)
            res.append(res_b)
            late.append(late_b)
        return res, late, recall

    def _issue_recall(self, sl: int, recall: list[tuple[int, int, int, int]], sparse: list[SparseKV]):
        """Start the host-to-device copies of `recall`; returns (device staging, dst blocks, heads or None) or
        None when nothing is missing. Counts bytes / transfers / blocks per request."""
        if not recall:
            return None
        pool, p = self.pool, self.plan
        solo = p.selection == "solohead"
        for b, _, _, _ in recall:
            sparse[b].counters.recalled_blocks += 1
        if self.config.io == "coalesced":
            rows = [r for _, r, _, _ in recall]
            dst = [d for _, _, _, d in recall]
            for b in {b for b, _, _, _ in recall}:
                sparse[b].counters.recall_transfers += 1
            if solo:
                staging, heads = pool.gather_blocks(sl, rows), None
                unit = pool.layer_block_bytes
            else:
                heads = [h for _, _, h, _ in recall]
                staging, unit = pool.gather_units(sl, rows, heads), pool.unit_bytes
            for b, _, _, _ in recall:
                sparse[b].counters.recall_bytes += unit
                sparse[b].counters.last_step_recall_bytes += unit
        else:  # fragmented: one copy per (block, head)
            hkv = self.model.cfg.num_kv_heads
            units = [(b, r, h, d) for b, r, lane, d in recall for h in (range(hkv) if solo else (lane,))]
            rows = [r for _, r, _, _ in units]
            heads = [h for _, _, h, _ in units]
            dst = [d for _, _, _, d in units]
            staging = pool.fragment_units(sl, rows, heads)
            for b, _, _, _ in units:
                sparse[b].counters.recall_transfers += 1
                sparse[b].counters.recall_bytes += pool.unit_bytes
                sparse[b].counters.last_step_recall_bytes += pool.unit_bytes
        n = staging.shape[0]
        dst_p = np.zeros(n, np.int32)
        dst_p[: len(dst)] = dst
        heads_p = None
        if heads is not None:
            heads_p = np.zeros(n, np.int32)
            heads_p[: len(heads)] = heads
        return staging, dst_p, heads_p

    def _scatter(self, layer: int, staging) -> jax.Array:
        data, dst, heads = staging
        if heads is None:
            return layer_ops.scatter_blocks(self.kv, jnp.int32(layer), data, jnp.asarray(dst))
        return layer_ops.scatter_units(self.kv, jnp.int32(layer), data, jnp.asarray(dst), jnp.asarray(heads))
