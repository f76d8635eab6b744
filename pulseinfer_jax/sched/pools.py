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
from pulseinfer_jax.host_offload.placement import SparsePlan
from pulseinfer_jax.kv.blocks import blocks_for
from pulseinfer_jax.kv.quant import layer_block_bytes
from pulseinfer_jax.request import Request, SamplingParams

UNLIMITED = 1 << 62  # blocks wanted when the requests are not known yet (a server): only the budget caps the pool


def sparse_plan(config: EngineConfig, num_layers: int, num_kv_heads: int) -> SparsePlan:
    o = config.offload
    if o.dense_layers >= num_layers:
        raise ValueError(f"dense_layers={o.dense_layers} leaves no sparse layer in a {num_layers}-layer model; "
                         f"use mode='dense' or dense_layers < {num_layers}")
    return SparsePlan(num_layers=num_layers, dense_layers=o.dense_layers, block_size=config.block_size,
                      num_kv_heads=num_kv_heads, sink_blocks=o.sink_blocks, window_blocks=config.window_blocks,
                      budget_blocks=config.budget_blocks, slot_blocks=config.slot_blocks,
                      selection=o.ablation.selection, placement=o.ablation.placement)


def host_rows_for(config: EngineConfig, requests: Sequence[Request] | None) -> int:
    """Host pool rows (incl. the null row): host_kv_tokens, or what every request would need offloaded (requests None,
    a server's: host_kv_tokens must be set). With two-level scoring rows go out in aligned extents of
    `score_coarse_group` rows (the first holds the null row), so the count is a multiple of it and each request's
    rows are rounded up to whole extents."""
    bs, a = config.block_size, config.scoring.coarse_group  # (a = 1: one row per block plus the null row)
    host = config.offload.host_kv_tokens
    if host is None and requests is None:
        raise ValueError("a server's host pool needs host_kv_tokens (Engine.open sets a default)")
    tokens = [host] if host is not None else [r.need_tokens for r in requests]
    return a * (1 + sum(-(-blocks_for(t, bs) // a) for t in tokens))


def metadata_bytes(plan: SparsePlan, host_rows: int, head_dim: int, itemsize: int, sub_blocks: int = 1,
                   coarse_group: int = 1) -> int:
    """Key bounds (min and max) of every sparse layer and host row (`sub_blocks` slices of it), stored in the
    metadata dtype (`itemsize` bytes: `BlockScoring.metadata_dtype`), plus with two-level scoring one bound per
    group of `coarse_group` rows."""
    rows = host_rows * sub_blocks + (host_rows // coarse_group if coarse_group > 1 else 0)
    return 2 * plan.sparse_layers * rows * plan.num_kv_heads * head_dim * itemsize


def offload_blocks(plan: SparsePlan, req: Request) -> int:
    """GPU blocks an offloaded request holds at its peak: its steady footprint plus, while its prompt prefills, the
    prefill blocks its slot blocks cannot provide (`SparsePlan.scratch_blocks`)."""
    return plan.gpu_blocks(req.need_tokens) + plan.scratch_blocks(len(req.prompt), req.need_tokens)


def gpu_blocks_wanted(config: EngineConfig, plan: SparsePlan, requests: Sequence[Request] | None) -> int:
    """Blocks that run every request at once in the configured mode (the pool is this, capped by the budget): mode
    "auto" may run each either way. None (a server's requests, not known yet): no limit but the budget."""
    if requests is None:
        return UNLIMITED
    total = 0
    for r in requests:
        dense = blocks_for(r.need_tokens, config.block_size)
        offloaded = offload_blocks(plan, r)
        total += {"dense": dense, "offload": offloaded}.get(config.mode, max(dense, offloaded))
    return total


@dataclasses.dataclass(frozen=True)
class PoolSizes:
    """How an engine sizes its pools for a set of requests (`pool_sizes`)."""

    num_blocks: int  # GPU blocks the allocator hands out, the null block included
    host_rows: int  # host pool rows (0 in dense mode)
    plan: SparsePlan | None  # the sparse plan (None in dense mode)


def pool_sizes(config: EngineConfig, model_cfg, kv_dtype, meta_itemsize: int,
               requests: Sequence[Request] | None, cap_bytes: int) -> PoolSizes:
    """`sized_pools`, with budget_tokens cut to the longest context the requests can reach (`EngineConfig.for_context`)
    and the slot cache, when `slot_cache_blocks` is not set, the largest from its default (2x one step's
    selection) down to one step's selection under which every request that can run only offloaded fits the GPU
    pool (a server's: a request of the model's every position). When even the smallest does not, the requests'
    refusal names its footprint (a server keeps the default). The plan says what was chosen
    (`PoolSizes.plan.slot_blocks`)."""
    # a budget past the longest context the requests can reach attends every block (as dense): cut to that context
    context = (max((r.need_tokens for r in requests), default=0) if requests is not None
               else model_cfg.max_position_embeddings)  # (a server: the longest request the model takes)
    config = config.for_context(context)
    sizes = sized_pools(config, model_cfg, kv_dtype, meta_itemsize, requests, cap_bytes)
    if sizes.plan is None or config.offload.slot_cache_blocks is not None:
        return sizes
    targets = requests
    if targets is None:  # a server: the longest request the model takes
        positions = model_cfg.max_position_embeddings
        targets = [Request(-1, [0] * (positions - 1), SamplingParams(max_new_tokens=1), 1)]
    if config.mode == "auto":  # (a request that runs dense is not held to its offloaded footprint)
        targets = [r for r in targets if blocks_for(r.start_tokens, config.block_size) > sizes.num_blocks - 1]

    def fits(s: PoolSizes) -> bool:
        return all(offload_blocks(s.plan, r) <= s.num_blocks - 1 for r in targets)

    if fits(sizes):
        return sizes
    smaller = sizes
    for slots in range(sizes.plan.slot_blocks - 1, sizes.plan.middle_blocks - 1, -1):
        smaller = sized_pools(config.with_settings(slot_cache_blocks=slots), model_cfg, kv_dtype, meta_itemsize,
                              requests, cap_bytes)
        if fits(smaller):
            return smaller
    return sizes if requests is None else smaller  # (a refusal then names the smallest footprint)


def sized_pools(config: EngineConfig, model_cfg, kv_dtype, meta_itemsize: int,
                requests: Sequence[Request] | None, cap_bytes: int) -> PoolSizes:
    """The GPU KV pool (blocks) and host pool (rows) an engine allocates for `requests` under a cap of `cap_bytes` GPU
    bytes (pool + offload metadata): kv_cache_tokens if set, else what the requests need in the configured mode, capped.
    Nothing is set aside for prefills: an offloaded prompt prefills layer by layer in blocks its request holds
    (`offload_blocks`). `kv_dtype`: the cache's storage dtype (float8: scales included). `meta_itemsize`: bytes per
    key-bound element (the scoring's metadata dtype). A pure function of its inputs (the engine's Engine.ensure_pool,
    the ahead-of-time check's layouts). `requests` None: a server's pools, for requests that arrive later: the GPU pool
    takes the whole budget (or kv_cache_tokens), the host pool host_kv_tokens.

    Mode "auto" gives every request host rows (so IOAA may offload any of them) unless their key metadata, which
    lives on the GPU, would cost a request the room that dense or offload mode alone would give it: then only the
    requests that cannot run dense get rows (`_auto_sizes`)."""
    c, bs = model_cfg, config.block_size
    per_block = c.num_layers * layer_block_bytes(bs, c.num_kv_heads, c.head_dim, kv_dtype)
    if config.mode == "dense":
        want = UNLIMITED if requests is None else sum(blocks_for(r.need_tokens, bs) for r in requests)
        return PoolSizes(_num_blocks(config, want, cap_bytes, per_block), 0, None)
    plan = sparse_plan(config, c.num_layers, c.num_kv_heads)

    def sized(with_rows: Sequence[Request] | None, mode: str) -> PoolSizes | None:
        """Rows for `with_rows`; the pool for every request in `mode`; None if the metadata leaves no pool."""
        rows = max(2 * config.scoring.coarse_group, host_rows_for(config, with_rows))
        left = cap_bytes - metadata_bytes(plan, rows, c.head_dim, meta_itemsize, config.scoring.sub_blocks,
                                          config.scoring.coarse_group)
        if left < 2 * per_block:
            return None
        want = gpu_blocks_wanted(config.with_settings(mode=mode), plan, requests)
        return PoolSizes(_num_blocks(config, want, left, per_block), rows, plan)

    full = sized(requests, config.mode)
    if config.mode == "auto" and config.offload.host_kv_tokens is None and requests is not None:
        dense_nb = _num_blocks(config, sum(blocks_for(r.need_tokens, bs) for r in requests), cap_bytes, per_block)
        full = _auto_sizes(config, plan, requests, full, sized, dense_nb)
    if full is None:
        rows = host_rows_for(config, requests)
        raise ValueError(f"gpu_kv_budget={config.gpu_kv_budget} does not even hold the key metadata of a "
                         f"{rows}-block host pool; raise gpu_kv_budget or lower host_kv_tokens")
    return full


def _num_blocks(config: EngineConfig, want: int, cap_bytes: int, per_block: int) -> int:
    """Pool blocks (the null block included): kv_cache_tokens, else `want` blocks capped by `cap_bytes`."""
    if config.kv_cache_tokens is not None:
        return blocks_for(config.kv_cache_tokens, config.block_size) + 1
    return max(2, min(want + 1, cap_bytes // per_block))


def _auto_sizes(config: EngineConfig, plan: SparsePlan, requests: Sequence[Request], full: PoolSizes | None, sized,
                dense_nb: int) -> PoolSizes | None:
    """Mode auto's pools: rows for every request (`full`) if every request that dense or offload mode alone would
    admit can run under them; else rows only for the requests that need them (too large for dense, small enough
    offloaded: iterated, since their metadata shrinks the pool), whichever split runs the most of those requests.
    `dense_nb`: the pool mode dense would allocate."""
    bs = config.block_size
    off = sized(requests, "offload")

    def runs(s: PoolSizes | None, r: Request, *, dense: bool = True) -> bool:
        """Whether `r` runs under pools `s` (dense, when `dense`, or offloaded)."""
        if s is None:
            return False
        cap = s.num_blocks - 1
        rows = -(-blocks_for(r.need_tokens, bs) // config.scoring.coarse_group) * config.scoring.coarse_group
        fits_off = offload_blocks(plan, r) <= cap and rows <= s.host_rows - config.scoring.coarse_group
        return (dense and blocks_for(r.start_tokens, bs) <= cap) or fits_off

    # (a dense request runs once its prompt fits: its KV grows as it decodes, capped at what the pool holds)
    alone = [r for r in requests if blocks_for(r.start_tokens, bs) <= dense_nb - 1 or runs(off, r, dense=False)]
    if all(runs(full, r) for r in alone):
        return full
    best, score = full, sum(runs(full, r) for r in alone)
    must: list[Request] = []
    for _ in range(8):  # rows for the requests that need them to run: those too large for dense that fit offloaded
        s = sized(must, "auto")
        got = sum(runs(s, r) for r in alone)
        if got > score:
            best, score = s, got
        if s is None:
            break
        nxt = [r for r in requests if blocks_for(r.start_tokens, bs) > s.num_blocks - 1
               and offload_blocks(plan, r) <= s.num_blocks - 1]
        if [r.index for r in nxt] == [r.index for r in must]:
            break
        must = nxt
    return best


