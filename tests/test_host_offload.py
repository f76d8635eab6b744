"""host_offload: host pool transfers of both I/O backends (bit-exact, counted), the backend probe, slot cache
LRU, per-request block roles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from host_offload import host_pool as host_pool_mod
from host_offload.host_pool import NULL_ROW, HostKVPool, probe_host_io
from host_offload.placement import SparseKV, SparsePlan
from host_offload.slot_cache import SlotCache

L, NB, BS, HKV, HD = 4, 9, 4, 2, 8


def _pool(rows=12, first_layer=1, dtype=jnp.float32, io="xla"):
    return HostKVPool(num_rows=rows, first_layer=first_layer, num_layers=L, block_size=BS, num_kv_heads=HKV,
                      head_dim=HD, dtype=dtype, device=jax.devices()[0], io=io)


def _kv(seed, dtype=np.float32):
    kv = np.random.default_rng(seed).standard_normal((L, NB, 2, BS, HKV, HD)).astype(dtype)
    kv[:, 4, 1, 2, 1, 3] = np.nan  # NaN payloads must survive the copies
    return kv


@pytest.mark.parametrize("io", ["xla", "numpy"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_host_pool_round_trip_bit_exact(dtype, io):
    pool = _pool(dtype=dtype, io=io)
    assert pool.io_name == io
    if io == "xla":
        assert pool.pool.sharding.memory_kind == "pinned_host"
    else:
        assert isinstance(pool.pool, np.ndarray)
    kv_np = _kv(0).astype(dtype)
    kv = jnp.asarray(kv_np)
    rows = pool.allocate(3, owner=5)
    gpu = [4, 2, 7]
    pool.write_back(kv, gpu, rows)
    assert (pool.d2h_copies, pool.d2h_bytes) == (1, 3 * (L - 1) * pool.layer_block_bytes)
    for g, r in zip(gpu, rows, strict=True):
        for layer in range(L - 1):
            np.testing.assert_array_equal(pool.read(layer, r).view(np.uint8), kv_np[layer + 1, g].view(np.uint8))
    # coalesced whole blocks: one copy, padded to a power of two, real rows first in the given order
    st = pool.gather_blocks(1, [rows[2], rows[0], rows[1]])
    assert st.sharding.memory_kind == "device" and st.shape == (4, 2, BS, HKV, HD)
    np.testing.assert_array_equal(np.asarray(st)[:3].view(np.uint8), kv_np[2, [7, 4, 2]].view(np.uint8))
    assert (pool.h2d_copies, pool.h2d_bytes) == (1, 3 * pool.layer_block_bytes)
    # (block, head) units: coalesced (one copy) and fragmented (one copy per unit) move the same bits
    heads = [1, 0, 1]
    units = pool.gather_units(0, rows, heads)
    frag = pool.fragment_units(0, rows, heads)
    want = np.stack([kv_np[1, g, :, :, h] for g, h in zip(gpu, heads, strict=True)])
    np.testing.assert_array_equal(np.asarray(units)[:3].view(np.uint8), want.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(frag)[:3].view(np.uint8), want.view(np.uint8))
    assert pool.h2d_copies == 1 + 1 + 3
    assert pool.h2d_bytes == 3 * pool.layer_block_bytes + 2 * 3 * pool.unit_bytes
    assert pool.unit_bytes * HKV == pool.layer_block_bytes
    # a later write-back of the same row wins, and a write is visible to the very next gather
    kv2 = jnp.asarray(_kv(1).astype(dtype))
    pool.write_back(kv2, [3], [rows[1]])
    np.testing.assert_array_equal(np.asarray(pool.gather_blocks(2, [rows[1]]))[0].view(np.uint8),
                                  np.asarray(kv2)[3, 3].view(np.uint8))
    assert not pool.contents()[:, NULL_ROW].any()  # padding never lands in the null row's data
    assert pool.measure_h2d(nbytes=1 << 16, repeats=1) > 0  # IOAA's bandwidth, from this backend's memory


@pytest.mark.parametrize("io", ["xla", "numpy"])
def test_probe_host_io_passes_where_the_backend_works(io):
    assert probe_host_io(jax.devices()[0], block_size=BS, num_kv_heads=HKV, head_dim=HD, dtype=jnp.bfloat16,
                         io=io) is None


def test_probe_host_io_reports_failures_and_wrong_bits(monkeypatch):
    dev = jax.devices()[0]
    kw = dict(block_size=BS, num_kv_heads=HKV, head_dim=HD, dtype=jnp.float32)

    def boom(*a, **k):
        raise RuntimeError("UNIMPLEMENTED: host compute\nsecond line")

    monkeypatch.setattr(host_pool_mod.XlaHostIO, "stage_units", boom)
    assert probe_host_io(dev, **kw) == "RuntimeError: UNIMPLEMENTED: host compute"
    monkeypatch.undo()
    real = host_pool_mod.NumpyHostIO.stage_blocks
    monkeypatch.setattr(host_pool_mod.NumpyHostIO, "stage_blocks", lambda self, *a: real(self, *a)[::-1].copy())
    assert probe_host_io(dev, io="numpy", **kw) == f"gather_blocks returned wrong values on {dev.platform}"


def test_host_pool_rows_and_errors():
    with pytest.raises(ValueError, match="io='cuda'; use one of xla, numpy"):
        _pool(io="cuda")
    pool = _pool(rows=4)
    rows = pool.allocate(3, owner=1)
    assert 0 not in rows
    with pytest.raises(Exception, match="host KV pool.*host_kv_tokens"):
        pool.allocate(1, owner=2)
    with pytest.raises(ValueError, match="non-null row"):
        pool.write_back(jnp.zeros((L, NB, 2, BS, HKV, HD)), [1], [0])
    pool.free(rows, owner=1)
    pool.check_integrity()
    assert pool.allocator.num_free == 3


def test_slot_cache_lru_reuse_and_eviction():
    c = SlotCache(3)
    hits, misses = c.plan([10, 11])
    assert hits == [] and [k for k, _ in misses] == [10, 11]
    hits, misses = c.plan([11, 10])  # a repeated selection recalls nothing
    assert sorted(hits) == sorted(misses + [(10, c.slot(10)), (11, c.slot(11))]) and misses == []
    c.plan([12])  # fills the last free slot; LRU order now 11, 10, 12 (11 was touched before 10)
    slot11 = c.slot(11)
    hits, misses = c.plan([13, 10])  # needs one slot: evicts 11 (LRU, not wanted now), never 10
    assert misses == [(13, slot11)] and hits == [(10, c.slot(10))]
    assert 11 not in c and 10 in c and 12 in c
    hits, misses = c.plan([12, 13, 10])
    assert misses == [] and len(hits) == 3
    assert len({c.slot(k) for k in (10, 12, 13)}) == 3  # distinct slots
    assert (c.hits, c.misses) == (2 + 1 + 3, 2 + 1 + 1)
    with pytest.raises(ValueError, match="slot cache holds 3"):
        c.plan([1, 2, 3, 4])
    with pytest.raises(ValueError, match="distinct"):
        c.plan([1, 1])


def test_slot_cache_keys_mirror_the_slots():
    """`keys[slot]` is the key each slot holds (-1 free), written in place into a caller's view."""
    rng = np.random.default_rng(0)
    store = np.full((2, 5), 7, np.int32)
    c = SlotCache(5, store[1])
    assert (store[1] == -1).all() and (store[0] == 7).all()
    for _ in range(40):
        c.plan(rng.choice(12, size=int(rng.integers(1, 6)), replace=False).tolist())
        held = {int(k): slot for slot, k in enumerate(store[1]) if k >= 0}
        assert held == {k: c.slot(k) for k in held} and len(held) == len(c)
    assert (store[0] == 7).all()
    with pytest.raises(ValueError, match="capacity=5"):
        SlotCache(5, np.zeros(4, np.int32))


def _plan(**kw):
    base = dict(num_layers=6, dense_layers=2, block_size=4, num_kv_heads=2, sink_blocks=1, window_blocks=2,
                budget_blocks=7, slot_blocks=8, selection="solohead", placement="host")
    return SparsePlan(**{**base, **kw})


def test_sparse_plan_validation():
    with pytest.raises(ValueError, match="leaves nothing to select"):
        _plan(budget_blocks=3)
    with pytest.raises(ValueError, match="slot_cache_blocks"):
        _plan(slot_blocks=2)
    with pytest.raises(ValueError, match="at least one layer must be sparse"):
        _plan(dense_layers=6)


def test_sparse_kv_roles_window_rotation_and_packs():
    p = _plan()
    prompt, total = 21, 40  # 6 prompt blocks (last partial), 10 blocks in all
    slots = p.slots_for(10)
    assert slots == min(8, 10 - 1 - 2)
    assert p.pack_blocks(10) == 4  # 10 blocks x 2 dense layers / 6 layers per GPU block, rounded up
    assert p.gpu_blocks(total) == p.resident_blocks + slots + 4
    gpu = list(range(1, p.gpu_blocks(total) + 1))
    s = SparseKV(p, 0, total, gpu, list(range(100, 110)))
    scratch = [50, 51, 52, 53, 54, 55, 56]
    assert s.prefill_table(scratch, prompt) == scratch[:6]
    with pytest.raises(ValueError, match="prefill scratch"):
        s.prefill_table(scratch[:5], prompt)
    spill, meta, resident = s.prefill_done(prompt)
    assert spill == list(range(6)) and meta == [1, 2, 3]  # middle = after the sink, before the 2-block window
    assert sorted(s.gpu_of) == [0, 4, 5] and len(s.spare) == 1
    assert resident == [(scratch[j], s.gpu_of[j]) for j in (0, 4, 5)]  # copied out of the scratch
    owned = s.owned_gpu_blocks()
    assert sorted(owned) == gpu and not set(owned) & set(scratch)
    # token 24 starts block 6: block 4 leaves the window, its GPU block becomes the spare
    assert s.advance(24) == []  # 24 tokens = blocks 0..5: no new block yet
    b4 = s.gpu_of[4]
    exits = s.advance(25)
    assert exits == [(4, b4)] and sorted(s.gpu_of) == [0, 5, 6] and s.spare == [b4]
    assert s.advance(26) == []
    # dense-layer units: distinct for every (block, dense layer), inside the packs, never a resident block
    nb = 64  # GPU pool blocks
    units = {s.dense_unit(j, d, nb) for j in range(10) for d in range(2)}
    assert len(units) == 20
    assert {u % nb for u in units} <= set(s.packs)
    assert all(u // nb < p.num_layers for u in units)


def test_sparse_kv_device_placement_keeps_everything():
    p = _plan(placement="device")
    assert p.gpu_blocks(40) == 10
    s = SparseKV(p, 0, 40, list(range(1, 11)), list(range(100, 110)))
    assert s.prefill_table([50], 21) == list(range(1, 11))  # its own blocks, not the scratch
    spill, meta, resident = s.prefill_done(21)
    assert spill == [] and resident == [] and meta == [1, 2, 3]
    assert all(s.is_resident(j) for j in range(10))
    assert s.advance(25) == [(4, 5)]  # leaves the window: metadata only, the block stays
    assert s.is_resident(4) and s.dense_unit(3, 1, NB) == 1 * NB + 4
