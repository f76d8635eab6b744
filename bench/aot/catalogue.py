"""The engine's GPU programs at the shapes it makes them, built the way the engine builds them (no device).

Each builder mirrors one path of the engine and returns `Call`s (program, runs per decode step):
  - `dense_decode`: engine._decode_dense + dense.decode_step(_layerwise) + sampling;
  - `prefill`: engine._prefill_compute over a whole prompt, chunk by chunk;
  - `sparse_decode`: sparse_decoder.SparseDecoder.decode (recall ahead: the step as one program,
    sparse_step.ahead_step, after sparse_step.land_step where a recall lands; same-layer schedules, per
    micro-batch: embed, dense layers, per sparse layer sparse_pre / attend / land_attend_finish, logits; the
    recall's host programs; write-back and key bounds of the blocks leaving the window), at a given recall size per
    layer;
  - `offloaded_prefill`: an offloaded prompt's layer-segmented prefill and the spill of each layer (write-back, key
    bounds, copies);
  - `swap_programs`: a preempted request's GPU blocks out to the swap space and back (dense or offloaded);
  - `allocations`, `probes`: the zero-filled pools and the engine's start-up probes.
Host-built inputs come from the same functions the engine uses (`pulseinfer_jax.runner.sparse_inputs`, `offload`,
`SparseKV`), so shapes cannot drift; `tests/test_aot_catalogue.py` checks on CPU that a tiny engine compiles
nothing the catalogue lacks. Arguments are `Spec`s: building a catalogue needs no GPU, only jax's tracing
(`jax.eval_shape`) for the shapes of intermediate pytrees (a sparse layer's plan).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from pulseinfer_jax.host_offload import numpy_io, swap, xla_io
from pulseinfer_jax.host_offload.placement import SparseKV
from pulseinfer_jax.models.moe import MoEOptions
from pulseinfer_jax.models.transformer import Transformer

from bench.aot.programs import HOST, PLACED, Call, Program, Spec, _is_spec, program, spec, specs_of
from pulseinfer_jax.config import EngineConfig
from pulseinfer_jax.kv.blocks import blocks_for, bucket
from pulseinfer_jax.kv.cache import bucket_blocks
from pulseinfer_jax.kv.quant import block_rows, resolve_kv_dtype, storage_dtype
from pulseinfer_jax.runner import dense, sampling, sparse_layer, sparse_step
from pulseinfer_jax.runner.offloaded_prefill import chunk_plan, chunk_size
from pulseinfer_jax.runner.sparse_inputs import (
    KeyBounds,
    Landing,
    PlacedRows,
    ScoringBounds,
    SelectSpec,
    SparseLayerRefs,
    micro_batch_inputs,
    slot_step_inputs,
)
from pulseinfer_jax.sched.pools import pool_sizes
from pulseinfer_jax.selection import slot_plan

I32 = jnp.int32
ATTENTION = ("sparse_decode_attention",)  # the Pallas kernel of every decode attention with attention="pallas"
SCORING = ("block_scores",)


@dataclasses.dataclass(frozen=True)
class EngineShapes:
    """One engine as it runs on a GPU: the model (with the MoE options of that platform), its config and the
    backends the engine resolved (decode attention, layer loop, host I/O)."""

    model: Transformer
    config: EngineConfig
    attention: str = "pallas"
    layer_loop: str = "layerwise"
    host_io: str = "xla"
    platform: str = "gpu"  # runner's compile key: "cpu" compiles get CPU fast-math options
    default: bool = True  # the engine's default configuration (its programs' spills fail the check)

    @staticmethod
    def of(cfg, dtype, config: EngineConfig, *, attention: str = "pallas", layer_loop: str = "layerwise",
           host_io: str = "xla", platform: str = "gpu", default: bool = True) -> EngineShapes:
        from pulseinfer_jax.backends import plan_backends

        moe = plan_backends(config, platform, is_moe=cfg.is_moe).moe or MoEOptions()
        return EngineShapes(Transformer(cfg, jnp.dtype(dtype), moe=moe), config, attention, layer_loop, host_io,
                            platform, default)

    def program(self, function: str, group: str, fn: Any, args: tuple, statics: dict | None = None, *,
                pallas: tuple[str, ...] = (), **kw) -> Program:
        """A program of this engine: default as the engine is; `pallas` kernels expected only with Pallas on."""
        return program(function, group, fn, args, statics, default=self.default,
                       pallas=pallas if self.attention == "pallas" and self.platform != "cpu" else (), **kw)

    @property
    def name(self) -> str:
        return self.model.cfg.name or "model"

    @functools.cached_property
    def layer_params(self) -> Any:
        return specs_of(jax.eval_shape(self.model.init_layer, jax.random.key(0)))

    @functools.cached_property
    def head_params(self) -> dict:
        return {"embedder": specs_of(jax.eval_shape(self.model.init_embedder, jax.random.key(0)))}

    @functools.cached_property
    def stacked_params(self) -> dict:
        return specs_of(jax.eval_shape(self.model.init, jax.random.key(0)))

    @property
    def kv_dtype(self) -> jnp.dtype:
        """The cache arrays' dtype (EngineConfig.kv_dtype: the model's, or float8's bytes with their scales)."""
        return storage_dtype(resolve_kv_dtype(self.config.kv_dtype, self.model.dtype))

    @property
    def kv_rows(self) -> int:
        """Rows of a block's K (and V): block_size, plus float8's scale rows."""
        return block_rows(self.config.block_size, self.model.cfg.head_dim, self.kv_dtype)

    def kv(self, num_blocks: int) -> Spec:
        c = self.model.cfg
        return spec((c.num_layers, num_blocks, 2, self.kv_rows, c.num_kv_heads, c.head_dim), self.kv_dtype)

    def x(self, batch: int, tokens: int = 1) -> Spec:
        return spec((batch, tokens, self.model.cfg.hidden_size), self.model.dtype)


class _Request:
    """What offload's sizing helpers read of a scheduler Request: the prompt, the tokens it reaches and those its first
    dense blocks hold."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int):
        self.prompt = range(prompt_tokens)
        self.need_tokens = prompt_tokens + max_new_tokens
        self.start_tokens = min(self.need_tokens, prompt_tokens + 1)  # (a dense request's first blocks hold these)


def _scalar(memory: str | None = None) -> Spec:
    return spec((), I32, memory)


def _vec(n: int, memory: str | None = None) -> Spec:
    return spec((n,), I32, memory)


def out_shapes(p: Program) -> Any:
    """The program's outputs as ShapeDtypeStructs (traced on the default backend; nothing runs)."""
    flat, tree = jax.tree.flatten(p.args, is_leaf=_is_spec)
    dyn = [i for i, x in enumerate(flat) if isinstance(x, Spec)]

    def f(*vals):
        full = list(flat)
        for i, v in zip(dyn, vals, strict=True):
            full[i] = v
        return p.fn(*jax.tree.unflatten(tree, full), **p.statics)

    return jax.eval_shape(f, *(jax.ShapeDtypeStruct(flat[i].shape, flat[i].dtype) for i in dyn))


# ---- dense requests ----------------------------------------------------------------------------
def sample_calls(es: EngineShapes, batch: int, greedy: bool = True) -> list[Call]:
    """The sampling of one step's logits [batch, V] (engine._sample)."""
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (es.head_params, es.x(batch)), is_leaf=_is_spec)
    out = jax.eval_shape(lambda h, x: es.model.logits(h, x[:, 0]), *x)
    logits = spec(out.shape, out.dtype)
    rows = None
    if not greedy:
        f32 = jnp.float32
        rows = sampling.SamplingRows(spec((batch,), f32), _vec(batch), spec((batch,), f32), _vec(batch), _vec(batch),
                                     spec((), jnp.uint32))
    return [Call(es.program("sample_tokens", "sampling", sampling.sample_tokens, (logits, rows)))]


def dense_decode(es: EngineShapes, lengths: list[int], max_new_tokens: int, *, num_blocks: int | None = None,
                 table_width: int | None = None, greedy: bool = True, group: str = "dense") -> list[Call]:
    """One decode step of dense requests holding `lengths` tokens whose blocks were reserved for `max_new_tokens`
    more (the scheduler reserves prompt + max new): batch bucket(n), tables bucket_blocks(most blocks) wide (or
    `table_width`: a bench's own tables)."""
    bs = es.config.block_size
    blocks = [blocks_for(n + max_new_tokens, bs) for n in lengths]
    b, mb = bucket(len(lengths)), table_width or bucket_blocks(max(blocks))
    nb = num_blocks or sum(blocks) + 1
    model, kv = es.model, es.kv(nb)
    tok, pos, tables = _vec(b), _vec(b), spec((b, mb), I32)
    att = {"attention": es.attention}
    # the listed blocks that hold tokens (the attention reads its sequence's, not the table's padding)
    valid = ((ATTENTION[0], sum(blocks_for(n + 1, bs) for n in lengths) / (b * mb)),)
    if es.layer_loop == "scan":
        step = dense._compiled(dense._decode_step, es.platform)
        calls = [Call(es.program("_decode_step", group, step, (model, es.stacked_params, kv, tok, pos, tables), att,
                                 pallas=ATTENTION, valid=valid))]
    else:
        layer = dense._compiled(dense._decode_layer, es.platform)
        x = es.x(b)
        calls = [Call(es.program("embed", group, sparse_layer.embed, (model, es.head_params, tok))),
                 Call(es.program("_decode_layer", group, layer, (model, es.layer_params, kv, x, pos, tables,
                                                                 _scalar()), att, pallas=ATTENTION, valid=valid),
                      model.cfg.num_layers),
                 Call(es.program("logits", group, sparse_layer.logits, (model, es.head_params, x)))]
    return calls + sample_calls(es, b, greedy)


def swap_programs(es: EngineShapes, num_blocks: int, request_blocks: int, group: str = "dense") -> list[Call]:
    """A preempted request's swap (host_offload/swap.py): its `request_blocks` (a dense request's table, an
    offloaded one's steady GPU blocks: `SparsePlan.gpu_blocks`) gathered from a cache of `num_blocks` (then copied to
    host memory) and scattered back on resumption, in chunks of at most `swap.CHUNK_BLOCKS` blocks, one program each
    at the width the swap space buckets the chunk to (the last chunk's may be narrower). Counts are programs per
    preemption, not per step. (An offloaded request's recalls in flight land first, `sparse_layer.land`: one of
    `sparse_decode`'s programs.)"""
    c = swap.CHUNK_BLOCKS
    widths = collections.Counter(bucket(min(c, request_blocks - i)) for i in range(0, request_blocks, c))
    kv = es.kv(num_blocks)
    calls = []
    for n, chunks in sorted(widths.items(), reverse=True):
        data = spec((kv.shape[0], n, *kv.shape[2:]), kv.dtype)
        calls += [Call(es.program("_gather", group, swap._gather, (kv, _vec(n))), chunks),
                  Call(es.program("_scatter", group, swap._scatter, (kv, _vec(n), data)), chunks)]
    return calls


def prefill(es: EngineShapes, prompt_tokens: int, table_blocks: int, *, num_blocks: int | None = None,
            group: str = "prefill") -> list[Call]:
    """Every chunk of one prompt's dense prefill (engine._prefill_compute) into a table of `table_blocks` GPU blocks
    (a dense request's reservation), then its first token's sampling. Counts are per prompt."""
    cfg, model = es.config, es.model
    bs = cfg.block_size
    mb = bucket_blocks(table_blocks)
    kv = es.kv(num_blocks or table_blocks + 1)
    calls: dict[str, Call] = {}

    def add(p: Program, n: float = 1.0) -> None:
        have = calls.get(p.key)
        calls[p.key] = Call(p, n + (have.count if have else 0.0))

    start = 0
    while start < prompt_tokens:
        remaining = prompt_tokens - start
        size = chunk_size(remaining, cfg.prefill_chunk, bs)
        kc = {"key_chunk": min(cfg.key_chunk, size)}
        args = (_vec(size), _scalar(), _scalar(), _vec(mb))
        if es.layer_loop == "scan":
            add(es.program("_prefill_step", group, dense._compiled(dense._prefill_step, es.platform),
                        (model, es.stacked_params, kv, *args), kc))
        else:
            x = es.x(1, size)
            add(es.program("_prefill_embed", group, dense._compiled(dense._prefill_embed, es.platform),
                        (model, es.head_params, _vec(size))))
            add(es.program("_prefill_layer", group, dense._compiled(dense._prefill_layer, es.platform),
                        (model, es.layer_params, kv, x, _scalar(), _vec(mb), _scalar()), kc), model.cfg.num_layers)
            add(es.program("_prefill_logits", group, dense._compiled(dense._prefill_logits, es.platform),
                        (model, es.head_params, x, _scalar())))
        start += min(size, remaining)
    return list(calls.values()) + sample_calls(es, 1)


# ---- offloaded requests ------------------------------------------------------------------------
@dataclasses.dataclass
class SparseLayout:
    """What an engine allocates for requests submitted together (Engine.ensure_pool: `pools.pool_sizes`) and the
    SparseKVs of those it offloads, in their first decode step (`lengths` = prompt + 1 tokens): plan, GPU blocks,
    host rows, and the shapes of the pools built from them."""

    es: EngineShapes
    plan: Any
    requests: list[SparseKV]
    lengths: list[int]
    num_gpu_blocks: int
    host_rows: int

    @staticmethod
    def of(es: EngineShapes, prompts: list[int], max_new_tokens: int, *, offloaded: list[int] | None = None,
           cap_bytes: int | None = None) -> SparseLayout:
        """`prompts` submitted together, `offloaded` of them (indices, default all) offloaded; the pools are
        capped at `cap_bytes` (default: config.gpu_kv_budget, else unbounded)."""
        cfg, c = es.config, es.model.cfg
        reqs = [_Request(n, max_new_tokens) for n in prompts]
        cap = cap_bytes or cfg.gpu_kv_budget or 1 << 62
        meta_item = cfg.scoring.metadata_dtype(es.model.dtype).itemsize
        sizes = pool_sizes(cfg, c, es.kv_dtype, meta_item, reqs, cap)
        plan, nb = sizes.plan, sizes.num_blocks
        align = cfg.scoring.coarse_group  # host rows go out in aligned extents (the first holds the null row)
        out, next_block, next_row = [], 1, align if align > 1 else 1
        for i in (range(len(reqs)) if offloaded is None else offloaded):
            r = reqs[i]
            own, n_rows = plan.gpu_blocks(r.need_tokens), blocks_for(r.need_tokens, cfg.block_size)
            n_rows = -(-n_rows // align) * align
            if next_block + own > sizes.num_blocks or next_row + n_rows > sizes.host_rows:
                raise ValueError(f"request {i} does not fit the pools ({sizes}); the admission would not offload it")
            rows = list(range(next_row, next_row + blocks_for(r.need_tokens, cfg.block_size)))
            s = SparseKV(plan, i, r.need_tokens, list(range(next_block, next_block + own)), rows, slot_row=len(out))
            next_block, next_row = next_block + own, next_row + n_rows
            s.prefill_done(len(r.prompt))
            s.advance(len(r.prompt) + 1)
            out.append(s)
        return SparseLayout(es, plan, out, [len(r.prompt) + 1 for r in (reqs[s.owner] for s in out)], nb,
                            sizes.host_rows)

    # pools and per-engine device state
    @property
    def meta(self) -> Spec:
        es, sc = self.es, self.es.config.scoring
        c = es.model.cfg
        return spec((self.plan.sparse_layers * self.host_rows * sc.sub_blocks, c.num_kv_heads, c.head_dim),
                    sc.metadata_dtype(es.model.dtype))

    @property
    def coarse_meta(self) -> Spec:
        es, sc = self.es, self.es.config.scoring
        c = es.model.cfg
        f = sc.coarse_group
        rows = self.plan.sparse_layers * (self.host_rows // f) if f > 1 else 1
        return spec((rows, c.num_kv_heads, c.head_dim), sc.metadata_dtype(es.model.dtype))

    @property
    def bounds(self) -> ScoringBounds:
        """The sparse decoder's key bounds (SparseDecoder.bounds)."""
        fine, coarse = self.meta, self.coarse_meta
        return ScoringBounds(KeyBounds(fine, fine), KeyBounds(coarse, coarse))

    @property
    def pool(self) -> Spec:
        c, rows = self.es.model.cfg, self.es.kv_rows
        memory = HOST if self.es.host_io == "xla" else None
        return spec((self.plan.sparse_layers, self.host_rows, 2, rows, c.num_kv_heads, c.head_dim), self.es.kv_dtype,
                    memory)

    def arrivals(self, rows: int) -> Spec:
        """The attention kernel's split-merge counters (SparseDecoder.arrivals) in a step of `rows` rows per call."""
        c = self.es.model.cfg
        return spec((bucket(max(self.es.config.max_batch + 1, rows)) * c.num_kv_heads,), I32)

    @property
    def slot_state(self) -> tuple[Spec, Spec]:
        rows = bucket(self.es.config.max_batch + 1)  # SparseDecoder sizes it for max_batch + the padding rows' own
        s = spec((self.plan.sparse_layers, rows, self.plan.lanes, self.plan.slot_blocks), I32)
        return (s, s)


def _io(es: EngineShapes, first_layer: int, host_sharding, dev_sharding):
    return xla_io.transfers(host_sharding, dev_sharding, first_layer)


def sparse_decode(es: EngineShapes, layout: SparseLayout, recall: int, *, shardings=None, micro_batches: int = 2,
                  group: str = "sparse", first_of_ahead: bool = False, placed: list[int] | None = None) -> list[Call]:
    """One decode step of `layout`'s requests with `recall` misses per sparse layer and micro-batch (0 = none),
    SparseDecoder.decode's calls. `shardings(memory_kind)` gives the host / device shardings the host I/O programs
    are jitted with (the compile target's; needed only for host_io "xla"). `first_of_ahead`: the same-layer step
    recall ahead runs when a request decodes for the first time (spare blocks, late rows). `placed`: the token
    counts of dense-placed requests decoding in the same layer pass (recall ahead only; `PlacedRows`): their rows
    follow the offloaded ones in every call, and the step samples both (the caller compiles their own step too, for
    an offloaded request's first step, at count 0). Their attention's valid fraction is taken as the offloaded rows'
    (the cost of a mixed step is approximate)."""
    if placed and es.config.ablation.recall != "ahead":
        raise ValueError("dense-placed requests share the layer pass only with recall='ahead'")
    cfg, model, plan = es.config, es.model, layout.plan
    c = model.cfg
    sc = cfg.scoring
    sl_n = plan.sparse_layers
    reqs = layout.requests
    calls: dict[str, Call] = {}

    def add(p: Program, n: float) -> None:
        have = calls.get(p.key)
        calls[p.key] = Call(p, n + (have.count if have else 0.0))

    host_s = shardings(HOST) if shardings is not None else None
    dev_s = shardings("device") if shardings is not None else None
    if cfg.ablation.recall == "ahead":  # the driver runs the batch as one
        micro_batches = 1
        # a request's first step recalls in the layer (nothing was prefetched for it), after the recalls in flight
        # land: compiled, not counted per step
        same = dataclasses.replace(es, config=cfg.with_settings(recall="interruptible", micro_batches=1))
        for call in sparse_decode(same, layout, recall, shardings=shardings, micro_batches=1, group=group,
                                  first_of_ahead=True):  # (no placed rows: they run their own step then)
            add(call.program, 0.0)
        # (`land_pending`: before a request's first step, or before a finished request's blocks are freed; the
        # one-program step's `land_step` is the per-step one below)
        if recall and not _one_program(cfg):
            fan = c.num_kv_heads if (cfg.ablation.io == "fragmented" and plan.selection == "solohead") else 1
            staging = _recall_calls(es, layout, recall, lambda p, n: None, host_s, dev_s, sl_n, group)
            landing = _landing(layout, len(reqs), staging)
            add(es.program("land", group, sparse_layer.land, (es.kv(layout.num_gpu_blocks), _scalar(), landing),
                           {"fan": fan}), 0.0)
    k = max(1, min(micro_batches, len(reqs)))
    bounds = np.linspace(0, len(reqs), k + 1).astype(int)
    groups = [list(range(bounds[i], bounds[i + 1])) for i in range(k)]
    kv = es.kv(layout.num_gpu_blocks)
    slots = layout.slot_state
    layer_refs = SparseLayerRefs(*(_scalar() for _ in dataclasses.fields(SparseLayerRefs)))

    for g in groups:
        members = [reqs[j] for j in g]
        mb = micro_batch_inputs(plan, sc, es.config.ablation.solohead, layout.num_gpu_blocks, members,
                                [0] * len(members), [layout.lengths[j] for j in g])
        bp = mb.tokens.shape[0]
        step = specs_of(slot_step_inputs(members, mb.tables, bp, slots[0].shape[1], slots[0].shape[3],
                                         spare=first_of_ahead))
        bs = cfg.block_size
        placed_rows = specs_of(PlacedRows.of([list(range(1, blocks_for(n + 1, bs) + 1)) for n in placed], placed, bs)
                               ) if placed else None
        bd = placed_rows.positions.shape[0] if placed else 0
        x = es.x(bp + bd)
        rows_spec = specs_of(mb.rows)
        kc = mb.rows.candidates.rows.shape[1]
        n_blk = mb.rows.candidates.num_blocks.astype(np.int64)
        dense_valid = ((ATTENTION[0], float(n_blk.sum()) / (bp * kc)),)  # the listed blocks holding tokens
        middle = np.clip(n_blk - plan.sink_blocks - plan.window_blocks, 0, None)
        listed = n_blk if sc.scores_kept(plan.selection, cfg.ablation.solohead) else middle  # (sinks, window too)
        scored = ((SCORING[0], float(listed.sum()) / (bp * kc)),)  # candidates that are blocks, not padding
        dense = specs_of(mb.dense)
        select = SelectSpec.of(plan, cfg.ablation.solohead, es.attention, sc, coarse=mb.coarse)
        if _one_program(cfg):  # the whole step, sampling included, as one program; its recall lands before the next
            step = specs_of(slot_step_inputs(members, mb.tables, bp, slots[0].shape[1], slots[0].shape[3],
                                             spare=True))
            if recall:  # the previous step's recall lands in a program of its own, just before the step's
                landing = _step_landing(layout, len(members),
                                        _step_recall_calls(es, layout, recall, add, host_s, group))
                add(es.program("land_step", group, sparse_step.land_step, (kv, landing),
                               {"dense_layers": plan.dense_layers, "width": bucket(recall)}), 1)
            per_row = min(float(recall) / len(members), plan.budget_blocks * plan.lanes) if recall else 0.0
            early_frac = len(members) * (plan.budget_blocks * plan.lanes - per_row) / (bp * plan.budget_blocks
                                                                                         * plan.lanes)
            # one attention kernel name for the dense layers' and the sparse layers' calls: their valid fractions
            # weighted by the entries each lists, so that the step's attention bytes add up
            dense_entries = plan.dense_layers * bp * kc
            sparse_entries = sl_n * bp * plan.lanes * plan.budget_blocks
            attn_valid = ((dense_valid[0][1] * dense_entries + early_frac * sparse_entries)
                          / (dense_entries + sparse_entries))
            host_rows = layout.pool.shape[1]
            group_rows = host_rows // sc.coarse_group if sc.coarse_group > 1 else 1
            refs = sparse_step.StepRefs(tuple(SparseLayerRefs.of(plan, i, host_rows, layout.num_gpu_blocks,
                                                                 group_rows) for i in range(sl_n)))
            add(es.program("ahead_step", group, sparse_step.ahead_step, (
                model, es.head_params, (es.layer_params,) * c.num_layers, kv, layout.bounds, slots,
                layout.arrivals(bp + bd), _vec(bp + bd), rows_spec, dense, step, placed_rows, None),
                {"refs": refs, "spec": select, "attention": es.attention},
                pallas=SCORING + ATTENTION, valid=scored + ((ATTENTION[0], attn_valid),)), 1)
            continue
        add(es.program("embed", group, sparse_layer.embed, (model, es.head_params, _vec(bp + bd))), 1)
        for d in range(plan.dense_layers):
            add(es.program("dense_layer", group, sparse_layer.dense_layer,
                           (model, es.layer_params, kv, x, rows_spec.positions, dense.write[d], dense.ids[d],
                            dense.lens, placed_rows, _scalar() if placed else None, layout.arrivals(bp + bd)),
                           {"attention": es.attention},
                           pallas=ATTENTION, valid=dense_valid), 1)
        fan = c.num_kv_heads if (cfg.ablation.io == "fragmented" and plan.selection == "solohead") else 1
        if cfg.ablation.recall == "ahead":  # one call per sparse layer; the recall lands in the next step's call
            step = specs_of(slot_step_inputs(members, mb.tables, bp, slots[0].shape[1], slots[0].shape[3],
                                             spare=True))
            landing = None
            if recall:
                staging = _recall_calls(es, layout, recall, add, host_s, dev_s, sl_n, group)
                landing = _landing(layout, len(members), staging)
            per_row = min(float(recall) / len(members), plan.budget_blocks * plan.lanes) if recall else 0.0
            early_frac = len(members) * (plan.budget_blocks * plan.lanes - per_row) / (bp * plan.budget_blocks
                                                                                         * plan.lanes)
            add(es.program("ahead_layer", group, sparse_layer.ahead_layer, (
                model, es.layer_params, kv, x, layout.bounds, slots, rows_spec, step, layer_refs, landing, placed_rows,
                layout.arrivals(bp + bd)),
                {"spec": select, "attention": es.attention, "fan": fan}, pallas=SCORING + ATTENTION,
                valid=scored + ((ATTENTION[0], early_frac),)), sl_n)
            add(es.program("logits", group, sparse_layer.logits, (model, es.head_params, x)), 1)
            continue
        pre = es.program("sparse_pre", group, sparse_layer.sparse_pre, (
            model, es.layer_params, kv, x, layout.bounds, slots, rows_spec, step, layer_refs), {"spec": select},
            pallas=SCORING, valid=scored)
        add(pre, sl_n)
        _, _, q, _, plan_out, _ = out_shapes(pre)
        q, plan_spec = specs_of(q), specs_of(plan_out)
        n_sel = plan_spec.early[0].shape[-1] * plan.lanes  # entries a row lists: its whole selection
        rows = len(members)
        per_row = min(float(recall) / rows, n_sel) if recall else 0.0  # misses per real row
        early_valid = ((ATTENTION[0], rows * (n_sel - per_row) / (bp * n_sel)),)
        attend = es.program("attend", group, sparse_layer.attend, (q, kv, plan_spec.early), {"attention": es.attention},
                            pallas=ATTENTION, valid=early_valid)
        early = specs_of(out_shapes(attend))
        staging = None
        if recall:
            staging = _recall_calls(es, layout, recall, add, host_s, dev_s, sl_n, group)
        eager = cfg.ablation.recall == "eager"
        interrupt = recall and cfg.ablation.recall != "sync"
        if eager or interrupt:
            add(attend, sl_n)
        width = min(bucket(recall), plan.budget_blocks) if recall else 0
        # the landing attends the late entries (width per lane), and the early ones too when none came in
        late = rows * per_row / (bp * width * plan.lanes) if width else 0.0
        land_valid = ((ATTENTION[0], late if (eager or interrupt) else early_valid[0][1]),)
        add(es.program("land_attend_finish", group, sparse_layer.land_attend_finish, (
            model, es.layer_params, x, q, kv, _scalar(), plan_spec, staging,
            early if (eager or interrupt) else None, spec((bp,), jnp.bool_) if first_of_ahead and width else None),
            {"attention": es.attention, "width": width, "fan": fan},
            pallas=ATTENTION, valid=land_valid), sl_n)
        add(es.program("logits", group, sparse_layer.logits, (model, es.head_params, x)), 1)
    # every block_size steps each request's oldest window block leaves: written back (its key bounds are complete: each
    # key joined them in the scoring kernel as it was written)
    n_exit = len(reqs)
    per_step = 1.0 / cfg.block_size
    for p in write_back_programs(es, layout, n_exit, host_s, dev_s, group):
        add(p, per_step)
    if sc.coarse_group > 1:
        add(refresh_coarse_program(es, layout, n_exit, group), per_step)
    if _one_program(cfg):  # (sampled inside the step)
        return list(calls.values())
    # the sparse logits come back to the host unpadded: sampled at exactly len(reqs) rows (and the placed ones)
    return list(calls.values()) + sample_calls(es, len(reqs) + len(placed or ()))


def _one_program(cfg: EngineConfig) -> bool:
    """Whether the engine runs a recall-ahead step as one program (SparseDecoder.decode: all but the per-head
    baseline's fragmented copies)."""
    return cfg.ablation.recall == "ahead" and cfg.ablation.io == "coalesced"


def _step_landing(layout: SparseLayout, rows: int, staging: Spec) -> sparse_step.StepLanding:
    """A step recall's landing for `rows` requests (bucketed): its staging, each layer's offset, the step's plan."""
    plan = layout.plan
    b, n, sl_n = bucket(rows), plan.budget_blocks, plan.sparse_layers
    return sparse_step.StepLanding(staging, _vec(sl_n), spec((sl_n, b, plan.lanes, n), I32),
                                   spec((sl_n, b, plan.lanes, n + 4), I32))


def _step_recall_calls(es: EngineShapes, layout: SparseLayout, recall: int, add, host_s, group: str) -> Spec:
    """The host program of a step's recall (`HostKVPool.recall_step`: every sparse layer's `recall` misses in one
    staging buffer, each layer's window `bucket(recall)` inside it), added once; returns that staging."""
    plan, c = layout.plan, es.model.cfg
    bs, dt = es.kv_rows, es.kv_dtype
    solo = plan.selection == "solohead"
    n = bucket(plan.sparse_layers * recall - recall + bucket(recall))  # (SparseDecoder._issue_step_recall)
    if es.host_io == "xla":
        blocks, units = xla_io.row_transfers(host_s)
        add(es.program("<lambda>", "host_io", blocks if solo else units,
                       (layout.pool, spec((2 if solo else 3, n), I32, PLACED)),
                       tag="stage_rows" if solo else "stage_row_units"), 1)
    return spec((n, 2, bs, c.num_kv_heads, c.head_dim) if solo else (n, 2, bs, c.head_dim), dt)


def _landing(layout: SparseLayout, rows: int, staging: Spec) -> Landing:
    """A recall's landing for `rows` requests (bucketed): its staging and the plan's miss lists and info."""
    plan = layout.plan
    b, n = bucket(rows), plan.budget_blocks
    return Landing(staging, spec((b, plan.lanes, n), I32), spec((b, plan.lanes, n + 4), I32))


def _recall_calls(es: EngineShapes, layout: SparseLayout, recall: int, add, host_s, dev_s, sl_n: int,
                  group: str) -> Spec:
    """The host programs of one sparse layer's recall (`HostKVPool.gather_blocks` / `gather_units` /
    `fragment_units`), added `sl_n` times; returns the staging the landing call receives."""
    cfg, plan, c = es.config, layout.plan, es.model.cfg
    bs, dt = es.kv_rows, es.kv_dtype  # (rows of a stored block: float8's scales travel with it)
    solo = plan.selection == "solohead"
    pool = layout.pool
    if cfg.ablation.io == "coalesced":
        n = bucket(recall)
        if es.host_io == "xla":
            _, stage_blocks, stage_units, _, _ = _io(es, plan.dense_layers, host_s, dev_s)
            if solo:
                add(es.program("stage_blocks_outer", "host_io", stage_blocks, (pool, _scalar(HOST), _vec(n, PLACED))),
                    sl_n)
            else:
                add(es.program("stage_units_outer", "host_io", stage_units,
                            (pool, _scalar(HOST), spec((2, n), I32, PLACED))), sl_n)
        return spec((n, 2, bs, c.num_kv_heads, c.head_dim) if solo else (n, 2, bs, c.head_dim), dt)
    units = recall * c.num_kv_heads if solo else recall
    n = bucket(units)
    if es.host_io == "xla":
        fragment = _io(es, plan.dense_layers, host_s, dev_s)[3]
        add(es.program("fragment", "host_io", fragment, (pool, _scalar(), _vec(n), _vec(n))), sl_n)
    return spec((n, 2, bs, c.head_dim), dt)


def write_back_programs(es: EngineShapes, layout: SparseLayout, blocks: int, host_s, dev_s,
                        group: str = "sparse") -> list[Program]:
    """HostKVPool.write_back of `blocks` GPU blocks (padded to a power of two)."""
    n = bucket(blocks)
    kv = es.kv(layout.num_gpu_blocks)
    first = layout.plan.dense_layers
    if es.host_io == "xla":
        write = _io(es, first, host_s, dev_s)[0]
        return [es.program("write_back", "host_io", write, (layout.pool, kv, _vec(n), _vec(n), _scalar()))]
    return [es.program("<lambda>", "host_io", numpy_io._device_gather(first), (kv, _vec(n)), tag="device_gather")]


def refresh_meta_program(es: EngineShapes, layout: SparseLayout, units: int, group: str = "sparse") -> Program:
    """SparseDecoder._refresh_meta's key-bounds call for `units` (layer, block) units."""
    n = bucket(units)
    return es.program("refresh_meta", group, sparse_layer.refresh_meta,
                   (es.kv(layout.num_gpu_blocks), layout.bounds.fine, _vec(n), _vec(n), _vec(n)),
                   {"sub_blocks": es.config.scoring.sub_blocks})


def refresh_coarse_program(es: EngineShapes, layout: SparseLayout, blocks: int, group: str = "sparse") -> Program:
    """Two-level scoring's group bounds of the groups `blocks` new key bounds fall into (one group each, every sparse
    layer): SparseDecoder._refresh_meta's second call."""
    f = es.config.scoring.coarse_group
    n = bucket(blocks * layout.plan.sparse_layers)
    return es.program("refresh_coarse", group, sparse_layer.refresh_coarse,
                   (layout.bounds.fine, layout.bounds.coarse, spec((n, f), I32), _vec(n)),
                   {"sub_blocks": es.config.scoring.sub_blocks})


def allocations(es: EngineShapes, shardings, layout: SparseLayout | None = None,
                num_blocks: int | None = None) -> list[Call]:
    """The engine's zero-filled pools (kv_cache.zeros_on): the KV cache, and for offloaded requests the key bounds
    (device) and the host pool (pinned host memory with host_io "xla"). Once per engine, not per step."""
    from pulseinfer_jax.host_offload.memory import zeros_program

    nb = layout.num_gpu_blocks if layout is not None else num_blocks
    arrays = [(es.kv(nb), "device")]
    if layout is not None:
        arrays += [(layout.meta, "device"), (layout.coarse_meta, "device")]
        if es.host_io == "xla":
            arrays.append((layout.pool, HOST))
    return [Call(es.program("host_zeros" if kind == HOST else "<lambda>", "alloc",
                            zeros_program(a.shape, a.dtype, shardings(kind), kind), (),
                            tag=f"zeros {a.aval}@{kind}"), 0.0) for a, kind in arrays]


def offloaded_prefill(es: EngineShapes, layout: SparseLayout, prompt_tokens: int, *, shardings=None,
                      group: str = "sparse") -> list[Call]:
    """One offloaded prompt's layer-segmented prefill (runner/offloaded_prefill.py), per prompt: every (layer, chunk)
    piece, and after each layer its spill (sparse layers: write-back of every block from its prefill units, key
    bounds of every block, the partial last one's over its tokens; the resident or dense-pack copies), the group
    bounds with two-level scoring, the logits and the first token's sampling. Also the slot-table reset of its first
    decode step."""
    cfg, model, plan = es.config, es.model, layout.plan
    bs, nl = cfg.block_size, model.cfg.num_layers
    n = blocks_for(prompt_tokens, bs)
    middle = max(0, n - plan.sink_blocks - plan.window_blocks)
    keep = n - middle
    if plan.placement == "device":  # dense prefill into the request's own blocks, then every block's key bounds
        own = max((len(s.table) for s in layout.requests), default=n)  # its blocks: prompt + new tokens
        calls = prefill(es, prompt_tokens, own, num_blocks=layout.num_gpu_blocks, group=group)
        calls.append(Call(refresh_meta_program(es, layout, plan.sparse_layers * n, group)))
        return calls + [Call(reset_rows_program(layout, 1, group))]
    kv = es.kv(layout.num_gpu_blocks)
    table = _vec(bucket_blocks(n))
    calls: dict[str, Call] = {}

    def add(p: Program, k: float = 1.0) -> None:
        have = calls.get(p.key)
        calls[p.key] = Call(p, k + (have.count if have else 0.0))

    for ch in chunk_plan(prompt_tokens, cfg.prefill_chunk, bs):
        x = es.x(1, ch.size)
        add(es.program("_prefill_embed", group, dense._compiled(dense._prefill_embed, es.platform),
                       (model, es.head_params, _vec(ch.size))))
        add(es.program("_prefill_layer_units", group, dense._compiled(dense._prefill_layer_units, es.platform),
                       (model, es.layer_params, kv, x, _scalar(), table), {"key_chunk": min(cfg.key_chunk, ch.size)}),
            nl)
    add(es.program("_prefill_logits", group, dense._compiled(dense._prefill_logits, es.platform),
                   (model, es.head_params, es.x(1, ch.size), _scalar())))
    host_s = shardings(HOST) if shardings is not None else None
    dev_s = shardings("device") if shardings is not None else None
    for p in write_back_unit_programs(es, layout, n, host_s, dev_s, group):
        add(p, plan.sparse_layers)
    add(refresh_meta_program(es, layout, n, group), plan.sparse_layers)
    copies = _vec(bucket(keep))
    add(es.program("copy_units", group, sparse_layer.copy_units, (kv, copies, copies)), plan.sparse_layers)
    if plan.dense_layers:
        packs = _vec(bucket(n))
        add(es.program("copy_units", group, sparse_layer.copy_units, (kv, packs, packs)), plan.dense_layers)
    f = cfg.scoring.coarse_group
    if f > 1 and middle:
        groups = len({j // f for j in range(plan.sink_blocks, n - plan.window_blocks)})
        add(refresh_coarse_program(es, layout, groups, group))
    add(reset_rows_program(layout, 1, group))
    return list(calls.values()) + sample_calls(es, 1)


def write_back_unit_programs(es: EngineShapes, layout: SparseLayout, units: int, host_s, dev_s,
                             group: str = "sparse") -> list[Program]:
    """HostKVPool.write_back_units of `units` flat units (padded to a power of two): one layer of a prompt."""
    n = bucket(units)
    kv = es.kv(layout.num_gpu_blocks)
    if es.host_io == "xla":
        write = _io(es, layout.plan.dense_layers, host_s, dev_s)[4]
        return [es.program("write_back_units", "host_io", write,
                           (layout.pool, kv, _vec(n), _scalar(), _vec(n), _scalar()))]
    return [es.program("_unit_gather", "host_io", numpy_io._unit_gather, (kv, _vec(n)))]


def reset_rows_program(layout: SparseLayout, fresh: int, group: str = "sparse") -> Program:
    """SparseDecoder._prepare_slots' reset of the slot-table rows of `fresh` requests decoding for the first time."""
    return layout.es.program("reset_rows", group, slot_plan.reset_rows, (*layout.slot_state, _vec(bucket(fresh))))


__all__ = ["EngineShapes", "SparseLayout", "dense_decode", "out_shapes", "prefill", "sample_calls", "sparse_decode",
           "offloaded_prefill", "write_back_programs", "refresh_meta_program", "swap_programs"]
