"""Sparse KV offloading end to end on CPU (emulated pinned_host): lossless plumbing, the I/O path loses nothing,
transfer counts of the coalesced and fragmented paths, slot-cache reuse, IOAA placement, bad configurations."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import record_sampled_logits

from pulseinfer_jax import Engine, EngineConfig, SamplingParams, generate_long
from pulseinfer_jax.kv.blocks import blocks_for
from pulseinfer_jax.kv.quant import layer_block_bytes, unpack_blocks
from pulseinfer_jax.sched.admission import IOAAConfig
from pulseinfer_jax.selection.policy import BlockScoring

BASE = dict(block_size=4, max_batch=4, prefill_chunk=32, key_chunk=32, window_tokens=8, sink_blocks=1)


def _prompts(vocab, lengths=(61, 38, 47), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


@pytest.mark.parametrize("model_name,extra", [
    ("tiny", dict(dense_layers=1)),
    ("tiny4", dict(dense_layers=2)),
    ("tiny4", dict(dense_layers=2, selection="headwise", io="fragmented", recall="sync", micro_batches=1)),
    ("tiny4", dict(dense_layers=2, host_io="numpy", recall="interruptible", micro_batches=2)),
    ("tiny4", dict(dense_layers=2, recall="eager", micro_batches=2)),  # early attention queued before the plan read
    ("tiny4", dict(dense_layers=2, host_io="numpy", selection="headwise", io="fragmented")),
    # Qwen3-MoE: routed experts in every layer (each switch has its own tiny4 case; the experts need one run)
    ("moe4", dict(dense_layers=2, recall="interruptible", micro_batches=2)),
    ("tiny4", dict(dense_layers=2, kv_dtype="float8_e4m3fn")),  # float8 KV (both runs): its bytes round-trip exactly
])
def test_full_budget_offload_equals_dense(request, monkeypatch, model_name, extra):
    """Budget covering the whole context: same greedy tokens as dense, logits within 1e-5 (f32) of the logit
    scale, while the KV really lives on the host (blocks leave the window, are written back and recalled).
    Relative, because two dense paths already differ by ~1e-6 of the scale (jnp vs Pallas attention:
    2.8e-5 absolute at |logits| ~ 29 here): attention summed in another order, f32 rounding."""
    m = request.getfixturevalue(model_name)
    prompts = _prompts(m.cfg.vocab_size)
    seen = record_sampled_logits(monkeypatch)
    kv = {k: v for k, v in extra.items() if k == "kv_dtype"}
    dense = generate_long(prompts, m, max_new_tokens=24, ignore_eos=True, engine_config=EngineConfig.of(**BASE, **kv))
    dense_logits = dict(seen)
    seen.clear()
    cfg = EngineConfig.of(**BASE, mode="offload", budget_tokens=512, **extra)
    off = generate_long(prompts, m, max_new_tokens=24, ignore_eos=True, engine_config=cfg)
    assert [r.token_ids for r in off] == [r.token_ids for r in dense]
    assert seen.keys() == dense_logits.keys()
    worst = max(float(np.max(np.abs(seen[k] - dense_logits[k]))) for k in seen)
    scale = max(float(np.max(np.abs(v))) for v in dense_logits.values())
    # float8 KV: the scan and layer-wise programs' last-bit differences in K / V can move a float8 rounding (2^-4
    # of a value), hence 1e-3
    assert worst <= (1e-3 if kv else 1e-5) * scale, (worst, scale)
    # (an offloaded prompt prefills layer by layer: bit for bit the layer-wise dense prefill, test_offloaded_prefill.py;
    # the scan engines here compile all layers as one program, whose rounding may differ in the last bits)
    for r in off:
        s = r.stats
        assert s["mode"] == "offload" and s["offloaded"] is True
        assert s["recalled_blocks"] > 0 and s["recall_bytes"] > 0 and s["recall_transfers"] > 0
        assert s["written_back_blocks"] > 0 and s["reused_blocks"] > 0


@pytest.fixture(scope="module")
def unbudgeted_tokens(tiny4):
    """The dense engine's greedy tokens for `_prompts` (24 new each): what a budget that drops blocks changes."""
    dense = generate_long(_prompts(tiny4.cfg.vocab_size), tiny4, max_new_tokens=24, ignore_eos=True,
                          engine_config=EngineConfig.of(**BASE))
    return [r.token_ids for r in dense]


@pytest.mark.parametrize("selection,host_io,scoring", [
    ("solohead", "xla", {}), ("headwise", "xla", {}), ("solohead", "numpy", {}),
    ("solohead", "xla", dict(score_sub_blocks=2)), ("solohead", "numpy", dict(score_per_query_head=False)),
    ("solohead", "xla", dict(resident_bonus=0.0)),  # (the default bonus: device placement keeps the slot
    ("solohead", "xla", dict(resident_bonus=2.0)),  # caches' bookkeeping to select what host placement does)
    ("solohead", "numpy", dict(score_bounds_dtype="kv")),  # exact bounds (the default: float8, rounded outward)
    ("solohead", "xla", dict(score_coarse_group=2, score_coarse_keep=1.0)),  # two-level scoring
    ("headwise", "numpy", dict(score_coarse_group=4, score_coarse_keep=1.0, score_sub_blocks=2)),
    ("solohead", "xla", dict(recall="eager")), ("headwise", "numpy", dict(recall="eager", micro_batches=2)),
    ("solohead", "xla", dict(kv_dtype="float8_e4m3fn")),
])
def test_offloaded_sparse_equals_on_device_sparse(tiny4, unbudgeted_tokens, selection, host_io, scoring):
    """Same selection with the KV offloaded and with every block on the GPU: token for token, while the
    budget (6 of up to 22 blocks) really drops blocks."""
    prompts = _prompts(tiny4.cfg.vocab_size)
    kw = dict(**BASE, mode="offload", budget_tokens=24, dense_layers=2, selection=selection, **scoring)
    dev = generate_long(prompts, tiny4, max_new_tokens=24, ignore_eos=True,
                        engine_config=EngineConfig.of(**kw, offload_placement="device"))
    # a same-layer recall attends every selected block in its step, as device placement does (recall ahead attends
    # a miss one step later: test_recall_ahead_*)
    same_layer = {} if "recall" in scoring else dict(recall="interruptible")
    host = generate_long(prompts, tiny4, max_new_tokens=24, ignore_eos=True,
                         engine_config=EngineConfig.of(**kw, host_io=host_io, **same_layer))
    assert all(r.stats["host_io"] == host_io for r in host)
    assert [r.token_ids for r in host] == [r.token_ids for r in dev]
    assert all(r.stats["offloaded"] and r.stats["recall_bytes"] > 0 for r in host)
    assert all(not r.stats["offloaded"] and r.stats["recall_bytes"] == 0 for r in dev)
    assert [r.token_ids for r in host] != unbudgeted_tokens, "the budget did not drop anything"


def _run_until_last_token(engine, prompts, max_new):
    """Drive the engine; stop each request before its last token (its KV is still allocated then)."""
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    reqs = [engine.make_request(i, p, sp) for i, p in enumerate(prompts)]
    engine.ensure_pool(reqs)
    for r in reqs:
        engine.scheduler.add(r)
    while any(len(r.output) < max_new - 1 for r in reqs):
        list(engine.step())
    return reqs


@pytest.mark.parametrize("placement,kv_dtype,kw", [
    ("host", "auto", {}), ("device", "auto", dict(score_sub_blocks=2)),
    ("host", "float8_e4m3fn", dict(score_bounds_dtype="kv")), ("host", "float8_e4m3fn", {}),
    ("host", "auto", dict(recall="interruptible", micro_batches=2, score_sub_blocks=2)),
    ("host", "auto", dict(decode_attention="pallas", score_sub_blocks=2))])
def test_every_blocks_key_bounds_are_current(tiny4, placement, kv_dtype, kw):
    """Key bounds kept current as keys are written: after decoding across several blocks, the metadata rows of every
    block in every sparse layer (sinks, window, the partial newest one, those that left the window, which nothing
    recomputes) hold the bounds of exactly the keys written so far, as `block_key_bounds` takes them from the cache
    or the host pool (float8: dequantised), rounded outward to the metadata's dtype: both decode schedules, both
    placements, the jnp path and the Pallas kernel."""
    from pulseinfer_jax.pallas_kernels.block_metadata import block_key_bounds, round_bounds_outward

    cfg = EngineConfig.of(**BASE, mode="offload", budget_tokens=24, dense_layers=2, kv_dtype=kv_dtype,
                          offload_placement=placement, **kw)
    eng = Engine(tiny4, cfg)
    reqs = _run_until_last_token(eng, _prompts(tiny4.cfg.vocab_size, lengths=(45, 30)), 23)
    d = eng.sparse
    m, fine = d.scoring.sub_blocks, d.bounds.fine
    f8 = kv_dtype != "auto"
    step = dict(rtol=0.07, atol=2.0 ** -9) if fine.lo.dtype == jnp.float8_e4m3fn else dict(rtol=1e-5, atol=1e-6)
    checked = 0
    for r in reqs:
        s = r.sparse
        for sl in range(s.plan.sparse_layers):
            for j in range(s.num_blocks):
                if placement == "device":
                    block = eng.kv[s.plan.dense_layers + sl, s.table[j]]
                elif s.is_resident(j):
                    block = eng.kv[s.plan.dense_layers + sl, s.gpu_of[j]]
                else:
                    block = jnp.asarray(eng.host_pool.read(sl, s.host_rows[j]))
                n = s.block_len(j)
                lo, hi = block_key_bounds(block[None], jnp.zeros(1, jnp.int32), jnp.array([n], jnp.int32),
                                          sub_blocks=m)
                row = (sl * eng.host_pool.num_rows + s.host_rows[j]) * m
                filled = np.arange(m) * (s.plan.block_size // m) < n
                for got, want in zip((fine.lo, fine.hi), round_bounds_outward(lo, hi, fine.lo.dtype), strict=True):
                    got = np.asarray(got[row:row + m].astype(jnp.float32))[filled]
                    want = np.asarray(want.astype(jnp.float32))[filled]
                    if f8:  # (keys dequantised a token or a block at a time: float32 rounding, one bound step)
                        np.testing.assert_allclose(got, want, **step)
                    else:
                        np.testing.assert_array_equal(got, want)
                checked += 1
    assert checked >= 2 * 2 * 10 and any(s.sparse.num_blocks * 4 > s.sparse.tokens for s in reqs)


@pytest.mark.parametrize("host_io,kv_dtype", [("xla", "auto"), ("numpy", "auto"), ("xla", "float8_e4m3fn")])
def test_host_pool_holds_what_the_gpu_would(tiny4, host_io, kv_dtype):
    """After a long sparse generation, every block that left the GPU window is in the host pool, equal to what
    on-device sparse decoding (same tokens, every block kept on the GPU) holds for it (to f32 rounding: the
    host path splits attention into resident + recalled partials and merges them; float8 blocks, scale codes
    included, compare as values: a last-bit difference upstream may move a float8 rounding)."""
    prompts = _prompts(tiny4.cfg.vocab_size, lengths=(45, 30))
    kw = dict(**BASE, mode="offload", budget_tokens=24, dense_layers=2, recall="interruptible", micro_batches=2,
              kv_dtype=kv_dtype)
    host = Engine(tiny4, EngineConfig.of(**kw, host_io=host_io))
    dev = Engine(tiny4, EngineConfig.of(**kw, offload_placement="device"))
    hreqs = _run_until_last_token(host, prompts, 40)
    dreqs = _run_until_last_token(dev, prompts, 40)
    kv_dev = np.asarray(dev.kv.astype(jnp.float32) if kv_dtype == "auto" else unpack_blocks(dev.kv, jnp.float32))
    checked = 0
    for hr, dr in zip(hreqs, dreqs, strict=True):
        assert hr.output == dr.output
        s = hr.sparse
        for j in range(s.num_blocks):
            if s.is_resident(j):
                continue
            for sl in range(s.plan.sparse_layers):
                got = host.host_pool.read(sl, s.host_rows[j])
                got = np.asarray(got if kv_dtype == "auto" else unpack_blocks(jnp.asarray(got), jnp.float32))
                want = kv_dev[s.plan.dense_layers + sl, dr.sparse.table[j]]
                if kv_dtype == "auto":
                    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
                else:  # all but a few values exact, the rest one float8 step (2^-3 relative) apart
                    assert np.mean(got == want) >= 0.99
                    np.testing.assert_allclose(got, want, rtol=2.0 ** -3, atol=1e-3)
                checked += 1
    assert checked >= 2 * 2 * 10  # both requests, both sparse layers, >= 10 exited blocks each


def test_coalesced_one_copy_per_layer_and_step_fragmented_per_unit(tiny4):
    prompts = _prompts(tiny4.cfg.vocab_size)
    kw = dict(**BASE, mode="offload", budget_tokens=24, dense_layers=2)
    logs, bytes_, per_req = {}, {}, {}
    for io, mbs in [("coalesced", 1), ("coalesced", 2), ("fragmented", 1)]:
        eng = Engine(tiny4, EngineConfig.of(**kw, io=io, micro_batches=mbs, recall="interruptible"))
        res = generate_long(prompts, eng, max_new_tokens=16, ignore_eos=True, engine_config=eng.config)
        logs[io, mbs] = list(eng.sparse.step_log)
        bytes_[io, mbs] = sum(e["h2d_bytes"] for e in logs[io, mbs])
        per_req[io, mbs] = [r.stats for r in res]
    sparse_layers = 2
    for e in logs["coalesced", 1]:
        assert e["h2d_copies"] <= sparse_layers  # whole batch: at most one copy per layer per step
    assert any(e["h2d_copies"] == sparse_layers for e in logs["coalesced", 1])
    for e in logs["coalesced", 2]:
        assert e["h2d_copies"] <= sparse_layers * e["micro_batches"]
    # fragmented: one copy per selected (block, KV head) that was missing; same bytes as coalesced
    hkv = tiny4.cfg.num_kv_heads
    frag = per_req["fragmented", 1]
    assert [s["recall_transfers"] for s in frag] == [s["recalled_blocks"] * hkv for s in frag]
    assert bytes_["fragmented", 1] == bytes_["coalesced", 1] == bytes_["coalesced", 2]
    assert sum(e["h2d_copies"] for e in logs["fragmented", 1]) == sum(s["recall_transfers"] for s in frag)
    assert [s["recall_bytes"] for s in frag] == [s["recall_bytes"] for s in per_req["coalesced", 1]]


def test_eager_recall_queues_the_early_attention_on_every_layer(tiny4, monkeypatch):
    """recall="eager" dispatches the early attention on every sparse layer, before the plan is read; the default
    only on layers that recall something (the tail computes it otherwise). Same tokens, same recalls."""
    from pulseinfer_jax.runner import sparse_layer

    calls = {"attend": 0, "sparse_pre": 0}
    for name in calls:
        def counted(*a, _fn=getattr(sparse_layer, name), _name=name, **k):
            calls[_name] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(sparse_layer, name, counted)
    prompts = _prompts(tiny4.cfg.vocab_size)
    seen = {}
    for recall in ("interruptible", "eager"):
        calls.update(attend=0, sparse_pre=0)
        eng = Engine(tiny4, EngineConfig.of(**BASE, mode="offload", budget_tokens=24, dense_layers=2, micro_batches=2,
                                         recall=recall))
        res = generate_long(prompts, eng, max_new_tokens=16, ignore_eos=True, engine_config=eng.config)
        copies = sum(e["h2d_copies"] for e in eng.sparse.step_log)  # coalesced: one per layer that recalls
        seen[recall] = ([r.token_ids for r in res], [r.stats["recall_bytes"] for r in res], dict(calls), copies)
    (tok_i, bytes_i, calls_i, copies_i), (tok_e, bytes_e, calls_e, copies_e) = seen["interruptible"], seen["eager"]
    assert tok_e == tok_i and bytes_e == bytes_i and copies_e == copies_i
    assert calls_e["sparse_pre"] == calls_i["sparse_pre"] > 0
    assert calls_i["attend"] == copies_i < calls_i["sparse_pre"]  # some layers recall nothing: no separate call
    assert calls_e["attend"] == calls_e["sparse_pre"]


@pytest.mark.parametrize("recall", ["interruptible", "ahead"])
def test_repeated_selection_recalls_nothing(tiny4, recall):
    """A budget covering every block selects the same middle blocks step after step: the first step recalls
    them, later steps only what newly left the window (nothing while no block leaves); recall ahead not even
    that: the block that left the window is copied from its spare GPU block into its slot."""
    prompt = _prompts(tiny4.cfg.vocab_size, lengths=(40,))  # 10 full blocks
    eng = Engine(tiny4, EngineConfig.of(**BASE, mode="offload", budget_tokens=512, dense_layers=2, micro_batches=1,
                                        recall=recall))
    generate_long(prompt, eng, max_new_tokens=8, ignore_eos=True, engine_config=eng.config)
    log = list(eng.sparse.step_log)
    # the first decode step writes position 40 (block 10): window = blocks 9, 10, middle = blocks 1..8
    bs, middle = 4, 8
    # (recall ahead: block 8 left the window at this very step and is copied from its GPU block, not recalled)
    first = middle - 1 if recall == "ahead" else middle
    assert log[0]["h2d_bytes"] == first * 2 * eng.host_pool.layer_block_bytes
    # decode positions 40..46: a new block starts at 44 (step 4) and block 8 leaves the window then
    for i, e in enumerate(log[1:], start=1):
        expect = 2 * eng.host_pool.layer_block_bytes if (40 + i) % bs == 0 and recall != "ahead" else 0
        assert e["h2d_bytes"] == expect, (i, e)
    assert ("late_recalls" in log[1]) == (recall == "ahead")  # the first step of a request recalls in the layer


@pytest.mark.parametrize("selection,io,host_io", [("solohead", "coalesced", "xla"), ("headwise", "coalesced", "xla"),
                                                  ("solohead", "fragmented", "xla"), ("solohead", "coalesced", "numpy"),
                                                  ("headwise", "coalesced", "numpy"),
                                                  ("solohead", "coalesced", "numpy-pinned")])
def test_recall_ahead_slots_hold_their_blocks(tiny4, selection, io, host_io):
    """Recall ahead under a budget that drops blocks: the recalls land in the layer's next call (with the numpy pool
    they are gathered on the recall thread meanwhile; with the XLA pool the driver never waits), and once the
    recalls in flight have landed every slot of every sparse layer holds, bit for bit, the host row of the block its
    slot cache says it holds: recalled, or copied from the spare GPU block. No lost or stale KV."""
    prompts = _prompts(tiny4.cfg.vocab_size, lengths=(45, 30))
    kw = dict(**BASE, mode="offload", budget_tokens=24, dense_layers=2, selection=selection, io=io, host_io=host_io)
    eng = Engine(tiny4, EngineConfig.of(**kw))
    reqs = _run_until_last_token(eng, prompts, 30)
    assert eng.host_pool.recalls_off_thread == (host_io != "xla")
    log = list(eng.sparse.step_log)
    ahead = [e for e in log if "late_recalls" in e]  # all but each request's first step (it recalls in the layer)
    assert len(ahead) == len(log) - len(prompts) >= 20
    assert all(e["recall_wait_s"] == 0.0 for e in ahead) or host_io != "xla"
    assert sum(e["h2d_bytes"] for e in ahead) > 0  # recalls issued ahead, landed by the next step's calls
    kv = np.asarray(eng.sparse.land_pending(eng.kv))
    eng.kv = jnp.asarray(kv)
    assert not eng.sparse.recall_in_flight
    _, key = (np.asarray(a) for a in eng.sparse.slot_state)
    checked = 0
    for r in reqs:
        s = r.sparse
        for sl in range(s.plan.sparse_layers):
            for lane in range(s.plan.lanes):
                for i, j in enumerate(key[sl, s.slot_row, lane, : s.slot_capacity]):
                    if j < 0:
                        continue
                    want = np.asarray(eng.host_pool.read(sl, s.host_rows[j]))
                    got = kv[s.plan.dense_layers + sl, s.slot_block_arr[i]]
                    if s.plan.lanes > 1:
                        want, got = want[..., lane, :], got[..., lane, :]
                    np.testing.assert_array_equal(got, want)
                    checked += 1
    assert checked >= 2 * 2 * 3
    same = generate_long(prompts, tiny4, max_new_tokens=30, ignore_eos=True,
                         engine_config=EngineConfig.of(**kw, recall="interruptible"))
    # a request's first decode step recalls in the layer, as the same-layer mode does: its tokens up to there agree
    # (later ones may not: a miss is attended one step later; bench/accuracy.py measures what that costs)
    assert [r.output[:2] for r in reqs] == [o.token_ids[:2] for o in same]


def test_recall_ahead_lands_before_blocks_change_owner(tiny4, monkeypatch):
    """A request that finishes with recalls in flight: they land before its blocks are freed, so the request
    admitted next, into those blocks, gets the tokens it gets alone (one request at a time: each runs as alone)."""
    from pulseinfer_jax.sched.scheduler import Scheduler

    prompts = _prompts(tiny4.cfg.vocab_size, lengths=(45, 50, 41))
    cfg = EngineConfig.of(**{**BASE, "max_batch": 1}, mode="offload", budget_tokens=24, dense_layers=2)
    eng = Engine(tiny4, cfg)
    in_flight = []
    finish = Scheduler.finish

    def spy(sched, req, reason):
        in_flight.append(eng.sparse.recall_in_flight)
        finish(sched, req, reason)

    monkeypatch.setattr(Scheduler, "finish", spy)
    res = generate_long(prompts, eng, max_new_tokens=12, ignore_eos=True, engine_config=cfg)
    assert in_flight == [False] * 3  # every finish found its recalls landed
    monkeypatch.undo()
    alone = [generate_long([p], tiny4, max_new_tokens=12, ignore_eos=True, engine_config=cfg)[0] for p in prompts]
    assert [r.token_ids for r in res] == [r.token_ids for r in alone]
    assert [r.stats["admitted_at_step"] > 0 for r in res] == [False, True, True]


def test_auto_mode_places_by_memory_and_pcie_and_stays_correct(tiny4):
    """IOAA under a small GPU budget (a pool of 72 blocks): dense while the queue fits, offloading first under
    memory pressure while PCIe has room, dense again once PCIe is full; each request's tokens are those of its
    placement run alone (dense, or offloaded sparse)."""
    prompts = _prompts(tiny4.cfg.vocab_size, lengths=(100, 100, 100, 100))
    kw = dict(**BASE, budget_tokens=32, dense_layers=1, slot_cache_blocks=5)
    dense = generate_long(prompts, tiny4, max_new_tokens=12, ignore_eos=True, engine_config=EngineConfig.of(**kw))
    off = generate_long(prompts, tiny4, max_new_tokens=12, ignore_eos=True,
                        engine_config=EngineConfig.of(**kw, mode="offload"))
    # dense: 28 blocks per request; offloaded: 4 resident + 5 slots + 7 dense-layer packs = 16, and while its prompt
    # prefills layer by layer 2 more (its 5 slot blocks x 4 layers hold 20 of a layer's 25 blocks)

    def run(n, h2d):
        cfg = EngineConfig.of(**kw, mode="auto", kv_cache_tokens=72 * 4, h2d_bytes_per_s=h2d)
        eng = Engine(tiny4, cfg)
        res = generate_long(prompts[:n], eng, max_new_tokens=12, ignore_eos=True, engine_config=cfg)
        for r, d, o in zip(res, dense, off, strict=False):
            assert r.token_ids == (d.token_ids if r.stats["mode"] == "dense" else o.token_ids)
        assert eng.allocator.num_free == eng.allocator.capacity
        assert eng.host_pool.allocator.num_free == eng.host_pool.allocator.capacity
        return [r.stats["mode"] for r in res], [r.stats["admitted_at_step"] for r in res]

    # two requests (56 blocks) fit dense: nothing to gain from offloading
    assert run(2, 16e9)[0] == ["dense", "dense"]
    # four (112 blocks) do not: offloaded while the rest does not fit dense (free 72 -> 54 -> 36 -> 18 -> 0),
    # so all four run at once where greedy dense-first would run three
    modes, admitted = run(4, 16e9)
    assert modes == ["offload"] * 4 and admitted == [0, 0, 0, 0]
    # PCIe for one offloaded request only (1.5 priors per step): offload (72 -> 54), then, PCIe full, dense (-> 26);
    # the third goes dense once the first prompt's prefill has given its 2 blocks back (-> 28), the fourth waits for
    # memory (its placement then depends on the measured step time, which IOAA also uses)
    modes, admitted = run(4, _h2d_for_one_offloaded(tiny4.cfg))
    assert modes[:3] == ["offload", "dense", "dense"] and admitted[:2] == [0, 0] and 0 < admitted[2] < admitted[3]


def _h2d_for_one_offloaded(c, kv_dtype=np.float32) -> float:
    """Host-to-device bytes/s that IOAA finds room for one offloaded request of the auto-mode tests in (1.5 priors
    per step): one request's prior recall is prior_miss_fraction of (5 middle blocks x one layer-block x 3 sparse
    layers); a step hides slack x the assumed step time (IOAA defaults) seconds of copy."""
    block = layer_block_bytes(4, c.num_kv_heads, c.head_dim, kv_dtype)
    prior = IOAAConfig(h2d_bytes_per_s=1.0).prior_miss_fraction * 5 * block * 3
    return 1.5 * prior / (0.8 * 0.02)


@pytest.mark.parametrize("kv_dtype", ["auto", "float8_e4m3fn"])
def test_dense_requests_join_the_offloaded_layer_pass(tiny4, monkeypatch, kv_dtype):
    """With recall ahead, dense-placed requests decode inside the offloaded requests' layer calls (one pass over the
    weights a step: `SparseDecoder.joins_dense`, step_log's `dense_rows`) instead of a step of their own, except in
    an offloaded request's first step; each request's tokens are those of its placement run alone and its logits
    within float32 rounding of them (float8 KV too: the dense rows' tokens quantised by the same write)."""
    prompts = _prompts(tiny4.cfg.vocab_size, lengths=(100, 100, 100, 100))
    kw = dict(**BASE, budget_tokens=32, dense_layers=1, slot_cache_blocks=5, kv_dtype=kv_dtype)
    seen = record_sampled_logits(monkeypatch)

    def run(cfg, engine=None):  # -> results, {(prompt, tokens so far): logits row}
        seen.clear()
        res = generate_long(prompts, engine or tiny4, max_new_tokens=12, ignore_eos=True, engine_config=cfg)
        first = min(i for i, _ in seen)  # (requests are numbered in prompt order)
        return res, {(i - first, n): row for (i, n), row in seen.items()}

    alone = {"dense": run(EngineConfig.of(**kw)), "offload": run(EngineConfig.of(**kw, mode="offload"))}
    separate = []
    orig = Engine._decode_dense
    monkeypatch.setattr(Engine, "_decode_dense", lambda self, reqs: (separate.append(len(reqs)), orig(self, reqs))[1])
    h2d = _h2d_for_one_offloaded(tiny4.cfg, np.float32 if kv_dtype == "auto" else kv_dtype)
    cfg = EngineConfig.of(**kw, mode="auto", kv_cache_tokens=72 * 4, h2d_bytes_per_s=h2d)
    eng = Engine(tiny4, cfg)
    res, rows = run(cfg, eng)
    modes = [r.stats["mode"] for r in res]
    assert "dense" in modes and "offload" in modes
    joined = [e["dense_rows"] for e in eng.sparse.step_log if e.get("dense_rows")]
    assert joined and max(joined) >= 2, list(eng.sparse.step_log)  # both dense requests in one offloaded pass
    for i, r in enumerate(res):
        want, want_rows = alone[r.stats["mode"]]
        assert r.token_ids == want[i].token_ids, (r.stats["mode"], i)
        for (j, n), row in rows.items():
            if j == i:
                np.testing.assert_allclose(row, want_rows[i, n], atol=2e-4, rtol=2e-4)
    # the dense requests ran a step of their own only while an offloaded request was in its first step, or alone
    assert len(separate) < sum(len(r.token_ids) for r in res if r.stats["mode"] == "dense")


def test_host_pool_exhaustion_queues_then_runs(tiny4):
    """A host pool that holds one offloaded request at a time: the second waits (no lost KV), then runs."""
    prompts = _prompts(tiny4.cfg.vocab_size, lengths=(40, 40))
    need = blocks_for(40 + 8, 4)
    cfg = EngineConfig.of(**BASE, mode="offload", budget_tokens=24, dense_layers=2, host_kv_tokens=need * 4)
    res = generate_long(prompts, tiny4, max_new_tokens=8, ignore_eos=True, engine_config=cfg)
    solo = [generate_long([p], tiny4, max_new_tokens=8, ignore_eos=True, engine_config=cfg)[0] for p in prompts]
    assert [r.token_ids for r in res] == [r.token_ids for r in solo]
    assert res[0].stats["admitted_at_step"] == 0 and res[1].stats["admitted_at_step"] > 0


@pytest.mark.parametrize("kw,match", [
    (dict(budget_tokens=12), "below sink \\+ window"),
    (dict(window_tokens=6), "multiple of block_size"),
    (dict(slot_cache_blocks=1), "slot_cache_blocks"),
    (dict(selection="perhead"), "selection="),
    (dict(io="scatter"), "io="),
    (dict(solohead="retrieval_head"), "retrieval_heads"),
])
def test_bad_offload_configs(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.of(**{**BASE, "mode": "offload", "budget_tokens": 64, **kw})


def test_bad_offload_runtime_configs(tiny, tiny4):
    p = _prompts(tiny4.cfg.vocab_size, lengths=(40,))
    with pytest.raises(ValueError, match="rows of the pinned host pool .* which holds"):  # host pool too small
        generate_long(p, tiny4, max_new_tokens=8, engine_config=EngineConfig.of(
            **BASE, mode="offload", budget_tokens=24, host_kv_tokens=16))
    with pytest.raises(ValueError, match="leaves no sparse layer"):
        generate_long(p, tiny, max_new_tokens=8,
                      engine_config=EngineConfig.of(**BASE, mode="offload", budget_tokens=24))
    with pytest.raises(ValueError, match="gpu_kv_budget"):
        generate_long(p, tiny4, max_new_tokens=8, engine_config=EngineConfig.of(
            **BASE, mode="offload", budget_tokens=24, gpu_kv_budget=1000))
    assert dense_ok(tiny4, p)  # the engine is still usable after the errors


def dense_ok(m, p):
    return len(generate_long(p, m, max_new_tokens=2, block_size=4)[0].token_ids) == 2


def test_pallas_sparse_pipeline_matches_jnp(tiny4):
    """The offload pipeline with the Pallas kernels (interpret mode here) gives the jnp pipeline's tokens."""
    prompts = _prompts(tiny4.cfg.vocab_size, lengths=(37,))
    kw = dict(**BASE, mode="offload", budget_tokens=24, dense_layers=2)
    a = generate_long(prompts, tiny4, max_new_tokens=6, ignore_eos=True, engine_config=EngineConfig.of(**kw))
    b = generate_long(prompts, tiny4, max_new_tokens=6, ignore_eos=True,
                      engine_config=EngineConfig.of(**kw, decode_attention="pallas"))
    assert a[0].token_ids == b[0].token_ids
    assert b[0].stats["decode_attention"] == "pallas"


def test_the_sparse_decoder_hands_the_attention_its_counters(tiny4, monkeypatch):
    """Recall ahead's layer calls (dense and sparse layers) pass the driver's one buffer of split-merge counters to the
    Pallas attention (traced once per shape: the spy sees each trace), which merges its splits inside and leaves them
    0; the tokens are the jnp pipeline's."""
    import jax

    from pulseinfer_jax.runner import sparse_layer

    jax.clear_caches()  # (the spy below is read when the layer calls are traced)
    real, seen = sparse_layer.sparse_decode_attention, []

    def spy(q, pool, ids, lens, *rest, **kw):
        out = real(q, pool, ids, lens, *rest, **kw)
        seen.append((q.shape[0] * pool.shape[3], rest[0].shape[0] if rest else None, len(out)))
        return out

    monkeypatch.setattr(sparse_layer, "sparse_decode_attention", spy)
    prompts = _prompts(tiny4.cfg.vocab_size, lengths=(61, 38))
    kw = dict(**BASE, mode="offload", budget_tokens=24, dense_layers=2)
    eng = Engine(tiny4, EngineConfig.of(**kw, decode_attention="pallas"))
    reqs = _run_until_last_token(eng, prompts, 6)
    plain = _run_until_last_token(Engine(tiny4, EngineConfig.of(**kw)), prompts, 6)
    assert [r.output for r in reqs] == [r.output for r in plain]
    # (a request's first step runs the same-layer calls, whose attention zeroes its own counters)
    counted = [(rows, n, out) for rows, n, out in seen if n is not None]
    assert counted and all(n >= rows and out == 4 for rows, n, out in counted), seen
    counters = np.asarray(eng.sparse.arrivals)
    assert counters.dtype == np.int32 and not counters.any()
    jax.clear_caches()


def test_the_scoring_check_runs_the_engines_scoring_and_reports_failures(monkeypatch):
    import jax
    from pulseinfer_jax.pallas_kernels import block_scoring

    from pulseinfer_jax.startup_checks import check_scoring

    dev = jax.devices()[0]
    seen = []
    real = block_scoring.block_scores

    def recording(*a, **k):
        seen.append((k["beta"], k["per_head"], k["sub_blocks"]))
        return real(*a, **k)

    monkeypatch.setattr(block_scoring, "block_scores", recording)
    # interpreted here (compiled on a GPU)
    assert check_scoring(dev, "float32", BlockScoring(beta=0.25, sub_blocks=2), interpret=True) is None
    assert sorted(seen) == [(0.25, False, 2), (0.25, True, 2)]  # the engine's scoring, both score layouts

    def rejecting(*a, **k):
        raise NotImplementedError("Triton rejected the kernel")

    monkeypatch.setattr(block_scoring, "block_scores", rejecting)
    assert check_scoring(dev, "float32", BlockScoring(), interpret=True) == \
        "NotImplementedError: Triton rejected the kernel"
    monkeypatch.setattr(block_scoring, "block_scores", real)
    assert check_scoring(dev, "float32").startswith("ValueError")  # compiled for this CPU: reported, not raised


@pytest.mark.parametrize("scoring,selection,want", [
    (dict(score_beta=0.25), "solohead", (0.25, True, 1)),  # not the default beta
    (dict(score_sub_blocks=2, score_per_query_head=False), "solohead", (0.5, False, 2)),
    (dict(score_sub_blocks=2), "headwise", (0.5, False, 2)),  # headwise selects per KV head: group sums
])
def test_block_scoring_config_reaches_both_scoring_paths(tiny4, monkeypatch, scoring, selection, want):
    """EngineConfig's score_beta / score_per_query_head / score_sub_blocks are what the pipeline's block scoring
    uses (jnp reference and Pallas kernel alike: same tokens), with the metadata written per slice; stats say
    which scoring ran."""
    from pulseinfer_jax.runner import sparse_layer

    seen = []
    real = sparse_layer.append_and_score_reference

    def spy(q, meta_min, *a, **k):
        seen.append((k.get("beta"), k.get("per_head"), k.get("sub_blocks"), meta_min.shape[0] % k["sub_blocks"]))
        return real(q, meta_min, *a, **k)

    monkeypatch.setattr(sparse_layer, "append_and_score_reference", spy)
    sparse_layer.sparse_pre.clear_cache()  # retrace: the spy sees every scoring this test compiles
    prompts = _prompts(tiny4.cfg.vocab_size, lengths=(37,))
    kw = dict(**BASE, mode="offload", budget_tokens=24, dense_layers=2, selection=selection, **scoring)
    a = generate_long(prompts, tiny4, max_new_tokens=6, ignore_eos=True, engine_config=EngineConfig.of(**kw))
    assert seen and set(seen) == {(*want, 0)}
    st = a[0].stats
    assert (st["score_beta"], st["score_sub_blocks"]) == (want[0], want[2])
    b = generate_long(prompts, tiny4, max_new_tokens=6, ignore_eos=True,
                      engine_config=EngineConfig.of(**kw, decode_attention="pallas"))
    assert a[0].token_ids == b[0].token_ids


@pytest.mark.parametrize("kw,runs", [
    ({}, True), (dict(score_kept_blocks=False), False), (dict(selection="headwise"), False),
])
def test_kept_blocks_scored_only_for_solohead_softmax(tiny4, monkeypatch, kw, runs):
    """The sink / window blocks are scored (from their metadata rows, kept current as each key is written) where
    SoloHead's softmax reads scores, and only when asked: every step lists their rows among the candidates, the
    newest block's the row its new key joins; stats say so."""
    from pulseinfer_jax.runner import sparse_decoder

    seen = []
    real = sparse_decoder.micro_batch_inputs

    def spy(plan, *a):
        mb = real(plan, *a)
        sparse, lengths = a[-3], a[-1]
        for b, (s, n) in enumerate(zip(sparse, lengths, strict=True)):
            blocks = -(-n // plan.block_size)
            listed = mb.rows.candidates.rows[b, :blocks]
            kept = [j for j in range(blocks) if not s.is_middle(j)]
            seen.append(bool((listed[kept] >= 0).all()))
            assert (listed[kept] == (s.host_row_arr[kept] if runs else -1)).all()
            assert (listed[[j for j in range(blocks) if s.is_middle(j)]] >= 0).all()
            app = mb.rows.append  # the new key: its block's metadata row, GPU block and slot
            assert (app.rows[b], app.blocks[b], app.slots[b]) == (s.host_rows[blocks - 1], s.gpu_arr[blocks - 1],
                                                                   (n - 1) % plan.block_size)
        return mb

    monkeypatch.setattr(sparse_decoder, "micro_batch_inputs", spy)
    cfg = EngineConfig.of(**BASE, mode="offload", budget_tokens=24, dense_layers=2, **kw)
    out = generate_long(_prompts(tiny4.cfg.vocab_size, lengths=(37,)), tiny4, max_new_tokens=4, ignore_eos=True,
                        engine_config=cfg)
    assert seen and set(seen) == {runs}
    assert out[0].stats["score_kept_blocks"] is cfg.scoring.kept_blocks


def test_resident_bonus_keeps_what_the_slot_cache_holds(tiny4):
    """With an overwhelming bonus every sparse layer keeps re-selecting the blocks its first decode step recalled
    (the device sees the slot caches' contents): nothing is recalled after that step. Without it, later steps
    recall more; the bonus changes the tokens only through the selection."""
    prompts = _prompts(tiny4.cfg.vocab_size)
    kw = dict(**BASE, mode="offload", budget_tokens=24, dense_layers=2)
    cfg = EngineConfig.of(**kw, resident_bonus=0.0)
    middle = cfg.budget_blocks - cfg.offload.sink_blocks - cfg.window_blocks
    plain = generate_long(prompts, tiny4, max_new_tokens=16, ignore_eos=True, engine_config=cfg)
    sticky = generate_long(prompts, tiny4, max_new_tokens=16, ignore_eos=True,
                           engine_config=EngineConfig.of(**kw, resident_bonus=1e30))
    sparse_layers = tiny4.cfg.num_layers - 2
    for r in sticky:
        assert r.stats["resident_bonus"] == 1e30
        assert r.stats["recalled_blocks"] == middle * sparse_layers  # the first step's selection, then hits only
        assert r.stats["reused_blocks"] == middle * sparse_layers * (len(r.token_ids) - 2)
    assert all(r.stats["recalled_blocks"] > middle * sparse_layers for r in plain)


@pytest.mark.parametrize("m,bounds,dtype", [(1, "float8_e4m3fn", "float8_e4m3fn"),
                                            (2, "float8_e4m3fn", "float8_e4m3fn"), (1, "kv", "float32")])
def test_metadata_budgeted_as_allocated(tiny4, m, bounds, dtype):
    """The GPU budget reserves exactly the metadata the sparse decoder allocates (m rows per block with
    score_sub_blocks = m), in float8 (the default) or the KV dtype (score_bounds_dtype="kv"); the float8 rows
    bound the keys of their blocks."""
    from pulseinfer_jax.sched import pools

    eng = Engine(tiny4, EngineConfig.of(**BASE, mode="offload", budget_tokens=24, dense_layers=2, score_sub_blocks=m,
                                     score_bounds_dtype=bounds))
    (req,) = _run_until_last_token(eng, _prompts(tiny4.cfg.vocab_size, lengths=(45,)), 4)
    assert eng.sparse.bounds.fine.lo.dtype == eng.sparse.bounds.fine.hi.dtype == jnp.dtype(dtype)
    itemsize = eng.sparse.bounds.fine.lo.dtype.itemsize
    want = pools.metadata_bytes(eng.sparse.plan, eng.host_pool.num_rows, tiny4.cfg.head_dim, itemsize, m)
    assert eng.sparse.metadata_bytes == want
    assert eng.sparse.bounds.fine.lo.shape[0] == eng.sparse.plan.sparse_layers * eng.host_pool.num_rows * m
    # every middle block's rows bound its keys (read back from the host pool), slice by slice
    s, rows, bs = req.sparse, eng.host_pool.num_rows, BASE["block_size"]
    lo = np.asarray(eng.sparse.bounds.fine.lo.astype(jnp.float32))
    hi = np.asarray(eng.sparse.bounds.fine.hi.astype(jnp.float32))
    checked = 0
    for j in range(1, 45 // bs - 2):  # whole prompt blocks past the sink, before the window
        for sl in range(s.plan.sparse_layers):
            keys = eng.host_pool.read(sl, s.host_rows[j])[0].reshape(m, bs // m, *lo.shape[1:])  # [m, bs/m, Hkv, hd]
            r = (sl * rows + s.host_rows[j]) * m
            assert (lo[r:r + m] <= keys.min(1)).all() and (hi[r:r + m] >= keys.max(1)).all()
            if bounds == "kv":  # exact
                np.testing.assert_array_equal(lo[r:r + m], keys.min(1))
            checked += 1
    assert checked == (45 // bs - 3) * s.plan.sparse_layers


def test_two_level_scoring_scores_kept_groups_only(tiny4, monkeypatch):
    """score_coarse_group: host rows go out in aligned extents, every group row holds the min / max of its middle
    blocks' bounds (exactly), a step scores the groups and then only the kept groups' blocks (the fine scoring call
    gets keep * group candidates, not every block), the GPU budget counts the group rows, and the Pallas kernels
    select the same tokens as the jnp reference."""
    from pulseinfer_jax.runner import sparse_layer
    from pulseinfer_jax.sched import pools

    widths = []
    real = sparse_layer.block_scores_reference

    def spy(q, meta_min, meta_max, cand, *rest, **k):
        widths.append((meta_min.shape[0], cand.shape[1]))
        return real(q, meta_min, meta_max, cand, *rest, **k)

    monkeypatch.setattr(sparse_layer, "block_scores_reference", spy)
    sparse_layer.sparse_pre.clear_cache()
    f, prompts = 2, _prompts(tiny4.cfg.vocab_size, lengths=(61, 45))
    kw = dict(**BASE, mode="offload", budget_tokens=24, dense_layers=2, score_coarse_group=f, score_coarse_keep=1.0)
    eng = Engine(tiny4, EngineConfig.of(**kw))
    reqs = _run_until_last_token(eng, prompts, 8)
    dec = eng.sparse
    rows, sl_n = eng.host_pool.num_rows, dec.plan.sparse_layers
    assert rows % f == 0 and dec.bounds.coarse.lo.shape[0] == sl_n * rows // f
    want = pools.metadata_bytes(dec.plan, rows, tiny4.cfg.head_dim, dec.bounds.fine.lo.dtype.itemsize, 1, f)
    assert dec.metadata_bytes == want == 2 * (dec.bounds.fine.lo.nbytes + dec.bounds.coarse.lo.nbytes)
    lo, hi = (np.asarray(a.astype(jnp.float32)) for a in (dec.bounds.fine.lo, dec.bounds.fine.hi))
    clo, chi = (np.asarray(a.astype(jnp.float32)) for a in (dec.bounds.coarse.lo, dec.bounds.coarse.hi))
    checked = 0
    for r in reqs:
        s = r.sparse
        assert all(s.host_rows[j] // f == s.host_rows[j - j % f] // f for j in range(len(s.host_rows)))
        for g in range(-(-s.num_blocks // f)):
            members = [j for j in range(g * f, min(g * f + f, s.num_blocks)) if s.is_middle(j)]
            if not members:
                continue
            for sl in range(sl_n):
                fine = [sl * rows + s.host_rows[j] for j in members]
                c = sl * rows // f + s.host_rows[g * f] // f
                np.testing.assert_array_equal(clo[c], lo[fine].min(0))
                np.testing.assert_array_equal(chi[c], hi[fine].max(0))
                checked += 1
    assert checked >= 2 * sl_n * 6
    # group scoring reads the coarse rows, block scoring keep * f candidates: fewer than the blocks it skips
    keep = EngineConfig.of(**kw).scoring.coarse_groups(6, 1, 2, 16)
    assert keep == 2
    coarse_calls = [w for w in widths if w[0] == dec.bounds.coarse.lo.shape[0]]
    fine_calls = [w for w in widths if w[0] == dec.bounds.fine.lo.shape[0]]
    assert coarse_calls and {w[1] for w in fine_calls} == {keep * f}
    host = [r.output for r in reqs]
    pallas = _run_until_last_token(Engine(tiny4, EngineConfig.of(**kw, decode_attention="pallas")), prompts, 8)
    assert [r.output for r in pallas] == host
    plain = _run_until_last_token(Engine(tiny4, EngineConfig.of(**{**kw, "score_coarse_group": 1})), prompts, 8)
    assert [r.output for r in plain] != host, "the first level dropped nothing the plain scorer would select"


@pytest.mark.parametrize("kw,match", [
    (dict(score_coarse_group=3), "score_coarse_group"), (dict(score_coarse_group=0), "score_coarse_group"),
    (dict(score_coarse_group=True), "score_coarse_group"), (dict(score_coarse_keep=0.5), "score_coarse_keep"),
    (dict(score_coarse_keep=float("inf")), "score_coarse_keep"),
    (dict(score_beta=1.5), "score_beta"), (dict(score_beta=-0.5), "score_beta"), (dict(score_beta=True), "score_beta"),
    (dict(score_beta="0.5"), "score_beta"), (dict(score_sub_blocks=3), "power of two"),
    (dict(score_sub_blocks=0), "power of two"), (dict(score_sub_blocks=32), "must divide block_size=16"),
    (dict(score_per_query_head=1), "must be a bool"), (dict(score_kept_blocks=0), "must be a bool"),
    (dict(resident_bonus=-0.1), "resident_bonus"), (dict(resident_bonus=float("inf")), "resident_bonus"),
    (dict(resident_bonus=True), "resident_bonus"), (dict(score_bounds_dtype="int8"), "score_bounds_dtype"),
    (dict(score_bounds_dtype="bfloat16"), "score_bounds_dtype"),
])
def test_bad_block_scoring_configs(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.of(**kw)


def test_retrieval_head_calibration_and_decode(tiny4):
    """Calibration picks a valid KV head per sparse layer, refuses a prompt the budget covers (every head
    would tie), and solohead="retrieval_head" decodes with the heads (offloaded == on device)."""
    from pulseinfer_jax.calibration import calibrate_retrieval_heads

    prompt = _prompts(tiny4.cfg.vocab_size, lengths=(90,))[0]
    kw = dict(**BASE, mode="offload", budget_tokens=24, dense_layers=2)
    heads = calibrate_retrieval_heads(tiny4, prompt, EngineConfig.of(**kw))
    assert len(heads) == 2 and all(0 <= h < tiny4.cfg.num_kv_heads for h in heads)
    with pytest.raises(ValueError, match="fits in the 512-token budget"):
        calibrate_retrieval_heads(tiny4, prompt, EngineConfig.of(**{**kw, "budget_tokens": 512}))
    with pytest.raises(ValueError, match="too short"):
        calibrate_retrieval_heads(tiny4, prompt[:5], EngineConfig.of(**kw))
    cfg = dict(kw, solohead="retrieval_head", retrieval_heads=heads)
    a = generate_long([prompt[:60]], tiny4, max_new_tokens=12, ignore_eos=True,  # (the same-layer recall, as device)
                      engine_config=EngineConfig.of(**cfg, recall="interruptible"))
    b = generate_long([prompt[:60]], tiny4, max_new_tokens=12, ignore_eos=True,
                      engine_config=EngineConfig.of(**cfg, offload_placement="device"))
    assert a[0].token_ids == b[0].token_ids and a[0].stats["recall_bytes"] > 0


def test_auto_host_io_falls_back_to_numpy_when_the_probe_fails(tiny4, monkeypatch, emulated_gpu):
    """On a GPU, host_io="auto" checks the pinned-host transfers once, when the engine is built (with a same-layer
    recall the xla pool's, with recall ahead the numpy-pinned staging's); if they fail there, the engine warns, keeps
    the host pool in numpy and decodes the same tokens (emulated GPU, check failing)."""
    from pulseinfer_jax.host_offload import host_pool

    prompts = _prompts(tiny4.cfg.vocab_size, lengths=(45, 30))
    kw = dict(**BASE, mode="offload", budget_tokens=24, dense_layers=2, h2d_bytes_per_s=16e9, recall="interruptible")
    kw["decode_attention"] = "jnp"  # (not under test: no kernel check)
    want = generate_long(prompts, tiny4, max_new_tokens=12, ignore_eos=True,
                         engine_config=EngineConfig.of(**kw, host_io="numpy"))
    calls = []

    def failing_probe(device, **kw):
        calls.append(kw)
        return "RuntimeError: no host compute here"

    real_probe = host_pool.probe_host_io
    monkeypatch.setattr(host_pool, "probe_host_io", failing_probe)
    with pytest.warns(RuntimeWarning, match=r"host_io numpy: .* \(RuntimeError: no host compute here\)"):
        eng = Engine(tiny4, EngineConfig.of(**kw))
    got = generate_long(prompts, eng, max_new_tokens=12, ignore_eos=True)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert eng.host_io == "numpy" and eng.host_pool.io_name == "numpy"
    assert eng.layer_loop == "layerwise" and eng.sparse.layer_params is eng.layer_params  # one split, shared
    assert all(r.stats["host_io"] == "numpy" and r.stats["recall_bytes"] > 0 for r in got)
    assert len(calls) == 1 and calls[0]["dtype"] == jnp.dtype(tiny4.dtype)  # probed once, in the KV dtype
    generate_long(prompts, eng, max_new_tokens=4, ignore_eos=True)
    assert len(calls) == 1  # not again for the next run of the same engine
    # configured explicitly: checked too, and its failure is an error naming it
    from pulseinfer_jax.backends import FastPathError

    with pytest.raises(FastPathError, match="host_io='xla' failed its start-up check on gpu"):
        Engine(tiny4, EngineConfig.of(**kw, host_io="xla"))
    assert len(calls) == 2
    with pytest.warns(RuntimeWarning, match=r"host_io numpy: numpy-pinned's pinned-host transfers failed"):
        ahead = Engine(tiny4, EngineConfig.of(**{**kw, "recall": "ahead"}))
    want = generate_long(prompts, ahead, max_new_tokens=12, ignore_eos=True, engine_config=ahead.config)
    assert len(calls) == 3 and ahead.host_pool.io_name == "numpy" and ahead.host_pool.recalls_off_thread
    # the real check, on the real device (the emulated GPU is a name only), passes: the staging is pinned
    monkeypatch.setattr(host_pool, "probe_host_io", lambda device, **kw: real_probe(jax.devices()[0], **kw))
    ahead = Engine(tiny4, EngineConfig.of(**{**kw, "recall": "ahead"}))
    got = generate_long(prompts, ahead, max_new_tokens=12, ignore_eos=True, engine_config=ahead.config)
    assert ahead.host_pool.io_name == "numpy-pinned" and ahead.host_pool.recalls_off_thread
    assert [r.token_ids for r in got] == [r.token_ids for r in want]


def test_auto_kernels_fall_back_on_a_gpu_that_rejects_them(tiny4, monkeypatch, emulated_gpu):
    """Under decode_attention="auto" on a GPU the Pallas kernels are checked once, when the engine is built (emulated
    GPU, check scripted). A GPU that rejects only float8 key bounds keeps Pallas with the bounds in the KV dtype (and
    budgets their bytes); one that rejects the kernels either way falls back to the jnp attention, float8 bounds kept.
    Each warns; the tokens are those of the same configuration run directly."""
    from pulseinfer_jax import backends

    prompts = _prompts(tiny4.cfg.vocab_size, lengths=(37,))
    kw = dict(**BASE, mode="offload", budget_tokens=24, dense_layers=2, host_io="xla")
    for rejects, attention, bounds, match in [("float8_e4m3fn", "pallas", "kv", "score_bounds_dtype kv: the Pallas"),
                                              ("all", "jnp", "float8_e4m3fn", "decode_attention jnp: the Pallas")]:
        calls = []

        def probe(device, dtype=None, scoring=BlockScoring(), kv_dtype=None, rejects=rejects, calls=calls):
            calls.append(scoring.bounds_dtype)
            return "NotImplementedError: no" if rejects in ("all", scoring.bounds_dtype) else None

        monkeypatch.setattr(backends, "probe_pallas", probe)
        with pytest.warns(RuntimeWarning, match=match):
            eng = Engine(tiny4, EngineConfig.of(**kw))
        got = generate_long(prompts, eng, max_new_tokens=5, ignore_eos=True)
        assert calls == ["float8_e4m3fn", "kv"]  # probed once (and the exact bounds once more), not per run
        assert eng.sparse_attention == attention and eng.scoring.bounds_dtype == bounds
        assert eng.sparse.bounds.fine.lo.dtype == eng.scoring.metadata_dtype(tiny4.dtype)
        assert got[0].stats["score_bounds_dtype"] == bounds and got[0].stats["decode_attention"] == attention
        generate_long(prompts, eng, max_new_tokens=2, ignore_eos=True)
        assert len(calls) == 2
        # (the same choices made explicitly: Pallas is checked again, since an explicit choice is checked too)
        want = generate_long(prompts, tiny4, max_new_tokens=5, ignore_eos=True, engine_config=EngineConfig.of(
            **kw, decode_attention=attention, score_bounds_dtype=bounds))
        assert got[0].token_ids == want[0].token_ids


def test_the_jnp_step_program_never_copies_the_cache(tiny4, monkeypatch):
    """Recall ahead's one-program step on the jnp path updates the donated cache in place: no compiled program (one
    request or two, float32 and float8 bounds), nor the landing before it, copies the whole cache. XLA:CPU did, twice
    a layer, where the appended key's read fused into each of its readers and where a landing fused into the token
    write (the CPU offloaded decode step took 1.6x its time)."""
    import jax

    from pulseinfer_jax.runner import sparse_step

    calls = {}

    def spying(name, key_of, cache_at):
        real = getattr(sparse_step, name)

        def spy(*args, **kw):
            key = (name, *key_of(args))
            if key not in calls:  # shapes only: the call donates its buffers
                shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args[1:])
                calls[key] = (real, args[0], shapes, kw, args[cache_at].shape)
            return real(*args, **kw)
        monkeypatch.setattr(sparse_step, name, spy)

    spying("ahead_step", lambda a: (a[7].shape[0],), 3)  # (model, head, layers, kv, ..., tokens)
    spying("land_step", lambda a: (a[1].staging.shape[0],), 0)
    prompts = _prompts(tiny4.cfg.vocab_size, lengths=(61, 38))
    for bounds in ("kv", "float8_e4m3fn"):
        kw = dict(**BASE, mode="offload", budget_tokens=24, dense_layers=2)
        _run_until_last_token(Engine(tiny4, EngineConfig.of(**kw, score_bounds_dtype=bounds)), prompts, 8)
    assert {k[1] for k in calls if k[0] == "ahead_step"} == {1, 2} and any(k[0] == "land_step" for k in calls), \
        sorted(calls, key=str)
    for key, (real, first, shapes, kw, shape) in calls.items():
        hlo = real.lower(first, *shapes, **kw).compile().as_text()
        cache = "f32[" + ",".join(map(str, shape)) + "]"
        copies = [line for line in hlo.splitlines() if f"= {cache}" in line and " copy(" in line]
        assert not copies, (key, copies)
