"""Admission under a GPU KV budget, over random queues (no model runs: the engine's sizing, scheduler and placer with
a host pool, requests prefilled and decoded by bookkeeping only): mode "auto" runs every request that mode "dense" or
"offload" alone runs, never exceeds the GPU or host budget, never loses a block, and a full host pool makes requests
wait, never half-spill."""

import dataclasses

import numpy as np
import pytest
from pulseinfer_jax.host_offload.host_pool import HostKVPool

from pulseinfer_jax import EngineConfig, SamplingParams
from pulseinfer_jax.kv.blocks import BlockAllocator, blocks_for
from pulseinfer_jax.request import Request, Status
from pulseinfer_jax.sched.admission import IOAAConfig
from pulseinfer_jax.sched.placer import OffloadPlacer
from pulseinfer_jax.sched.pools import metadata_bytes, pool_sizes
from pulseinfer_jax.sched.scheduler import FixedStepTime, Scheduler

BASE = dict(block_size=4, prefill_chunk=32, key_chunk=32, window_tokens=8, sink_blocks=1, budget_tokens=24)


@dataclasses.dataclass
class Outcome:
    ran: set  # requests that completed
    refused: set  # refused when submitted
    peak_bytes: int  # most GPU KV bytes held at once (blocks handed out + key metadata)
    budget: int


def simulate(cfg_model, config: EngineConfig, queue: list[tuple[int, int]], budget: int, h2d: float) -> Outcome:
    """The engine's admission loop over `queue` [(prompt tokens, new tokens)] with a prefill of one step per request
    and one token per decode step; checks block and row integrity at every step."""
    c, bs = cfg_model, config.block_size
    per_block = c.num_layers * 2 * c.num_kv_heads * bs * c.head_dim * 4
    reqs = [Request(i, [1] * p, SamplingParams(max_new_tokens=n, ignore_eos=True), n) for i, (p, n) in enumerate(queue)]
    meta_item = config.scoring.metadata_dtype(np.float32).itemsize
    sizes = pool_sizes(config, c, "float32", meta_item, reqs, budget)
    alloc = BlockAllocator(sizes.num_blocks)
    meta = 0
    if sizes.plan is None:
        sched = Scheduler(alloc, bs, config.max_batch)
        pool = None
    else:
        import jax

        pool = HostKVPool(num_rows=sizes.host_rows, first_layer=sizes.plan.dense_layers, num_layers=c.num_layers,
                          block_size=bs, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, dtype=np.float32,
                          device=jax.devices()[0], io="numpy", row_align=config.scoring.coarse_group)
        meta = metadata_bytes(sizes.plan, sizes.host_rows, c.head_dim, meta_item, config.scoring.sub_blocks,
                              config.scoring.coarse_group)
        placer = OffloadPlacer(sizes.plan, alloc, pool, bs)
        sched = Scheduler(alloc, bs, config.max_batch, mode=config.mode, placer=placer,
                          ioaa=IOAAConfig(h2d_bytes_per_s=h2d), cost=FixedStepTime(0.02))
    refused = set()
    for r in reqs:
        try:
            sched.add(r)
        except ValueError:
            refused.add(r.index)
    peak = 0
    for _ in range(10_000):
        if not sched.has_work():
            break
        sched.reserve_decode()  # dense requests grow (preempting the youngest when the pool is out)
        sched.admit()
        if not sched.prefilling and not sched.running:
            break  # stalled: the waiting requests would wait forever
        pf = sched.next_prefill()
        peak = max(peak, alloc.num_used * per_block + meta)
        for r in list(sched.running):  # one decode step
            assert len(r.blocks) * bs >= r.seq_len or r.placement == "offload"
            r.output.append(0)
            if len(r.output) >= r.max_new_tokens:
                sched.finish(r, "length")
        if pf is not None:
            if pf.placement == "offload":  # a whole prompt never half-spills: all of its host rows from admission
                assert len(pf.sparse.host_rows) == blocks_for(pf.need_tokens, bs)
            recomputed, pf.recompute = pf.recompute, False  # (a preempted request's context is back: no new token)
            sched.prefill_done(pf)
            if not recomputed:
                pf.output.append(0)
                if len(pf.output) >= pf.max_new_tokens:
                    sched.finish(pf, "length")
        alloc.check_integrity()
        if pool is not None:
            pool.check_integrity()
            assert pool.allocator.num_free >= 0
    ran = {r.index for r in reqs if r.status is Status.FINISHED}
    assert alloc.num_free == alloc.capacity, "GPU blocks leaked"
    if pool is not None:
        assert pool.allocator.num_free == pool.allocator.capacity, "host rows leaked"
    return Outcome(ran, refused, peak, budget)


def random_case(rng: np.random.Generator, block_kv_bytes: int) -> tuple[list[tuple[int, int]], int, dict, float]:
    n = int(rng.integers(1, 6))
    queue = [(int(rng.integers(1, 400)), int(rng.integers(1, 24))) for _ in range(n)]
    dense_blocks = [blocks_for(p + m, 4) for p, m in queue]
    budget = int(rng.integers(6, max(dense_blocks) + 8)) * block_kv_bytes + int(rng.integers(0, block_kv_bytes))
    over = dict(dense_layers=int(rng.integers(0, 3)), max_batch=int(rng.integers(1, 5)))
    if rng.random() < 0.5:
        over["slot_cache_blocks"] = int(rng.integers(3, 12))
    if rng.random() < 0.3:
        over.update(score_coarse_group=2)
    return queue, budget, over, float(rng.choice([1e6, 1e9, 1e13]))


@pytest.mark.parametrize("seed", range(4))
def test_auto_runs_whatever_dense_or_offload_alone_runs(tiny4, seed):
    c = tiny4.cfg
    block_kv = c.num_layers * 2 * c.num_kv_heads * 4 * c.head_dim * 4
    rng = np.random.default_rng(seed)
    checked = 0
    for _ in range(60):
        queue, budget, over, h2d = random_case(rng, block_kv)
        out = {}
        for mode in ("dense", "offload", "auto"):
            try:
                config = EngineConfig.of(**BASE, **over, mode=mode, gpu_kv_budget=budget)
                out[mode] = simulate(c, config, queue, budget, h2d)
            except ValueError as e:  # the budget holds no pool at all in this mode
                assert mode != "dense" and "gpu_kv_budget" in str(e)
                out[mode] = Outcome(set(), set(range(len(queue))), 0, budget)
        for o in out.values():
            assert o.peak_bytes <= budget
            assert o.ran | o.refused == set(range(len(queue))), "a request waits forever"
        alone = out["dense"].ran | out["offload"].ran
        assert alone <= out["auto"].ran, (queue, budget, over, {m: (o.ran, o.refused) for m, o in out.items()})
        checked += bool(out["offload"].ran - out["dense"].ran)
    assert checked, "no queue where offloading ran what dense could not: the cases test too little"


def test_full_host_pool_queues_requests_and_refuses_what_never_fits(tiny4):
    """A host pool of one request's rows: the others wait for them (admitted only when its rows come back, each
    with all of its rows), and a request that needs more rows than the pool has is refused, saying both sizes."""
    c = tiny4.cfg
    queue = [(100, 8), (100, 8), (100, 8)]
    config = EngineConfig.of(**BASE, mode="offload", host_kv_tokens=(100 + 8) * 1, dense_layers=2)
    out = simulate(c, config, queue, 1 << 30, 1e13)
    assert out.ran == {0, 1, 2} and not out.refused
    with pytest.raises(ValueError, match=r"rows of the pinned host pool \(\d+ tokens, .* MiB\), which holds"):
        simulate_strict(c, config.with_settings(host_kv_tokens=64), [(100, 8)])


def simulate_strict(c, config: EngineConfig, queue):
    """Like `simulate`, but a refusal raises."""
    reqs = [Request(i, [1] * p, SamplingParams(max_new_tokens=n), n) for i, (p, n) in enumerate(queue)]
    import jax

    sizes = pool_sizes(config, c, "float32", 1, reqs, 1 << 30)
    alloc = BlockAllocator(sizes.num_blocks)
    pool = HostKVPool(num_rows=sizes.host_rows, first_layer=sizes.plan.dense_layers, num_layers=c.num_layers,
                      block_size=config.block_size, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                      dtype=np.float32, device=jax.devices()[0], io="numpy")
    sched = Scheduler(alloc, config.block_size, config.max_batch, mode=config.mode,
                      placer=OffloadPlacer(sizes.plan, alloc, pool, config.block_size))
    for r in reqs:
        sched.add(r)
