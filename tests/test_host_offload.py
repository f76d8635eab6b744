"""host_offload: host pool transfers of every I/O backend (bit-exact, counted), the backend probe, slot cache
LRU, per-request block roles."""

import collections
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pulseinfer_jax.host_offload import host_pool as host_pool_mod
from pulseinfer_jax.host_offload.host_pool import NULL_ROW, HostKVPool, probe_host_io
from pulseinfer_jax.host_offload.placement import SparseKV, SparsePlan
from pulseinfer_jax.host_offload.recall_thread import RecallThread

from pulseinfer_jax.kv.quant import block_rows
from pulseinfer_jax.selection.slot_table import SlotCache, SlotTable

L, NB, BS, HKV, HD = 4, 9, 4, 2, 8


def _pool(rows=12, first_layer=1, dtype=jnp.float32, io="xla"):
    return HostKVPool(num_rows=rows, first_layer=first_layer, num_layers=L, block_size=BS, num_kv_heads=HKV,
                      head_dim=HD, dtype=dtype, device=jax.devices()[0], io=io)


def _kv(seed, dtype=np.float32, rows=BS):
    if dtype == jnp.uint8:  # float8 KV's bytes: any byte, e4m3 NaNs (0x7f, 0xff) included
        return np.random.default_rng(seed).integers(0, 256, (L, NB, 2, rows, HKV, HD), np.uint8)
    kv = np.random.default_rng(seed).standard_normal((L, NB, 2, rows, HKV, HD)).astype(dtype)
    kv[:, 4, 1, 2, 1, 3] = np.nan  # NaN payloads must survive the copies
    return kv


@pytest.mark.parametrize("io", ["xla", "numpy", "numpy-pinned"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.uint8])  # (uint8: float8 KV's bytes)
def test_host_pool_round_trip_bit_exact(dtype, io):
    """(float8: blocks of BS + 1 rows, the last one the scale codes: moved with the block, never re-quantised.)"""
    pool = _pool(dtype=dtype, io=io)
    rs = block_rows(BS, HD, dtype)
    assert pool.shape[3] == rs
    assert pool.io_name == io
    if io == "xla":
        assert pool.pool.sharding.memory_kind == "pinned_host"
    else:
        assert isinstance(pool.pool, np.ndarray)
    kv_np = _kv(0, dtype, rows=rs)
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
    assert st.sharding.memory_kind == "device" and st.shape == (4, 2, rs, HKV, HD)
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
    kv2 = jnp.asarray(_kv(1, dtype, rows=rs))
    pool.write_back(kv2, [3], [rows[1]])
    np.testing.assert_array_equal(np.asarray(pool.gather_blocks(2, [rows[1]]))[0].view(np.uint8),
                                  np.asarray(kv2)[3, 3].view(np.uint8))
    assert not pool.contents()[:, NULL_ROW].any()  # padding never lands in the null row's data
    assert pool.measure_h2d(nbytes=1 << 16, repeats=1) > 0  # IOAA's bandwidth, from this backend's memory


@pytest.mark.parametrize("io", ["xla", "numpy", "numpy-pinned"])
def test_recalls_started_ahead_move_what_the_gathers_move(io):
    """`recall_blocks` / `recall_units` (a recall started one step ahead): the numpy pool gathers them on its recall
    thread in submission order, while the driver queues write-backs: each recall sees every write-back queued before
    it, none queued after it, bit for bit; counted when started; the thread's errors reach the caller."""
    pool = _pool(io=io)
    assert pool.recalls_off_thread == (io != "xla")
    kv1, kv2 = _kv(0), _kv(1)
    rows = pool.allocate(3, owner=1)
    pool.write_back(jnp.asarray(kv1), [4, 2, 7], rows)
    gate = threading.Event()  # (the thread held until every call below was made: the later write is queued first)
    if io != "xla":
        pool._thread = RecallThread()
        pool._thread.submit(lambda: gate.wait(30))
    first = pool.recall_blocks(1, [rows[2], rows[0]])
    units = pool.recall_units(0, [rows[1], rows[2]], [1, 0])
    pool.write_back(jnp.asarray(kv2), [5], [rows[0]])  # queued after `first`: not in it, in the next recall
    second = pool.recall_blocks(1, [rows[0]])
    assert (pool.h2d_copies, pool.h2d_bytes) == (3, 3 * pool.layer_block_bytes + 2 * pool.unit_bytes)
    assert not first.gathered() or io == "xla"
    gate.set()
    got, _ = first.result()
    np.testing.assert_array_equal(np.asarray(got)[:2], kv1[2, [7, 4]])
    got, _ = units.result()
    np.testing.assert_array_equal(np.asarray(got)[:2], np.stack([kv1[1, 2, :, :, 1], kv1[1, 7, :, :, 0]]))
    got, _ = second.result()
    np.testing.assert_array_equal(np.asarray(got)[0], kv2[2, 5])
    assert first.gathered() and second.ready()
    pool.sync()
    if io != "xla":  # a gather that fails on the thread raises where its staging is asked for, not as a hang
        bad = pool.recall_blocks(1, [pool.num_rows + 5])
        with pytest.raises(IndexError):
            bad.result()
        np.testing.assert_array_equal(pool.read(1, rows[0]), kv2[2, 5])  # the thread goes on after an error


@pytest.mark.parametrize("io", ["xla", "numpy", "numpy-pinned"])
@pytest.mark.parametrize("units", [False, True])
def test_a_step_recall_gathers_every_layers_rows_in_one_copy(io, units):
    """`recall_step`: a whole decode step's misses of every pool layer (entry i: row rows[i] of layer layers[i]; with
    heads, its (block, head) unit) in ONE staging buffer, in order, padded with the null row to a power of two of at
    least `at_least` entries; ONE copy counted, with the real entries' bytes; a row outside the pool refused."""
    pool = _pool(io=io)
    kv = _kv(3)
    rows = pool.allocate(4, owner=1)
    pool.write_back(jnp.asarray(kv), [4, 2, 7, 8], rows)  # pool layer l holds cache layer l + 1
    layers = np.array([0, 0, 2, 1, 2], np.int32)
    at = np.array([rows[0], rows[3], rows[1], rows[2], rows[0]], np.int32)
    blocks = np.array([4, 8, 2, 7, 4])
    heads = np.array([1, 0, 0, 1, 1], np.int32) if units else None
    recall = pool.recall_step(layers, at, heads, at_least=11)
    assert (pool.h2d_copies, pool.h2d_bytes) == (1, 5 * (pool.unit_bytes if units else pool.layer_block_bytes))
    got = np.asarray(recall.result()[0])
    assert got.shape[0] == 16  # bucket(max(5, 11))
    want = kv[layers + 1, blocks]
    if units:
        want = want[np.arange(5), :, :, heads]
    np.testing.assert_array_equal(got[:5], want)
    assert not got[5:].any()  # the null row (never written)
    with pytest.raises(ValueError, match="outside the pool's rows"):
        pool.recall_step(np.zeros(1, np.int32), np.array([pool.num_rows], np.int32))


def test_pinned_staging_ring_reuses_buffers_only_after_their_copies():
    """"numpy-pinned": whole blocks are gathered into pinned staging buffers from a ring per shape, each copied to the
    device without a second host copy; a buffer comes round again only after its copy finished (a copy in flight makes
    the ring grow instead), so every recall keeps its own bits while buffers are reused; (block, head) units take the
    numpy path."""
    from pulseinfer_jax.host_offload.pinned_staging import MAX_STAGING

    pool = _pool(io="numpy-pinned", dtype=jnp.bfloat16)
    data = _kv(3, jnp.bfloat16)[1:, :]  # [Ls, NB, ...]: rows 1..8 of the pool hold blocks 1..8 of layers 1..3
    full = np.zeros(pool.shape, jnp.bfloat16)
    full[:, 1:NB] = data[:, 1:NB]
    pool.load(full)
    picks = [[1 + (i * 3 + j) % (NB - 1) for j in range(3)] for i in range(8)]
    recalls = [pool.recall_blocks(i % 3, rows) for i, rows in enumerate(picks)]  # all on the thread, one shape
    stagings = []
    for i, (rows, rec) in enumerate(zip(picks, recalls, strict=True)):
        got, _ = rec.result()
        assert got.sharding.memory_kind == "device" and got.shape == (4, 2, BS, HKV, HD)
        np.testing.assert_array_equal(np.asarray(got)[:3].view(np.uint16), full[i % 3, rows].view(np.uint16))
    for i, rows in enumerate(picks):  # synchronous: the staging itself is pinned host memory, from the ring
        staging = pool.stage_blocks(i % 3, rows)
        assert staging.sharding.memory_kind == "pinned_host"
        stagings.append(staging)
        np.testing.assert_array_equal(np.asarray(pool.to_device(staging))[:3].view(np.uint16),
                                      full[i % 3, rows].view(np.uint16))
    staging = pool.io.staging
    ring = staging._rings[((4, 2, BS, HKV, HD), np.dtype(jnp.bfloat16).str)]
    assert len({id(s) for s in stagings}) <= len(ring) < len(picks)  # (buffers reused once their copies were done)
    assert staging.buffers() <= 2 * MAX_STAGING
    slow = staging.put  # copies that stay in flight: the ring grows instead of overwriting their buffers
    pending = []

    class InFlight:
        def __init__(self, arr):
            self.arr = arr

        def is_ready(self):
            return False

        def block_until_ready(self):
            pending.append(self.arr)
            return self.arr

    def put_in_flight(st):
        out = slow(st)
        staging._by_array[id(st)].copy = InFlight(out)
        return out

    staging.put = put_in_flight
    made, free = staging.buffers(), len(ring)
    more = [picks[i % len(picks)] for i in range(free + 3)]
    outs = [pool.gather_blocks(1, rows) for rows in more]
    assert staging.buffers() == made + 3 and not pending  # (the free buffers reused, then three added, none waited)
    for rows, out in zip(more, outs, strict=True):
        np.testing.assert_array_equal(np.asarray(out)[:3].view(np.uint16), full[1, rows].view(np.uint16))
    staging.put = slow
    for i, rec in enumerate(recalls):  # every earlier copy still holds its own blocks after the ring turned
        np.testing.assert_array_equal(np.asarray(rec.result()[0])[:3].view(np.uint16),
                                      full[i % 3, picks[i]].view(np.uint16))
    with pytest.raises(IndexError, match="out of range"):  # checked rows (the gather itself clips)
        pool.gather_blocks(0, [pool.num_rows])
    units = pool.gather_units(1, [2, 5], [1, 0])
    np.testing.assert_array_equal(np.asarray(units)[:2].view(np.uint16),
                                  np.stack([full[1, 2, :, :, 1], full[1, 5, :, :, 0]]).view(np.uint16))


def test_probe_catches_a_staging_copy_that_aliases(monkeypatch):
    """Where the copy to the device would alias the pinned staging (or not wait for it), a later recall overwrites an
    earlier one's blocks: the probe's repeated gathers see it and the engine falls back to "numpy"."""
    from pulseinfer_jax.host_offload.pinned_staging import PinnedStaging

    monkeypatch.setattr(PinnedStaging, "put", lambda self, staging: staging)
    err = probe_host_io(jax.devices()[0], block_size=BS, num_kv_heads=HKV, head_dim=HD, dtype=jnp.bfloat16,
                        io="numpy-pinned")
    assert err == f"repeated gathers returned wrong values on {jax.devices()[0].platform}"


@pytest.mark.parametrize("io", ["xla", "numpy", "numpy-pinned"])
def test_gathers_from_a_pool_no_write_back_has_touched(io):
    """A fresh pool reads as zeros through every gather (the xla host gathers once failed here on mixed memory
    spaces: the pool's traced value came in without the host memory space until a write-back had produced it)."""
    pool = _pool(io=io)
    z = np.zeros((2, BS, HKV, HD), np.float32)
    np.testing.assert_array_equal(np.asarray(pool.gather_blocks(1, [3, 5]))[:2], np.stack([z, z]))
    np.testing.assert_array_equal(np.asarray(pool.gather_units(0, [3], [1]))[:1], z[None, :, :, 0])
    np.testing.assert_array_equal(np.asarray(pool.fragment_units(2, [4], [0]))[:1], z[None, :, :, 0])


@pytest.mark.smoke
@pytest.mark.parametrize("io", ["xla", "numpy", "numpy-pinned"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.uint8])  # (uint8: a float8 cache's bytes, scale rows included)
def test_probe_host_io_passes_where_the_backend_works(io, dtype):
    assert probe_host_io(jax.devices()[0], block_size=BS, num_kv_heads=HKV, head_dim=HD, dtype=dtype, io=io) is None


@pytest.mark.smoke
@pytest.mark.parametrize("plain", [True, False])
def test_xla_copies_up_with_a_plain_put_or_a_jitted_copy_bit_for_bit(plain, monkeypatch):
    """The xla pool's copy to the device: a plain device_put where the runtime takes a program's pinned-host output
    (jaxlib 0.11), a jitted copy where it does not (jaxlib 0.12's CPU runtime); both move every bit, float8 bytes
    included, and the engine's backend choice sees the same. The jitted copy forced here whatever this jax does."""
    from pulseinfer_jax.host_offload import xla_io

    if plain and not _pool(io="xla").io.copy_up == "device_put":
        pytest.skip("this jax's runtime refuses the plain copy (docs/limits.md)")
    monkeypatch.setattr(xla_io, "plain_put_takes_program_outputs", lambda host, dev: plain)
    assert _pool(io="xla").io.copy_up == ("device_put" if plain else "jit")
    for dtype in (jnp.bfloat16, jnp.uint8):
        assert probe_host_io(jax.devices()[0], block_size=BS, num_kv_heads=HKV, head_dim=HD, dtype=dtype) is None


def test_the_plain_copy_check_asks_the_runtime():
    """`plain_put_takes_program_outputs` answers from a real copy: False only where the runtime refuses it."""
    from pulseinfer_jax.host_offload import xla_io
    from pulseinfer_jax.host_offload.memory import device_sharding, host_sharding

    dev = jax.devices()[0]
    made = jax.jit(lambda: jnp.ones((3,)), out_shardings=host_sharding(dev))()
    try:
        jax.device_put(made, device_sharding(dev)).block_until_ready()
        takes = True
    except jax.errors.JaxRuntimeError:
        takes = False
    assert xla_io.plain_put_takes_program_outputs(host_sharding(dev), device_sharding(dev)) is takes


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
    """`keys[slot]` is the key each slot holds (-1 free)."""
    rng = np.random.default_rng(0)
    c = SlotCache(5)
    assert (c.keys == -1).all() and c.keys.shape == (5,)
    for _ in range(40):
        c.plan(rng.choice(12, size=int(rng.integers(1, 6)), replace=False).tolist())
        held = {int(k): slot for slot, k in enumerate(c.keys) if k >= 0}
        assert held == {k: c.slot(k) for k in held} and len(held) == len(c)
    with pytest.raises(ValueError, match="capacity=0"):
        SlotCache(0)


class _ReferenceLRU:
    """The slot cache contract written the plain way (an OrderedDict per lane): the oracle for SlotCache."""

    def __init__(self, capacity: int):
        self.slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # LRU first
        self.free = list(range(capacity - 1, -1, -1))

    def plan(self, wanted: list[int]) -> list[tuple[int, bool]]:
        out = {}
        for key in wanted:
            if key in self.slot_of:
                out[key] = (self.slot_of[key], True)
                self.slot_of.move_to_end(key)
        for key in wanted:
            if key in out:
                continue
            slot = self.free.pop() if self.free else self.slot_of.pop(next(k for k in self.slot_of if k not in wanted))
            self.slot_of[key] = slot
            out[key] = (slot, False)
        return [out[k] for k in wanted]


@pytest.mark.parametrize("lanes,capacity,keys", [(1, 4, 9), (3, 5, 14), (8, 16, 200)])
def test_slot_table_matches_a_plain_lru_per_request_and_lane(lanes, capacity, keys):
    """SlotTable.plan (vectorised over requests, lanes and keys) = an independent OrderedDict LRU per (request,
    lane), slot for slot, over random steps that mix hits, misses, free slots, evictions, ragged (-1 padded) lanes,
    requests of different capacities and requests leaving (their host rows then reused by a new one)."""
    rng = np.random.default_rng(lanes * 100 + capacity)
    t = SlotTable(2, lanes, capacity, key_rows=4, table_rows=1)  # small: the key space and the rows have to grow
    live = {}  # table row -> (capacity, host-row offset, reference LRUs per layer and lane)

    def admit(offset):
        cap = int(rng.integers(1, capacity + 1))
        live[t.add(cap)] = (cap, offset, [[_ReferenceLRU(cap) for _ in range(lanes)] for _ in range(2)])

    for r in range(3):
        admit(1000 * r)
    hits = misses = 0
    for step in range(80):
        if step % 20 == 19:  # a request leaves; a new one takes its host rows
            gone = sorted(live)[0]
            offset = live.pop(gone)[1]
            t.remove(gone)
            admit(offset)
        rows = np.array(sorted(live))
        sl = step % 2
        width = int(rng.integers(1, capacity + 1))
        wanted = np.full((len(rows), lanes, width), -1, np.int64)
        for b, row in enumerate(rows):
            cap = live[row][0]
            for lane in range(lanes):
                n = int(rng.integers(0, min(width, cap) + 1))
                wanted[b, lane, :n] = rng.choice(keys, size=n, replace=False)
        host = np.where(wanted >= 0, wanted + np.array([live[r][1] for r in rows])[:, None, None], -1)
        slots, hit = t.plan(sl, rows, wanted, host)
        for b, row in enumerate(rows):
            cap, _, refs = live[row]
            for lane in range(lanes):
                n = int((wanted[b, lane] >= 0).sum())
                want = refs[sl][lane].plan(wanted[b, lane, :n].tolist())
                got = [(int(x), bool(h)) for x, h in zip(slots[b, lane, :n], hit[b, lane, :n], strict=True)]
                assert got == want
                assert (slots[b, lane, n:] == -1).all() and not hit[b, lane, n:].any()
                held = t.keys(row)[sl, lane]
                assert {int(k): x for k, x in refs[sl][lane].slot_of.items()} == {
                    int(k): x for x, k in enumerate(held) if k >= 0}  # keys mirror the slots
                hits += sum(h for _, h in want)
                misses += sum(not h for _, h in want)
    assert hits > 0 and misses > capacity * lanes  # evictions happened
    row = t.add(capacity)
    live[row] = (capacity, 9000, None)
    one = lambda w: np.broadcast_to(np.array(w, np.int64), (1, lanes, len(w))).copy()  # noqa: E731
    with pytest.raises(ValueError, match="distinct per lane"):
        t.plan(0, np.array([row]), one([1, 1]), one([1, 1]))
    cap = live[row][0]
    with pytest.raises(ValueError, match=f"slot cache holds {cap}"):
        t.plan(0, np.array([row]), one(list(range(cap + 1))), one(list(range(cap + 1))))
    with pytest.raises(ValueError, match="lanes"):
        t.plan(0, np.array([row]), np.zeros((1, lanes + 1, 1), np.int64), np.zeros((1, lanes + 1, 1), np.int64))
    t.remove(row)
    with pytest.raises(ValueError, match="not in use"):
        t.remove(row)


def test_slot_cache_lanes_are_independent_lrus():
    c = SlotCache(2, lanes=2)
    slots, hit = c.plan_lanes(np.array([[5, 6], [5, -1]]))
    assert slots.tolist() == [[0, 1], [0, -1]] and not hit.any()
    slots, hit = c.plan_lanes(np.array([[7, 5], [6, 5]]))  # lane 0 evicts 6; lane 1 has a free slot for 6
    assert slots.tolist() == [[1, 0], [1, 0]] and hit.tolist() == [[False, True], [False, True]]
    assert c.keys.tolist() == [[5, 7], [5, 6]] and (c.hits, c.misses) == (2, 5)


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
    nb = 64  # GPU pool blocks
    # the prompt's 6 blocks of a layer fit the slot blocks' 6 layer slices: no extra prefill block
    assert p.scratch_blocks(prompt, total) == 0 and p.scratch_blocks(slots * 6 * 4 + 1, total) == 1
    units = s.prefill_units([], nb, prompt)
    assert len(set(units)) == 6 and {u % nb for u in units} <= set(s.slot_blocks)
    with pytest.raises(ValueError, match="prefill units"):
        s.prefill_units([], nb, slots * 6 * 4 + 1)
    more = s.prefill_units([50], nb, slots * 6 * 4 + 1)  # one more block's layer slices
    assert more[-1] % nb == 50 and len(set(more)) == len(more)
    with pytest.raises(ValueError, match="layer by layer"):
        s.prefill_table()
    spill, meta, resident = s.prefill_done(prompt)
    assert spill == list(range(6)) and meta == list(range(6))  # every block's key bounds, sinks and window too
    assert s.block_lens(7) == [4, 4, 4, 4, 4, prompt - 20, 0]  # the partial last block's bounds: its tokens
    assert sorted(s.gpu_of) == [0, 4, 5] and len(s.spare) == 1
    assert resident == [(j, s.gpu_of[j]) for j in (0, 4, 5)]  # take a copy of the prompt's KV
    owned = s.owned_gpu_blocks()
    assert sorted(owned) == gpu
    # token 24 starts block 6: block 4 leaves the window, its GPU block becomes the spare
    assert s.advance(24) == []  # 24 tokens = blocks 0..5: no new block yet
    b4 = s.gpu_of[4]
    exits = s.advance(25)
    assert exits == [(4, b4)] and sorted(s.gpu_of) == [0, 5, 6] and s.spare == [b4]
    assert s.advance(26) == []
    # dense-layer units: distinct for every (block, dense layer), inside the packs, never a resident block
    units = {s.dense_unit(j, d, nb) for j in range(10) for d in range(2)}
    assert len(units) == 20
    assert {u % nb for u in units} <= set(s.packs)
    assert all(u // nb < p.num_layers for u in units)


def test_sparse_kv_device_placement_keeps_everything():
    p = _plan(placement="device")
    assert p.gpu_blocks(40) == 10
    s = SparseKV(p, 0, 40, list(range(1, 11)), list(range(100, 110)))
    assert s.prefill_table() == list(range(1, 11))  # its own blocks
    spill, meta, resident = s.prefill_done(21)
    assert spill == [] and resident == [] and meta == list(range(6)) and s.block_len(5) == 1
    assert all(s.is_resident(j) for j in range(10))
    assert s.advance(25) == [(4, 5)]  # leaves the window (its key bounds already complete), the block stays
    assert s.block_len(6) == 1
    assert s.is_resident(4) and s.dense_unit(3, 1, NB) == 1 * NB + 4
