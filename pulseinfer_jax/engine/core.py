"""The engine: owns the model, the paged KV pool and the scheduler; one `step()` = schedule, run, postprocess.

Each step runs at most one prefill chunk's worth of work (of the oldest admitted request) and one decode step over
every running request, so long prompts prefill while the batch keeps decoding (chunked prefill). An offloaded
prompt prefills layer by layer instead, its KV streamed to the host pool as each layer completes
(`runner/offloaded_prefill.py`): the GPU never holds more than one layer of it.
Dense requests decode in one jitted call over all layers (`dense.decode_step`); offloaded (sparse)
requests decode layer by layer through `sparse_decoder.SparseDecoder`, in the same step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pulseinfer_jax.backends import ResolvedBackends, resolve_backends
from pulseinfer_jax.config import EngineConfig
from pulseinfer_jax.engine.compile_clock import compile_seconds
from pulseinfer_jax.host_offload.swap import SwapSpace
from pulseinfer_jax.kv.blocks import BlockAllocator, blocks_for, bucket
from pulseinfer_jax.kv.cache import CacheSpec, bucket_blocks
from pulseinfer_jax.kv.quant import layer_block_bytes, storage_dtype
from pulseinfer_jax.models.config import ModelConfig
from pulseinfer_jax.models.loading import LoadedModel
from pulseinfer_jax.parallel.layout import DeviceLayout
from pulseinfer_jax.request import Request, SamplingParams, Status, TokenEvent
from pulseinfer_jax.runner.dense import decode_step, decode_step_layerwise, prefill_step, prefill_step_layerwise
from pulseinfer_jax.runner.offloaded_prefill import SegmentedPrefiller, chunk_size
from pulseinfer_jax.runner.sampling import BatchSampling, sample_tokens
from pulseinfer_jax.runner.sparse_decoder import SavedSlots
from pulseinfer_jax.runner.sparse_inputs import PlacedRows
from pulseinfer_jax.sched.admission import IOAAConfig
from pulseinfer_jax.sched.placer import OffloadPlacer
from pulseinfer_jax.sched.pools import pool_sizes
from pulseinfer_jax.sched.scheduler import FixedStepTime, Scheduler
from pulseinfer_jax.selection.hooks import Selector
from pulseinfer_jax.selection.policy import BlockScoring

CPU_NOMINAL_H2D = 16e9  # IOAA's bandwidth off-GPU, where "host to device" is a memcpy (meaningless for timing)

CPU_DEFAULT_KV_BYTES = 4 << 30
SERVING_HOST_FACTOR = 4  # a server's default host pool: this many times the GPU pool's tokens (Engine.open)
log = logging.getLogger("pulseinfer_jax")


class Sampled(NamedTuple):
    """What the run phase hands to postprocess: requests and the token sampled for each, in order."""

    reqs: list[Request]
    tokens: list[int]


class Engine:
    keep_logits = False  # parity checks: each sampled row's logits to `observe_logits` (one more read per step)

    def __init__(self, model: LoadedModel, config: EngineConfig = EngineConfig(), device: jax.Device | None = None,
                 selector: Selector | None = None):
        self.model = model
        self.config = config
        if config.tensor_parallel != model.tensor_parallel:
            raise ValueError(f"tensor_parallel={config.tensor_parallel} but the model was loaded for "
                             f"{model.tensor_parallel} device(s); load it with the same tensor_parallel "
                             "(load_model(..., devices=DeviceLayout.of(n)), or generate_long / the CLI do it)")
        # the devices and the shardings of every array (parallel/layout.py); one device unless tensor parallel
        self.layout = model.placement.devices if model.placement is not None else DeviceLayout.of(1, device)
        self.device = self.layout.device
        self.kv: jax.Array | None = None
        self.spec: CacheSpec | None = None
        self.allocator: BlockAllocator | None = None
        self.scheduler: Scheduler | None = None
        self.seed = 0
        self.steps = 0  # engine steps taken in the current run
        # every "auto" backend resolved here, once (checked on the device first on a GPU), logged and reported
        self.backends: ResolvedBackends = resolve_backends(config, self.device, model)
        ab = config.ablation
        if self.layout.tp > 1 and self.backends.host_io == "xla" and (ab.selection == "headwise"
                                                                      or ab.io == "fragmented"):
            raise ValueError(f"selection={ab.selection!r} with io={ab.io!r} moves per-(block, head) units, which the "
                             "'xla' host I/O runs on one device only; under tensor_parallel use selection='solohead' "
                             "with io='coalesced', or host_io='numpy'")
        compile_seconds()  # start counting compile time (step stats leave compiling steps out of TPOT)
        # the jitted model: the loaded one with this engine's MoE options (how expert layers compute on its device)
        moe = self.backends.moe
        self.transformer = model.transformer if moe is None else dataclasses.replace(model.transformer, moe=moe)
        if self.backends.layer_loop == "layerwise":
            model.unstack()  # every step reads per-layer weights: keep only those (no stacked second copy)
        self._layer_ids: list[jax.Array] | None = None
        self._bars: dict = {}
        self.host_pool = None  # host_offload.HostKVPool (modes offload / auto)
        self.swap: SwapSpace | None = None  # preempted requests' KV in host memory (ensure_pool sizes it)
        self._slots_out: dict[int, SavedSlots] = {}  # preempted offloaded requests' slot-cache state
        self.sparse = None  # sparse_decoder.SparseDecoder
        self.prefiller = None  # offloaded_prefill.SegmentedPrefiller (offloaded prompts)
        self._segments: dict[int, object] = {}  # request index -> its offloaded_prefill.SegmentedPrefill
        self.selector = selector  # where sparse layers' middle blocks come from (None: the scorer; selection/hooks.py)
        self.h2d_bytes_per_s: float | None = config.offload.h2d_bytes_per_s
        self.eos_ids = frozenset(model.tokenizer.eos_token_ids if model.tokenizer else model.cfg.eos_token_ids)

    @property
    def decode_attention(self) -> str:
        return self.backends.decode_attention

    @property
    def layer_loop(self) -> str:
        return self.backends.layer_loop

    @property
    def moe_strategy(self) -> str | None:
        """What the MoE layers run (after any fallback); None for a model without experts."""
        return self.backends.moe_strategy

    @property
    def sparse_attention(self) -> str | None:
        return self.backends.sparse_attention

    @property
    def scoring(self) -> BlockScoring | None:
        """The sparse pipeline's block scoring (the key-bounds dtype after any fallback); None in mode "dense"."""
        return self.backends.scoring

    @property
    def host_io(self) -> str | None:
        return self.backends.host_io

    @property
    def on_gpu(self) -> bool:
        return self.backends.platform == "gpu"

    # ---- KV pool -------------------------------------------------------------------------------
    @property
    def layer_params(self) -> list[dict]:
        """The model's per-layer weights (LoadedModel.layer_params), read by the layer-wise steps and the sparse
        pipeline. With layer_loop "layerwise" (GPU default) they are the model's only copy (`unstack`); with
        "scan" (CPU default) the sparse pipeline splits a second copy on first use, once per model."""
        return self.model.layer_params

    @property
    def layer_ids(self) -> list[jax.Array]:
        """Each layer's index as an int32 scalar on the engine's device (an argument of the layer-wise steps)."""
        if self._layer_ids is None:
            on = self.layout.replicated()
            self._layer_ids = [jax.device_put(np.int32(i), on) for i in range(self.model.cfg.num_layers)]
        return self._layer_ids

    def _spec(self, num_blocks: int) -> CacheSpec:
        c = self.model.cfg
        return CacheSpec(c.num_layers, num_blocks, c.num_kv_heads, self.config.block_size, c.head_dim,
                         self.kv_dtype)

    @property
    def kv_dtype(self) -> jnp.dtype:
        """The cache arrays' dtype (`EngineConfig.kv_dtype`, resolved with the backends; float8: its bytes)."""
        return storage_dtype(self.backends.kv_dtype)

    def _kv_byte_cap(self) -> int:
        """Bytes of KV (pool + offload metadata) the devices may hold together: tensor parallelism splits every block
        evenly, so the fullest device decides (tp x its free memory)."""
        if self.config.gpu_kv_budget is not None:
            return self.config.gpu_kv_budget
        if self.device.platform == "cpu":
            return CPU_DEFAULT_KV_BYTES
        free = []
        for d in self.layout.devices:
            stats = d.memory_stats() or {}
            free.append(stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0))
        return int(0.85 * min(free)) * self.layout.tp if min(free) > 0 else CPU_DEFAULT_KV_BYTES

    def open(self, seed: int = 0) -> None:
        """Pools for requests that arrive over time (a server: `submit` them, then `step` while `busy`): the GPU KV
        pool takes the whole budget (gpu_kv_budget or kv_cache_tokens); in the offload modes the host pool is
        host_kv_tokens, by default SERVING_HOST_FACTOR x the GPU pool's tokens within half the host's free memory
        (resolved here, logged, and kept in `config`)."""
        cfg = self.config
        if cfg.mode != "dense" and cfg.offload.host_kv_tokens is None:
            c, bs = self.model.cfg, cfg.block_size
            per_token = c.num_layers * layer_block_bytes(bs, c.num_kv_heads, c.head_dim, self.kv_dtype) // bs
            host_per_token = per_token * (c.num_layers - cfg.offload.dense_layers) // c.num_layers
            gpu_tokens = (cfg.kv_cache_tokens or self._kv_byte_cap() // per_token)
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            tokens = max(cfg.block_size, min(SERVING_HOST_FACTOR * gpu_tokens, free // 2 // host_per_token))
            self.config = cfg.with_settings(host_kv_tokens=tokens)
            log.info("host KV pool for serving: %d tokens (%.1f GiB; %dx the GPU pool's %d tokens, at most half of "
                     "the %.1f GiB of free host memory); set host_kv_tokens to choose", tokens,
                     tokens * host_per_token / 2**30, SERVING_HOST_FACTOR, gpu_tokens, free / 2**30)
        self.seed, self.steps = seed, 0
        self.ensure_pool(None)

    def submit(self, req: Request) -> None:
        """Queue a request made by `make_request` (after `open`); ValueError if it could never fit the pools."""
        self.scheduler.add(req)

    @property
    def busy(self) -> bool:
        """Whether a request is waiting, prefilling or decoding."""
        return self.scheduler is not None and self.scheduler.has_work()

    def check_drained(self) -> None:
        """Every GPU block and host row is free and the allocators are consistent (nothing leaked); raises if not."""
        self.allocator.check_integrity()
        if self.allocator.num_free != self.allocator.capacity:
            raise RuntimeError(f"KV blocks leaked: {self.allocator.capacity - self.allocator.num_free} still in use")
        if self.swap is not None and self.swap.used_blocks:
            raise RuntimeError(f"swapped-out KV leaked: {self.swap.used_blocks} blocks still held in host memory")
        if self.host_pool is not None:
            self.host_pool.check_integrity()
            if self.host_pool.allocator.num_free != self.host_pool.allocator.capacity:
                raise RuntimeError("host KV rows leaked after all requests finished")

    def ensure_pool(self, requests: Sequence[Request] | None) -> None:
        """Size the KV pool for `requests` (None: for a server, see `open`; or to kv_cache_tokens) and (re)allocate
        it if it changed; in the offload modes also the host pool, the key metadata and the sparse decoder."""
        cfg = self.config
        bs = cfg.block_size
        meta_item = self.scoring.metadata_dtype(self.model.dtype).itemsize if cfg.mode != "dense" else 1
        sizes = pool_sizes(cfg, self.model.cfg, self.kv_dtype, meta_item, requests, self._kv_byte_cap())
        plan, rows, num_blocks = sizes.plan, sizes.host_rows, sizes.num_blocks
        if plan is not None and plan.slot_blocks < cfg.slot_blocks and (self.sparse is None
                                                                          or self.sparse.plan != plan):
            log.info("slot cache: %d blocks per request and sparse layer, not %d: cut to the requests' context, or "
                     "to what the GPU KV budget holds beside the longest one's resident blocks (sched/pools.py)",
                     plan.slot_blocks, cfg.slot_blocks)
        if self.spec is None or self.spec.num_blocks != num_blocks:
            self.kv = None  # free the old pool before allocating the new one
            self.spec = self._spec(num_blocks)
            self.kv = self.spec.allocate(self.layout.kv_heads(len(self.spec.shape)))
        self.allocator = BlockAllocator(num_blocks)
        self._segments = {}
        self.swap = SwapSpace(self._swap_blocks(num_blocks))
        self._slots_out = {}
        if plan is None:
            self.scheduler = Scheduler(self.allocator, bs, cfg.max_batch, mover=self)
            return
        self._ensure_offload(plan, rows, num_blocks)
        placer = OffloadPlacer(plan, self.allocator, self.host_pool, bs)
        ioaa = IOAAConfig(h2d_bytes_per_s=self._h2d_bandwidth(), slack=cfg.offload.ioaa_slack)
        self.scheduler = Scheduler(self.allocator, bs, cfg.max_batch, mode=cfg.mode, placer=placer, ioaa=ioaa,
                                   cost=FixedStepTime(cfg.offload.ioaa_step_time_s), mover=self)

    def _swap_blocks(self, num_blocks: int) -> int:
        """Blocks of host memory for preempted requests' KV: swap_kv_tokens, by default as many as the GPU pool holds
        within a quarter of the host's free memory (resolved here, logged once per size)."""
        tokens = self.config.swap_kv_tokens
        per_block = self.spec.bytes_per_block
        if tokens is not None:
            return blocks_for(tokens, self.config.block_size) if tokens else 0
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        blocks = max(0, min(num_blocks - 1, free // 4 // per_block))
        if self.swap is None or self.swap.capacity_blocks != blocks:
            log.info("swap space for preempted requests: %d blocks (%.2f GiB of host memory); set swap_kv_tokens to "
                     "choose", blocks, blocks * per_block / 2**30)
        return blocks

    # ---- preemption: the scheduler's KVMover -------------------------------------------------------
    def swap_out(self, req: Request) -> bool:
        """Copy a preempted request's GPU blocks (every layer: an offloaded request's resident, slot and dense-layer
        blocks alike) to host memory; False when the swap space has no room for them. An offloaded request's
        recalls issued ahead land first and its slot-cache state is kept beside its KV (its host rows and key bounds
        stay in place), so that it resumes exactly where it stopped."""
        if self.swap is None or not self.swap.can_hold(len(req.blocks)):
            return False
        if req.sparse is not None:
            self.kv, self._slots_out[req.index] = self.sparse.preempt(self.kv, req.sparse)
        self.swap.swap_out(self.kv, req.blocks, req.index)
        return True

    def swap_in(self, req: Request, blocks: list[int]) -> None:
        """A preempted request's KV into `blocks` (an offloaded one's sparse state names them already, with its
        slot-cache table row: its slot caches go there)."""
        self.kv = self.swap.swap_in(self.kv, blocks, req.index)
        if req.sparse is not None:
            self.sparse.resume(req.sparse, self._slots_out.pop(req.index))

    def drop(self, req: Request) -> None:
        self.swap.drop(req.index)
        self._slots_out.pop(req.index, None)

    def _ensure_offload(self, plan, rows: int, num_blocks: int) -> None:
        from pulseinfer_jax.host_offload.host_pool import HostKVPool
        from pulseinfer_jax.runner.sparse_decoder import SparseDecoder

        cfg, c = self.config, self.model.cfg
        io = self.host_io
        pool = self.host_pool
        align = cfg.scoring.coarse_group
        if pool is None or (pool.num_rows, pool.first_layer, pool.io_name, pool.row_align) != (
                rows, plan.dense_layers, io, align):
            self.sparse = None
            self.host_pool = None
            self.host_pool = HostKVPool(num_rows=rows, first_layer=plan.dense_layers, num_layers=c.num_layers,
                                        block_size=cfg.block_size, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                        dtype=self.kv_dtype, device=self.layout, io=io, row_align=align)
        else:
            self.host_pool.reset_allocator()
        if self.sparse is None or self.sparse.plan != plan or self.sparse.nb != num_blocks:
            self.sparse = SparseDecoder(self.transformer, self.model.params, plan, cfg.offload, self.backends,
                                        self.host_pool, num_blocks, self.layout,
                                        split_weights=lambda: self.layer_params, max_requests=cfg.max_batch,
                                        selector=self.selector)
            self.prefiller = SegmentedPrefiller(self.transformer, self.model.params, lambda: self.layer_params,
                                                self.sparse, key_chunk=cfg.key_chunk,
                                                prefill_chunk=cfg.prefill_chunk)

    def _h2d_bandwidth(self) -> float:
        if self.h2d_bytes_per_s is None:
            self.h2d_bytes_per_s = self.host_pool.measure_h2d() if self.on_gpu else CPU_NOMINAL_H2D
        return self.h2d_bytes_per_s

    # ---- request intake ------------------------------------------------------------------------
    def make_request(self, index: int, prompt: list[int], sampling: SamplingParams) -> Request:
        c = self.model.cfg
        if not prompt:
            raise ValueError(f"prompt {index} is empty; give at least one token")
        check_token_ids(index, prompt, c)
        max_new = min(sampling.max_new_tokens, c.max_position_embeddings - len(prompt))
        return Request(index, list(prompt), sampling, max_new, t_submit=time.perf_counter())

    # ---- the loop ------------------------------------------------------------------------------
    def run(self, requests: Sequence[Request], seed: int = 0) -> Iterator[TokenEvent]:
        """Run requests to completion with continuous batching, yielding each token as it is made."""
        self.seed = seed
        self.steps = 0
        self.ensure_pool(requests)
        for r in requests:
            self.scheduler.add(r)
        while self.scheduler.has_work():
            yield from self.step()
        self.check_drained()

    def step(self) -> Iterator[TokenEvent]:
        """One engine step; its tokens are yielded once the step's work is issued (the step traces under the devices'
        mesh, a context that must not stay entered while the caller runs)."""
        with self.layout.context():
            events = list(self._step())
        yield from events

    def _step(self) -> Iterator[TokenEvent]:
        """schedule -> run -> postprocess: the step's prefill chunk, then one decode step of every running request
        (one whose prompt completed in this step's chunk included)."""
        prefill = self._schedule()
        if prefill is not None:
            yield from self._postprocess(self._run_prefill(prefill))
        if self.scheduler.running:
            yield from self._postprocess(self._run_decode(list(self.scheduler.running)))

    # ---- schedule ------------------------------------------------------------------------------
    def _schedule(self) -> Request | None:
        """Admit what fits (admission places each request dense or offloaded); the request whose prompt gets this
        step's prefill chunk, if any."""
        sched = self.scheduler
        now = time.perf_counter()
        sched.reserve_decode()  # the running requests' next blocks first (preempting the youngest if out)
        for r in sched.admit():
            if not r.preemptions:  # (a resumed request keeps its first admission)
                r.t_admit = now
                r.admit_step = self.steps
        self.steps += 1
        pf = sched.next_prefill()
        if pf is None and not sched.running and sched.waiting:
            raise RuntimeError("scheduler stalled: waiting requests cannot be admitted into an idle engine")
        return pf

    # ---- run: the model over the cache, then sampling --------------------------------------------
    def _run_prefill(self, req: Request) -> list[Sampled]:
        """One chunk of req's prompt (dense), or one step's share of its layer-by-layer prefill (offloaded); the
        first token once the prompt is done."""
        t0, c0 = time.perf_counter(), compile_seconds()
        s = req.sparse
        if s is not None and s.plan.placement == "host":  # layer by layer, streamed to the host pool
            n, logits = self._prefill_segments(req)
        else:  # dense, or sparse with its KV on the GPU: one chunk of every layer into the request's own blocks
            n, logits = self._prefill_compute(req, s.prefill_table() if s is not None else req.blocks)
            req.prefilled += n
        bar = self._progress_bar(req)
        if logits is None:
            jax.block_until_ready(self.kv)  # honest per-chunk timing / progress
            req.prefill_s += time.perf_counter() - t0
            req.compile_s += compile_seconds() - c0
            if bar is not None:
                bar.update(n)
            return []
        if bar is not None:
            bar.update(n)
            bar.close()
            del self._bars[req.index]
        if req.recompute:  # a preempted request's context is back in the cache: it decodes on from its last token
            req.recompute = False
            self.scheduler.prefill_done(req)
            req.prefill_s += time.perf_counter() - t0
            req.compile_s += compile_seconds() - c0
            return []
        token = self._sample(logits[None], [req])[0]
        if s is not None and s.plan.placement == "device":  # block roles and key bounds of the prompt
            self.sparse.index_prompt(self.kv, s, len(req.prompt))
        req.prefill_s += time.perf_counter() - t0
        req.compile_s += compile_seconds() - c0
        return [Sampled([req], [token])]

    def _prefill_segments(self, req: Request) -> tuple[int, jax.Array | None]:
        """One step's share of an offloaded prompt's layer-by-layer prefill (as much work as one dense chunk);
        returns (prompt tokens' worth of work done: req.prefilled counts the prompt x layers done, divided by the
        layers, the logits of the last prompt token once it is done)."""
        job = self._segments.get(req.index)
        if job is None:
            job = self.prefiller.start(req.sparse, req.prompt, self.scheduler.placer.prefill_blocks(req))
            self._segments[req.index] = job
        self.kv, logits = self.prefiller.advance(self.kv, job, self.model.cfg.num_layers)
        before = req.prefilled
        req.prefilled = round(len(req.prompt) * (1 - job.pieces_left / (job.num_layers * len(job.chunks))))
        if logits is not None:
            del self._segments[req.index]
        return req.prefilled - before, logits

    def _prefill_compute(self, req: Request, blocks: list[int]) -> tuple[int, jax.Array | None]:
        """Run the model over the next chunk of req's prompt, writing its KV into `blocks` (the request's
        prefill blocks); returns (tokens consumed, logits [V] of the prompt's last position once it is done)."""
        cfg = self.config
        start = req.prefilled
        context = req.context
        remaining = len(context) - start
        size = chunk_size(remaining, cfg.prefill_chunk, cfg.block_size)
        n = min(size, remaining)
        chunk = np.zeros(size, np.int32)
        chunk[:n] = context[start:start + n]
        table = self._table(blocks, bucket_blocks(len(blocks)))
        args = (self.kv, jnp.asarray(chunk), jnp.int32(start), jnp.int32(n), jnp.asarray(table))
        key_chunk = min(cfg.key_chunk, size)
        if self.layer_loop == "layerwise":
            self.kv, logits = prefill_step_layerwise(self.transformer, self.model.params, self.layer_params,
                                                     self.layer_ids, *args, key_chunk=key_chunk)
        else:
            self.kv, logits = prefill_step(self.transformer, self.model.stacked_params, *args,
                                           key_chunk=key_chunk)
        return n, (logits if start + n == len(context) else None)

    def _progress_bar(self, req: Request):
        if req.index in self._bars:
            return self._bars[req.index]
        if len(req.prompt) < self.config.progress_min_tokens or not progress_enabled(self.config):
            return None
        from tqdm.auto import tqdm

        bar = tqdm(total=len(req.prompt), desc=f"prefill #{req.index}", unit="tok", leave=False, file=sys.stderr)
        self._bars[req.index] = bar
        return bar

    def _run_decode(self, reqs: list[Request]) -> list[Sampled]:
        """One decode step of `reqs`. Offloaded requests decode layer by layer through the sparse decoder; dense ones
        join that layer pass where it allows (recall ahead: one pass over the weights), else run their own call
        over all layers in the same step."""
        t0, c0 = time.perf_counter(), compile_seconds()
        dense = [r for r in reqs if r.sparse is None]
        sparse = [r for r in reqs if r.sparse is not None]
        out: list[Sampled] = []
        joined = bool(dense and sparse) and self.sparse.joins_dense([r.sparse for r in sparse])
        if dense and not joined:
            out.append(Sampled(dense, self._decode_dense(dense)))
        if sparse:
            placed = None
            if joined:
                placed = PlacedRows.of([r.blocks for r in dense], [r.seq_len - 1 for r in dense],
                                       self.config.block_size)
            rows = sparse + dense if joined else sparse
            self.kv, tokens, logits = self.sparse.decode(
                self.kv, [r.sparse for r in sparse], [r.output[-1] for r in sparse], [r.seq_len for r in sparse],
                placed, [r.output[-1] for r in dense] if joined else [], self._sampling(rows), self.keep_logits)
            if logits is not None:
                self.observe_logits(logits, rows)
            out.append(Sampled(rows, [int(t) for t in tokens]))
            est = self.scheduler.estimator
            est.observe_step_time(time.perf_counter() - t0)
            for r in sparse:
                est.observe(r.index, float(r.sparse.counters.last_step_recall_bytes))
        step_s, compiled = time.perf_counter() - t0, compile_seconds() - c0
        for r in reqs:  # a step that compiled is warm-up: TPOT is reported over the steady steps only
            r.compile_s += compiled
            if compiled > 0:
                r.warmup_s += step_s
            else:
                r.steady_s += step_s
                r.steady_tokens += 1
        return out

    def _decode_dense(self, reqs: list[Request]) -> list[int]:
        b = bucket(len(reqs))
        mb = bucket_blocks(max(len(r.blocks) for r in reqs))
        tokens = np.zeros(b, np.int32)
        positions = np.zeros(b, np.int32)
        tables = np.zeros((b, mb), np.int32)
        for i, r in enumerate(reqs):
            tokens[i] = r.output[-1]
            positions[i] = r.seq_len - 1
            tables[i] = self._table(r.blocks, mb)
        args = (jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(tables))
        self.kv, logits = self._decode_step(*args)
        return self._sample(logits, reqs)

    def _decode_step(self, *args: jax.Array) -> tuple[jax.Array, jax.Array]:
        model = self.model
        if self.layer_loop == "scan":
            return decode_step(self.transformer, model.stacked_params, self.kv, *args, attention=self.decode_attention)
        return decode_step_layerwise(self.transformer, model.params, self.layer_params, self.layer_ids, self.kv,
                                     *args, attention=self.decode_attention)

    def _sampling(self, reqs: list[Request]) -> BatchSampling:
        """Each request's sampling in `reqs`' order (its stream: the request's index, or the client's seed)."""
        return BatchSampling(tuple(r.sampling for r in reqs),
                             tuple(r.index if r.stream is None else r.stream for r in reqs),
                             tuple(len(r.output) for r in reqs), self.seed)

    def observe_logits(self, logits: np.ndarray, reqs: list[Request]) -> None:
        """Where `keep_logits`: the logits each request of `reqs` samples its next token from ([len(reqs), V], in
        order). Parity checks override it; the engine's own steps never read logits back."""

    def _sample(self, logits: jax.Array, reqs: list[Request]) -> list[int]:
        if self.keep_logits:
            self.observe_logits(np.asarray(logits)[: len(reqs)], reqs)
        rows = self._sampling(reqs).rows(range(len(reqs)), logits.shape[0])
        return [int(t) for t in np.asarray(sample_tokens(logits, rows))[: len(reqs)]]

    # ---- postprocess ---------------------------------------------------------------------------
    def _postprocess(self, outputs: list[Sampled]) -> Iterator[TokenEvent]:
        """Append each sampled token; a request whose prompt just completed starts decoding, one that hit EOS or
        its token limit finishes (its KV freed at once)."""
        now = time.perf_counter()
        for reqs, tokens in outputs:
            for r, t in zip(reqs, tokens, strict=True):
                if r.status is Status.PREFILLING:
                    r.t_first = now
                    self.scheduler.prefill_done(r)
                r.output.append(t)
                reason = None
                if t in self.eos_ids and not r.sampling.ignore_eos:
                    reason = "stop"
                elif len(r.output) >= r.max_new_tokens:
                    reason = "length"
                if reason is not None:
                    r.t_done = now
                    self._finish(r, reason)
                yield TokenEvent(r.index, t, reason)

    def stop_request(self, req: Request, reason: str) -> None:
        """Finish a request early (e.g. a stop string matched); frees its blocks."""
        if req.status is not Status.FINISHED:
            req.t_done = time.perf_counter()
            self._segments.pop(req.index, None)  # an offloaded prefill in progress ends with it
            self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> None:
        """Free a request's KV. Recalls issued ahead land first: their slots may belong to it, and its freed blocks
        may be handed out before the next sparse step."""
        if req.sparse is not None and self.sparse is not None and self.sparse.recall_in_flight:
            self.kv = self.sparse.land_pending(self.kv)
        self.scheduler.finish(req, reason)

    @staticmethod
    def _table(blocks: list[int], width: int) -> np.ndarray:
        t = np.zeros(width, np.int32)
        t[: len(blocks)] = blocks
        return t


def check_token_ids(i: int, ids: Sequence[int], cfg: ModelConfig) -> None:
    """Prompt `i`'s token ids against the model (`cfg`): inside its vocabulary, and short enough for its positions.
    Checked as soon as the model is known, before an engine is built or anything compiles."""
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"prompt {i} has token ids outside [0, {cfg.vocab_size}) (the model's vocabulary): "
                         f"{bad[:5]}")
    if len(ids) >= cfg.max_position_embeddings:
        raise ValueError(f"prompt {i} has {len(ids)} tokens but the model handles at most "
                         f"{cfg.max_position_embeddings} positions; shorten the prompt")


def progress_enabled(config: EngineConfig) -> bool:
    return sys.stderr.isatty() if config.progress is None else config.progress
