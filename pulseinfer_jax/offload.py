"""The engine's offload side: the sparse plan from the config, host pool sizing, and the scheduler's `Placer`.

GPU memory (one pool, one allocator, `gpu_kv_budget` bytes in all) holds the dense requests' KV and the
resident part of offloaded ones (see host_offload/placement.py); the per-block key metadata of every sparse
layer (min and max, [sparse layers * host rows, Hkv, hd] each, in float8 rounded outward or the KV dtype; with
two-level scoring one more per group of blocks) is also on the GPU and is charged to the same budget. The pinned
host pool holds one row per logical block of every sparse request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pulseinfer_jax.config import EngineConfig
from pulseinfer_jax.host_offload.blocks import BlockAllocator, blocks_for
from pulseinfer_jax.host_offload.host_pool import HostKVPool
from pulseinfer_jax.host_offload.placement import SparseKV, SparsePlan
from pulseinfer_jax.ioaa import Candidate
from pulseinfer_jax.scheduler import Request


def sparse_plan(config: EngineConfig, num_layers: int, num_kv_heads: int) -> SparsePlan:
    o = config.offload
    if o.dense_layers >= num_layers:
        raise ValueError(f"dense_layers={o.dense_layers} leaves no sparse layer in a {num_layers}-layer model; "
                         f"use mode='dense' or dense_layers < {num_layers}")
    return SparsePlan(num_layers=num_layers, dense_layers=o.dense_layers, block_size=config.block_size,
                      num_kv_heads=num_kv_heads, sink_blocks=o.sink_blocks, window_blocks=config.window_blocks,
                      budget_blocks=config.budget_blocks, slot_blocks=config.slot_blocks,
                      selection=o.ablation.selection, placement=o.ablation.placement)


def host_rows_for(config: EngineConfig, requests: Sequence[Request]) -> int:
    """Host pool rows (incl. the null row): host_kv_tokens, or what every request would need offloaded. With
    two-level scoring rows go out in aligned extents of `score_coarse_group` rows (the first holds the null row), so
    the count is a multiple of it and each request's rows are rounded up to whole extents."""
    bs, a = config.block_size, config.scoring.coarse_group  # (a = 1: one row per block plus the null row)
    host = config.offload.host_kv_tokens
    tokens = [host] if host is not None else [r.need_tokens for r in requests]
    return a * (1 + sum(-(-blocks_for(t, bs) // a) for t in tokens))


def metadata_bytes(plan: SparsePlan, host_rows: int, head_dim: int, itemsize: int, sub_blocks: int = 1,
                   coarse_group: int = 1) -> int:
    """Key bounds (min and max) of every sparse layer and host row (`sub_blocks` slices of it), stored in the
    metadata dtype (`itemsize` bytes: `BlockScoring.metadata_dtype`), plus with two-level scoring one bound per
    group of `coarse_group` rows."""
    rows = host_rows * sub_blocks + (host_rows // coarse_group if coarse_group > 1 else 0)
    return 2 * plan.sparse_layers * rows * plan.num_kv_heads * head_dim * itemsize


def gpu_blocks_wanted(config: EngineConfig, plan: SparsePlan, requests: Sequence[Request]) -> int:
    """Blocks that run every request at once in the configured mode (the pool is this, capped by the budget)."""
    total = 0
    for r in requests:
        dense = blocks_for(r.need_tokens, config.block_size)
        total += plan.gpu_blocks(r.need_tokens) if config.mode == "offload" else dense
    return total


def scratch_blocks_for(config: EngineConfig, plan: SparsePlan, requests: Sequence[Request]) -> int:
    """Prefill scratch of offloaded prompts: the longest prompt (0 when sparse requests keep their KV)."""
    if plan.placement != "host" or not requests:
        return 0
    return max(blocks_for(len(r.prompt), config.block_size) for r in requests)


@dataclasses.dataclass(frozen=True)
class PoolSizes:
    """How an engine sizes its pools for a set of requests (`pool_sizes`)."""

    num_blocks: int  # GPU blocks the allocator hands out, the null block included
    scratch: int  # prefill scratch blocks after them (offloaded prompts prefill there)
    host_rows: int  # host pool rows (0 in dense mode)
    plan: SparsePlan | None  # the sparse plan (None in dense mode)


def pool_sizes(config: EngineConfig, model_cfg, kv_itemsize: int, meta_itemsize: int, requests: Sequence[Request],
               cap_bytes: int) -> PoolSizes:
    """The GPU KV pool (blocks + prefill scratch) and host pool (rows) an engine allocates for `requests` under a cap
    of `cap_bytes` GPU bytes (pool + offload metadata + scratch): kv_cache_tokens if set, else what the requests
    need in the configured mode, capped. `meta_itemsize`: bytes per key-bound element (the scoring's metadata
    dtype). A pure function of its inputs (the engine's Engine.ensure_pool, the ahead-of-time check's layouts)."""
    c, bs = model_cfg, config.block_size
    per_block = c.num_layers * 2 * c.num_kv_heads * bs * c.head_dim * kv_itemsize
    plan, rows = None, 0
    if config.mode != "dense":
        plan = sparse_plan(config, c.num_layers, c.num_kv_heads)
        rows = host_rows_for(config, requests)
        cap_bytes -= metadata_bytes(plan, rows, c.head_dim, meta_itemsize, config.scoring.sub_blocks,
                                    config.scoring.coarse_group)
        if cap_bytes < 2 * per_block:
            raise ValueError(f"gpu_kv_budget={config.gpu_kv_budget} does not even hold the key metadata of a "
                             f"{rows}-block host pool; raise gpu_kv_budget or lower host_kv_tokens")
    scratch = 0 if plan is None else scratch_blocks_for(config, plan, requests)
    cap_bytes -= scratch * per_block
    if config.kv_cache_tokens is not None:
        num_blocks = blocks_for(config.kv_cache_tokens, bs) + 1
    else:
        if plan is None:
            want = sum(blocks_for(r.need_tokens, bs) for r in requests) + 1
        else:
            want = gpu_blocks_wanted(config, plan, requests) + 1
        if plan is not None and cap_bytes < 2 * per_block:
            raise ValueError(f"gpu_kv_budget={config.gpu_kv_budget} cannot hold the offload metadata and the prefill "
                             f"scratch ({scratch} blocks for the longest prompt); raise gpu_kv_budget")
        num_blocks = max(2, min(want, cap_bytes // per_block))
    return PoolSizes(num_blocks, scratch, rows, plan)


class OffloadPlacer:
    """`scheduler.Placer` over one GPU allocator and one host pool."""

    def __init__(self, plan: SparsePlan, allocator: BlockAllocator, pool: HostKVPool, block_size: int):
        self.plan = plan
        self.allocator = allocator
        self.pool = pool
        self.block_size = block_size
        self._slot_rows_free: list[int] = []  # rows of the device slot-cache table (slot_plan.py), one per request
        self._slot_rows_next = 0
        # bytes of one step's full selection: middle blocks x one layer-block x sparse layers
        self.selection_bytes = plan.middle_blocks * pool.layer_block_bytes * plan.sparse_layers

    def _sizes(self, req: Request) -> tuple[int, int, int]:
        dense = blocks_for(req.need_tokens, self.block_size)
        a = self.pool.row_align  # rows = one per logical block, in whole extents
        return dense, self.plan.gpu_blocks(req.need_tokens), -(-dense // a) * a

    def candidate(self, req: Request) -> Candidate:
        dense, peak, rows = self._sizes(req)
        if not self.pool.allocator.can_allocate(rows):
            peak = self.allocator.capacity + 1  # the host pool is full right now: offloading must wait
        return Candidate(req.index, dense, peak, float(self.selection_bytes))

    def fits_ever(self, req: Request, mode: str) -> str | None:
        dense, peak, rows = self._sizes(req)
        gpu_cap, host_cap = self.allocator.capacity, self.pool.allocator.capacity
        dense_ok = dense <= gpu_cap
        offload_ok = peak <= gpu_cap and rows <= host_cap
        if mode == "dense" and not dense_ok:
            return (f"needs {req.need_tokens} tokens of KV ({dense} blocks) but the GPU KV pool holds {gpu_cap} "
                    f"blocks; raise gpu_kv_budget/kv_cache_tokens, lower max_new_tokens or use mode='offload'")
        if mode == "offload" and not offload_ok:
            return (f"offloaded it needs {peak} GPU blocks (of {gpu_cap}) and {rows} host rows (of {host_cap}); "
                    "raise gpu_kv_budget/kv_cache_tokens or host_kv_tokens, or lower max_new_tokens")
        if mode == "auto" and not (dense_ok or offload_ok):
            return (f"fits neither dense ({dense} of {gpu_cap} GPU blocks) nor offloaded ({peak} GPU blocks, {rows} "
                    f"of {host_cap} host rows); raise gpu_kv_budget or host_kv_tokens, or lower max_new_tokens")
        return None

    def setup(self, req: Request) -> None:
        rows = self.pool.allocate(blocks_for(req.need_tokens, self.block_size), owner=req.index)
        if self._slot_rows_free:
            slot_row = self._slot_rows_free.pop()
        else:
            slot_row, self._slot_rows_next = self._slot_rows_next, self._slot_rows_next + 1
        req.sparse = SparseKV(self.plan, req.index, req.need_tokens, req.blocks, rows, slot_row)

    def release(self, req: Request) -> None:
        self._slot_rows_free.append(req.sparse.slot_row)
        self.pool.free(req.sparse.host_rows, owner=req.index)
