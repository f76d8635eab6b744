"""The evaluation's own machinery on CPU: synthetic KV fill, selection traces (record / replay / block mapping)
and one throughput-bench point; these decide what the GPU numbers mean, so they are tested like the engine."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.synthetic import SyntheticKVEngine, fill_random_kv
from bench.traces import BlockMap, RecordingSelector, ReplaySelector, load_trace
from pulseinfer_jax import Engine, EngineConfig, SamplingParams
from pulseinfer_jax.kv.blocks import blocks_for

BASE = dict(block_size=4, max_batch=4, prefill_chunk=32, key_chunk=32, window_tokens=8, sink_blocks=1,
            budget_tokens=32, dense_layers=2, mode="offload", progress=False)


def _prompts(vocab, lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def _record(model, prompts, steps, cls=Engine, replay=None, **kw):
    """Decode `prompts` for `steps` tokens recording every selection (replaying trace `replay` if given)."""
    recorder = RecordingSelector()
    selector = recorder if replay is None else ReplaySelector(replay, record=recorder)
    eng = cls(model, EngineConfig.of(**{**BASE, **kw}), selector=selector)
    reqs = [eng.make_request(i, p, SamplingParams(max_new_tokens=steps + 1, ignore_eos=True))
            for i, p in enumerate(prompts)]
    list(eng.run(reqs))
    return recorder.trace(list(range(len(prompts))), steps, {"model": "tiny4"})


def test_block_map_stretches_keeps_identity_and_is_injective():
    same = BlockMap(sink=1, mid_t0=10, mid_r0=10)
    assert same(np.arange(1, 30)).tolist() == list(range(1, 30))
    m = BlockMap(sink=1, mid_t0=10, mid_r0=35)
    got = m(np.arange(1, 15))
    assert got[0] == 1 and got[9] == 1 + 9 * 35 // 10  # the prompt's middle stretched over the longer one
    assert got[10:].tolist() == [36, 37, 38, 39]  # blocks that joined later map one to one after it
    assert len(set(got.tolist())) == len(got) and (np.diff(got) > 0).all()
    with pytest.raises(ValueError, match="at least the trace's 10 middle blocks"):
        BlockMap(sink=1, mid_t0=10, mid_r0=9)


@pytest.mark.parametrize("selection", ["solohead", "headwise"])
def test_trace_records_and_replays_exactly(tiny4, tmp_path, selection):
    """Replaying a trace on prompts of the same lengths (other tokens, so other own selections) attends and
    recalls exactly the recorded blocks: the replayed run's own record equals the trace, hits and misses too."""
    v = tiny4.cfg.vocab_size
    tr = _record(tiny4, _prompts(v, (70, 53)), 10, selection=selection)
    lanes = 1 if selection == "solohead" else tiny4.cfg.num_kv_heads
    assert tr.sel.shape == (2, 10, 2, lanes, 8 - 1 - 2)  # [R, T, sparse layers, lanes, middle blocks]
    assert (tr.sel >= 0).any() and tr.misses.sum() > 0 and tr.hits.sum() > 0
    path = tr.save(tmp_path / "t.npz")
    tr2 = load_trace(path)
    assert tr2.meta["selection"] == selection and (tr2.sel == tr.sel).all()
    other = _record(tiny4, _prompts(v, (70, 53), seed=5), 10, selection=selection)
    assert not (other.sel == tr.sel).all()  # the other prompts select otherwise on their own
    replayed = _record(tiny4, _prompts(v, (70, 53), seed=5), 10, selection=selection,
                       replay=tr2)
    assert (replayed.sel == tr.sel).all()
    assert (replayed.hits == tr.hits).all() and (replayed.misses == tr.misses).all()


def test_replay_maps_onto_longer_contexts(tiny4):
    v = tiny4.cfg.vocab_size
    tr = _record(tiny4, _prompts(v, (60,)), 6)
    replayed = _record(tiny4, _prompts(v, (150,), seed=3), 6, replay=tr)
    sink, win = 1, 2
    m = BlockMap(sink, int(tr.num_blocks[0, 0]) - sink - win, int(replayed.num_blocks[0, 0]) - sink - win)
    for t in range(6):
        for sl in range(2):
            src = tr.sel[0, t, sl, 0]
            assert replayed.sel[0, t, sl, 0][replayed.sel[0, t, sl, 0] >= 0].tolist() == sorted(
                m(src[src >= 0]).tolist())


def test_replay_refuses_a_trace_of_another_budget(tiny4):
    tr = _record(tiny4, _prompts(tiny4.cfg.vocab_size, (60,)), 3)
    eng = Engine(tiny4, EngineConfig.of(**{**BASE, "budget_tokens": 48}), selector=ReplaySelector(tr))
    req = eng.make_request(0, [5] * 60, SamplingParams(max_new_tokens=3))
    with pytest.raises(ValueError, match="record the trace at the same budget_tokens"):
        list(eng.run([req]))


def test_fill_random_kv_writes_only_the_table():
    kv = jnp.full((3, 9, 2, 4, 2, 8), jnp.nan, jnp.float32)
    table = jnp.array([5, 2, 7, 0], jnp.int32)  # padded with the null block
    out = np.asarray(fill_random_kv(kv, table, jax.random.key(1)))
    written = out[:, [5, 2, 7]]
    assert np.isfinite(written).all() and abs(written.mean()) < 0.2 and 0.8 < written.std() < 1.2
    assert not (out[0, 5] == out[1, 5]).all()  # every layer its own values
    untouched = [b for b in range(1, 9) if b not in (5, 2, 7)]
    assert np.isnan(out[:, untouched]).all()


def test_synthetic_prefill_offloads_the_same_kv_dense_would_hold(tiny4):
    """A synthetic prompt spilled to the host holds what the same synthetic fill puts in a dense request's
    blocks (same key, same block order): the bench's offloaded and dense systems decode the same KV."""
    prompt = [7] * 61  # 16 blocks of 4: the fill's padded table has 16 entries in both engines
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)  # still running after the first step
    dense = SyntheticKVEngine(tiny4, EngineConfig.of(**{**BASE, "mode": "dense"}))
    off = SyntheticKVEngine(tiny4, EngineConfig.of(**BASE))
    rd, ro = dense.make_request(0, prompt, sp), off.make_request(0, prompt, sp)
    for eng, r in ((dense, rd), (off, ro)):
        eng.ensure_pool([r])
        eng.scheduler.add(r)
        list(eng.step())  # admit + the whole synthetic prefill in one step
        assert r.prefilled == len(prompt)
    kv = np.asarray(dense.kv)
    host = off.host_pool.contents()  # [Ls, rows, 2, bs, Hkv, hd]
    for j in range(blocks_for(len(prompt), 4) - 1):  # full blocks
        np.testing.assert_array_equal(host[:, ro.sparse.host_rows[j]], kv[2:, rd.blocks[j]])


def test_throughput_point_dense_queues_pulseinfer_offloads(tiny4):
    """One bench point under a GPU budget that holds two dense requests: dense decodes two of three, PulseInfer
    (IOAA under memory pressure) all three; the row says so, with I/O counted."""
    from bench.decode_throughput import CompileCounter, run_point

    base = {k: v for k, v in BASE.items() if k != "mode"}
    base.update(dense_layers=1, slot_cache_blocks=5, kv_cache_tokens=72 * 4)
    counter = CompileCounter()
    rows = {s: run_point(tiny4, s, 100, 3, steps=3, warm=2, base=base, replay=None, compiles=counter)
            for s in ("dense", "pulseinfer", "pulseinfer-numpy-io")}
    assert rows["dense"]["batch_reached"] == 2 and rows["dense"]["placements"] == {"dense": 2, "offload": 0}
    assert rows["pulseinfer"]["batch_reached"] == 3 and rows["pulseinfer"]["placements"]["offload"] >= 2
    assert rows["pulseinfer"]["h2d_bytes_per_step"] > 0 and rows["dense"]["h2d_bytes_per_step"] == 0
    # the pageable-RAM backend: same placements, same recalls counted the same way
    numpy_io, xla_io = rows["pulseinfer-numpy-io"], rows["pulseinfer"]
    assert (numpy_io["host_io"], xla_io["host_io"]) == ("numpy", "xla")
    for key in ("placements", "h2d_bytes_per_step", "h2d_copies_per_step", "slot_hit_rate"):
        assert numpy_io[key] == xla_io[key], key
    for r in rows.values():
        assert len(r["step_s_all"]) == 3 and r["decode_tokens_per_s"] > 0 and r["tpot_s_p99"] >= r["tpot_s_p50"]



def test_mooncake_mix_draws_trace_pairs_scaled_and_capped():
    from bench.workload import load_mooncake, mooncake_mix

    inp, out, source = load_mooncake()
    assert inp.size == out.size == 1000 and "Mooncake" in source
    assert np.median(inp) == 6397.5 and (out >= 1).all()  # the stored sample's statistics (bench/data)
    pairs = set(zip(inp.tolist(), out.tolist(), strict=True))
    mix, desc = mooncake_mix(200, scale=1.0, max_prompt=10**9, max_output=10**9, min_output=1, seed=3)
    assert all(p in pairs for p in mix)  # drawn as pairs: the joint distribution is the trace's
    assert mix == mooncake_mix(200, scale=1.0, max_prompt=10**9, max_output=10**9, min_output=1, seed=3)[0]
    scaled, desc = mooncake_mix(200, scale=4.0, max_prompt=131072, max_output=256, seed=3)
    assert [min(p * 4, 131072) for p, _ in mix] == [p for p, _ in scaled]
    assert [min(max(o, 2), 256) for _, o in mix] == [o for _, o in scaled]
    assert "x 4.0 capped at 131072" in desc
    with pytest.raises(ValueError, match="bad mix parameters"):
        mooncake_mix(0)


def test_selection_trace_statistics():
    from bench.selection_trace import analyse
    from bench.traces import Trace

    # 1 request, 3 steps, 2 sparse layers, 2 lanes (heads), up to 3 middle blocks each
    sel = np.full((1, 3, 2, 2, 3), -1, np.int16)
    sel[0, :, :, 0, :2] = [1, 2]  # head 0: {1, 2} every step, both layers
    sel[0, 0, :, 1, :2] = [2, 3]  # head 1: {2, 3}, then {4, 5}, then {4, 5}
    sel[0, 1:, :, 1, :2] = [4, 5]
    misses = np.array([[[8, 8], [2, 0], [0, 0]]], np.int32)  # [R, T, Ls]: cold step, then 2, then 0
    hits = np.array([[[0, 0], [2, 4], [4, 4]]], np.int32)
    out = analyse(Trace(sel, np.full((1, 3), 20, np.int32), hits, misses, {}), unit_bytes=100)
    assert out["cold_step_recall_blocks"] == 16  # the first step is reported apart
    assert out["hit_rate"] == 14 / 16 and out["recall_blocks_per_step_mean"] == 1.0
    assert out["recall_bytes_per_step_mean"] == 100.0 and out["recall_one_layer_step_max"] == 2
    assert out["recall_per_layer_mean"] == [1.0, 0.0] and out["hit_rate_per_layer"] == [6 / 8, 8 / 8]
    # lane 0 never changes (1.0); lane 1: {2,3} -> {4,5} (0.0) then unchanged (1.0): mean over 8 = 0.75
    assert out["selection_jaccard_step_to_step"] == 0.75
    # heads: {1,2} vs {2,3} -> 1/3 at step 0, {1,2} vs {4,5} -> 0 after; union 3/2 then 4/2
    assert out["head_pairwise_jaccard"] == pytest.approx((2 * (1 / 3)) / 6)
    assert out["head_union_over_one_set"] == pytest.approx((2 * 1.5 + 4 * 2.0) / 6)


def test_selection_quality_oracle_bounds_the_engine_selection():
    """Attention recall: true block masses sum to 1 per head, and the oracle (top blocks by true mass) keeps at
    least what the engine's Quest selection keeps, per position (SoloHead: summed over heads; headwise: per KV
    group), with sinks and window always kept."""
    from bench.selection_quality import oracle_select, quest_select, recall
    from pulseinfer_jax.selection.policy import block_attention_mass

    rng = np.random.default_rng(0)
    t, hkv, g, hd, bs = 200, 2, 3, 16, 8
    keys = rng.standard_normal((t, hkv, hd)) * 1.5
    q = rng.standard_normal((6, hkv * g, hd)) * 1.5
    pos = np.arange(t - 6, t)
    n_blocks = pos // bs + 1
    mass = np.asarray(block_attention_mass(q, keys, bs, q_positions=pos, average=False), np.float64)
    assert mass.shape == (6, hkv * g, -(-t // bs))
    np.testing.assert_allclose(mass.sum(-1), 1.0, rtol=1e-5)
    budget, sink, window = 8, 1, 2
    solo_q = quest_select(q.astype(np.float32), keys.astype(np.float32), pos, budget, sink, window, bs, "solohead")
    head_q = quest_select(q.astype(np.float32), keys.astype(np.float32), pos, budget, sink, window, bs, "headwise")
    solo_o = oracle_select(mass.sum(1, keepdims=True), n_blocks, budget, sink, window)
    head_o = oracle_select(mass.reshape(6, hkv, g, -1).sum(2), n_blocks, budget, sink, window)
    for keep in (solo_q, head_q, solo_o, head_o):
        assert (keep.sum(-1) == budget).all() and keep[..., 0].all()  # budget filled, the sink always in
        for i, n in enumerate(n_blocks):
            assert keep[i, :, n - window:n].all() and not keep[i, :, n:].any()  # window in, nothing past it
    assert (recall(mass, solo_o, g).sum(1) >= recall(mass, solo_q, g).sum(1) - 1e-9).all()
    grp = lambda r: r.reshape(6, hkv, g).sum(-1)  # noqa: E731
    assert (grp(recall(mass, head_o, g)) >= grp(recall(mass, head_q, g)) - 1e-9).all()
    assert (recall(mass, solo_o, g) < 1).any()  # a budget below the context drops some mass


def test_throughput_plot_from_a_result(tmp_path):
    pytest.importorskip("matplotlib")
    import json

    from bench import plots

    def point(system, batch, reached, tps):
        return {"system": system, "context": 32768, "batch_requested": batch, "batch_reached": reached,
                "decode_tokens_per_s": tps, "step_s_all": [0.02, 0.021, 0.025]}

    points = [point("dense", 1, 1, 50.0), point("dense", 8, 3, 120.0), point("pulseinfer", 1, 1, 50.0),
              point("pulseinfer", 8, 8, 300.0), {"system": "offload-headwise", "context": 32768,
                                                 "batch_requested": 8, "error": "OOM"}]
    data = {"kind": "decode_throughput", "date": "2026-11-30", "machine": {"device": "Test GPU"}, "points": points}
    series = plots.throughput_series(points)
    assert series == {32768: {"dense": [(1, 50.0), (3, 120.0)], "pulseinfer": [(1, 50.0), (8, 300.0)]}}
    src = tmp_path / "decode_throughput_test.json"
    src.write_text(json.dumps(data))
    assert plots.main([str(src), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "decode_throughput_test.png").read_bytes()[:4] == b"\x89PNG"
    src.write_text(json.dumps({**data, "points": points[-1:]}))
    with pytest.raises(SystemExit, match="no measured point"):
        plots.main([str(src), "--out", str(tmp_path)])


def test_accuracy_and_prediction_plots_from_the_committed_results(tmp_path):
    """bench/plots.py draws RESULTS.md's two figures from the committed JSONs: accuracy against the budget (dense,
    SoloHead, headwise; passkeys and teacher-forced top-1) and the predicted tokens/s per system at A to D."""
    pytest.importorskip("matplotlib")
    import json
    import pathlib

    from bench import plots

    results = pathlib.Path(__file__).resolve().parents[1] / "bench" / "results"
    grid, f8, predict = (results / f"{n}.json" for n in ("accuracy_cpu_grid", "accuracy_cpu_f8", "h200_predict"))
    series, dense, asked = plots.accuracy_series([("grid", json.loads(grid.read_text()))])
    assert dense == (14, 100.0) and asked == 15
    assert [b for b, *_ in series["SoloHead (normalized_sum)"]] == [256, 512, 1024, 2048]
    assert series["headwise (per KV head)"][0][1:] == (12, 86.328125)
    assert plots.main([str(grid), str(f8), "--combine", "acc", "--labels", "a", "b", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "acc.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit, match="labels"):
        plots.main([str(grid), str(f8), "--combine", "acc", "--labels", "a", "--out", str(tmp_path)])
    points = plots.predicted_points(json.loads(predict.read_text()))
    assert set(points) == {"A", "B", "C", "D"}
    assert {"dense", "offload-headwise", "pulseinfer", "pulseinfer-same-layer"} <= {p["system"] for p in points["C"]}
    assert plots.main([str(predict), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "h200_predict.png").read_bytes()[:4] == b"\x89PNG"


def test_result_tables_compute_ratios_shares_and_reasons(tmp_path):
    """bench/tables.py: decode-throughput ratios to dense and to pulseinfer, skipped systems with their reason,
    the attention rows' share of the copy bandwidth and speed against paged_attention, io_sweep by volume."""
    import json

    from bench import tables

    def point(system, tps, **kw):
        return {"system": system, "context": 32768, "batch_requested": 8, "batch_reached": 8,
                "placements": {"dense": 0, "offload": 8}, "decode_tokens_per_s": tps, "tpot_s_p50": 0.02,
                "tpot_s_p99": 0.03, "h2d_bytes_per_step": 5e6, "h2d_copies_per_step": 60, "slot_hit_rate": 0.9,
                "recall_wait_s_per_step": 0.0005, "gpu_kv_bytes_allocated": 2**31, "host_io": "xla", **kw}

    tp = {"kind": "decode_throughput", "model": "random:llama-3.1-8b", "dtype": "bfloat16", "points": [
        point("dense", 100.0, batch_reached=3), point("pulseinfer", 250.0), point("pulseinfer-1mb", 200.0),
        {"system": "offload-headwise", "context": 32768, "batch_requested": 8, "skipped": "host KV pool too big"}]}
    text = "\n".join(tables.decode_throughput(tp))
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "| 2.50x | 1.00x |" in rows["pulseinfer"] and "| 2.00x | 0.80x |" in rows["pulseinfer-1mb"]
    assert "| 5.0 | 60 | 0.50 | 0.900 | 2.00 | xla |" in rows["pulseinfer"]
    assert "skipped: host KV pool too big" in rows["offload-headwise"]
    kern = {"copy": {"gb_per_s": 4000.0, "impl": "x+1"}, "attention": {"grid": [{"batch": 16, "impls": [
        {"impl": "pallas sparse soloHead", "median_ms": 0.5, "gb_per_s": 2800.0},
        {"impl": "jax paged_attention", "median_ms": 1.0, "gb_per_s": 1400.0},
        {"impl": "jnp reference soloHead", "error": "boom"}]}]}, "scoring": {"error": "RuntimeError: no"}}
    text = "\n".join(tables.kernels(kern))
    assert "| batch 16 | pallas sparse soloHead | 0.500 | 2800.0 | 70% | 2.00x |" in text
    assert "failed: boom" in text and "scoring: RuntimeError: no" in text and "gather: not run" in text
    io = {"modes": ["per_block_head", "coalesced"], "rows": [
        {"mode": "per_block_head", "transfer_bytes": 8192, "copies": 8, "total_bytes": 65536, "gb_per_s": 1.5},
        {"mode": "coalesced", "transfer_bytes": 65536, "copies": 1, "total_bytes": 65536, "gb_per_s": 20.0}]}
    assert "| 64 KB | 1.50 (8 x 8 KB) | 20.00 (1 x 64 KB) |" in "\n".join(tables.io_sweep(io))
    dense = {"grid": [{"attention": "pallas", "layer_loop": "scan", "context": 4096, "batch": 8,
                       "step_s_median": 0.0125, "tokens_per_s": 640.0, "kv_gb_per_s": 1234.5},
                      {"attention": "jnp", "layer_loop": "layerwise", "context": 4096, "batch": 1, "error": "OOM"}]}
    text = "\n".join(tables.dense_decode(dense))
    assert "| 4096 | 8 | pallas | scan | 12.50 | 640.0 | 1234.5 |" in text and "failed: OOM" in text
    src = tmp_path / "decode_throughput_a.json"
    src.write_text(json.dumps({k: v for k, v in tp.items() if k != "kind"}))  # kind from the file name
    (tmp_path / "other.json").write_text("{}")
    assert tables.main([str(src), str(tmp_path / "other.json"), "--out", str(tmp_path / "t.md")]) == 0
    md = (tmp_path / "t.md").read_text()
    assert "**32768 tokens x 8 requests**" in md and "other.json: not tabulated" in md


def test_throughput_mix_runs_every_request_to_completion(tiny4):
    from bench.decode_throughput import CompileCounter, run_mix

    base = {k: v for k, v in BASE.items() if k != "mode"}
    base.update(dense_layers=1, slot_cache_blocks=5, kv_cache_tokens=72 * 4)
    lengths = [(100, 20), (100, 12), (90, 9)]  # 30 + 28 + 25 dense blocks > 72: IOAA must offload some
    cache: dict = {}
    row = run_mix(tiny4, "pulseinfer", lengths, base, None, cache, CompileCounter())
    assert row["requests"] == 3 and row["tokens"] == 20 + 12 + 9
    assert sum(row["placements"].values()) == 3 and row["placements"]["offload"] >= 1
    assert row["tpot_s_p99"] >= row["tpot_s_p50"] > 0 and row["compiles_in_run"] >= 0
    assert cache["host_pool"].allocator.num_free == cache["host_pool"].allocator.capacity  # kept, all rows back


def test_slot_cache_sweep_reproduces_the_engine_at_its_own_size(tiny4):
    """Replaying a recorded selection through the LRU at the engine's default size (2x the middle blocks) gives
    exactly the hits and misses the engine counted; a smaller cache never hits more."""
    from bench.slot_cache_sweep import replay_lru, trace_bonus

    # (the same-layer recall: recall ahead counts a miss filled from the spare GPU block as reused)
    tr = _record(tiny4, _prompts(tiny4.cfg.vocab_size, (70, 75)), 12, recall="interruptible")
    at2 = replay_lru(tr, 2.0)
    hits, misses = int(tr.hits[:, 1:].sum()), int(tr.misses[:, 1:].sum())
    assert hits > 0 and misses > 0
    assert at2["hit_rate"] == hits / (hits + misses) and at2["recalled_per_step"] == misses / 11
    assert replay_lru(tr, 1.0)["hit_rate"] <= at2["hit_rate"] <= replay_lru(tr, 4.0)["hit_rate"]
    tr.meta.pop("scoring", None)
    assert trace_bonus(tr) == 0.0  # traces from before the bonus
    tr.meta["scoring"] = {"resident_bonus": 0.25}
    assert trace_bonus(tr) == 0.25


def test_host_overhead_breakdown_times_the_wrapped_calls_and_restores_them():
    from pulseinfer_jax.host_offload.host_pool import HostKVPool

    from bench.host_overhead import Breakdown

    pool = HostKVPool(num_rows=4, first_layer=1, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                      dtype=jnp.float32, device=jax.devices()[0], io="numpy")
    gather, stage = HostKVPool.gather_blocks, HostKVPool.stage_blocks
    with Breakdown() as split:
        assert HostKVPool.gather_blocks is not gather
        got = pool.gather_blocks(0, [2, 1, 3])
    assert (HostKVPool.gather_blocks, HostKVPool.stage_blocks) == (gather, stage)  # restored
    assert got.shape == (4, 2, 4, 2, 8)  # padded to a power of two, the result passed through
    rows = {r["call"]: r for r in split.rows(steps=2)}
    assert set(rows) == {"HostKVPool.gather_blocks", "HostKVPool.stage_blocks"}
    assert rows["HostKVPool.gather_blocks"]["calls_per_step"] == 0.5
    assert rows["HostKVPool.gather_blocks"]["cpu_ms_per_step"] >= rows["HostKVPool.stage_blocks"]["cpu_ms_per_step"]


def test_host_overhead_isolated_waits_for_each_call_and_recall_and_restores_them():
    """bench/host_overhead.py --isolated: inside the block the layer calls are wrapped and every recall returns its
    staging already gathered and copied (the driver's CPU alone is measured), the result passed through; all restored
    after."""
    import threading

    from pulseinfer_jax.host_offload.host_pool import HostKVPool
    from pulseinfer_jax.host_offload.recall_thread import RecallThread

    from bench.host_overhead import Isolated
    from pulseinfer_jax.runner import sparse_layer

    pool = HostKVPool(num_rows=4, first_layer=1, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                      dtype=jnp.float32, device=jax.devices()[0], io="numpy-pinned")
    from pulseinfer_jax.runner import sparse_step

    saved = (sparse_layer.ahead_layer, sparse_layer.logits, HostKVPool._submit, sparse_step.ahead_step)
    seen = []
    with Isolated():
        assert sparse_layer.ahead_layer is not saved[0] and HostKVPool._submit is not saved[2]
        assert sparse_step.ahead_step is not saved[3]
        gate = threading.Event()
        pool._thread = RecallThread()
        pool._thread.submit(lambda: gate.wait(5))  # (a job the thread is held on: the recall waits behind it)
        threading.Timer(0.2, gate.set).start()
        recall = pool.recall_blocks(0, [2, 1])
        seen.append(recall.gathered())  # already gathered and copied when recall_blocks returned
        staging, waited = recall.result()
    assert seen == [True] and waited == 0.0 and staging.shape == (2, 2, 4, 2, 8) and staging.is_ready()
    assert (sparse_layer.ahead_layer, sparse_layer.logits, HostKVPool._submit, sparse_step.ahead_step) == saved


def test_moe_ffn_bench_times_every_strategy(tmp_path, monkeypatch):
    import json
    import sys

    from bench import moe_ffn

    monkeypatch.setattr(sys, "argv", ["moe_ffn.py", "--model", "tiny-qwen3-moe", "--dtype", "float32",
                                      "--tokens", "1,4", "--repeats", "1", "--out", str(tmp_path)])
    assert moe_ffn.main() == 0
    r = json.loads((tmp_path / "moe_ffn_cpu.json").read_text())
    assert [row["tokens"] for row in r["rows"]] == [1, 4] and r["experts"] == 8 and r["top_k"] == 2
    for row in r["rows"]:
        assert row["dense_ms"] > 0 and row["gather_ms"] > 0 and row["grouped_ms"] > 0
        assert "grouped-pallas_ms" not in row  # the GPU kernel only on a GPU (interpret mode would time nothing)
        assert row["faster"] in ("dense", "gather", "grouped")
        expert = 3 * 64 * 32 * 4  # gate, up, down of one expert: hidden 64, width 32, float32
        assert row["dense_weight_bytes"] == 8 * expert and row["gather_weight_bytes"] == row["tokens"] * 2 * expert
        tiles = 1 + min(8, row["tokens"] * 2)  # 16-row tiles: one full-size bound + one partial per picked expert
        assert row["grouped_tile_m"] == 16 and row["grouped_weight_bytes"] == tiles * expert
        assert row["auto"] == "grouped"  # on CPU at every token count
    monkeypatch.setattr(sys, "argv", ["moe_ffn.py", "--model", "tiny-llama"])
    with pytest.raises(SystemExit):
        moe_ffn.main()


def test_capacity_accounting_counts_what_the_pools_hold(tiny4):
    """bench/capacity.py's admission count: dense holds budget // blocks per request; offloaded, each request takes its
    steady footprint (plus its prefill blocks while it prefills) and host rows, so more of them run; a pinned host
    pool of one request's rows holds one."""
    from bench.capacity import admit
    from pulseinfer_jax.request import Request
    from pulseinfer_jax.sched.pools import offload_blocks, sparse_plan

    c = tiny4.cfg
    per_block = c.num_layers * 2 * c.num_kv_heads * 4 * c.head_dim * 2  # bf16 in the accounting
    cfg = EngineConfig.of(**{**BASE, "mode": "dense", "max_batch": 64})
    need = blocks_for(100 + 128, 4)
    budget = (3 * need + 1) * per_block + per_block // 2
    assert admit(c, cfg, [100] * 5, budget, 1 << 40, 1e13).admitted == 3
    # float8 KV: 5 rows of 1-byte elements per block instead of 4 of 2 bytes: the same budget holds 8 / 5 x the blocks
    f8_block = per_block * 5 // 8
    f8 = admit(c, cfg.with_settings(kv_dtype="float8_e4m3fn"), [100] * 8, budget, 1 << 40, 1e13)
    assert f8.admitted == (budget // f8_block - 1) // need == 4
    # every layer sparse; 8 slot blocks x 4 layers hold a layer of the prompt (no extra prefill blocks)
    off = cfg.with_settings(mode="offload", slot_cache_blocks=8, dense_layers=0)
    plan = sparse_plan(off, c.num_layers, c.num_kv_heads)
    steady = plan.gpu_blocks(100 + 128)
    assert offload_blocks(plan, Request(0, [0] * 100, SamplingParams(), 128)) == steady
    many = admit(c, off, [100] * 5, budget, 1 << 40, 1e13)
    assert many.admitted == 5 and 5 * steady <= 3 * need + 1
    assert admit(c, off, [100] * 5, budget, need * per_block, 1e13).admitted == 1  # a host row: every layer


def test_accuracy_resume_keeps_only_a_matching_unfinished_prefix(tmp_path):
    """bench/accuracy.py --resume: an unfinished run's rows are kept when they are the first runs of the same
    arguments and engine settings (and say where they came from); a finished run, other settings or other runs are
    refused rather than mixed in."""
    import json

    from bench.accuracy import _resumable_rows

    runs = [("auto", "dense", None), ("auto", "normalized_sum", 512), ("float8_e4m3fn", "dense", None)]
    base = {"block_size": 16}
    path = tmp_path / "acc.json"
    assert _resumable_rows(path, runs, base) == ([], None)  # nothing to resume
    rows = [{"kv_dtype": kv, "variant": v, "budget_tokens": b} for kv, v, b in runs[:2]]
    path.write_text(json.dumps({"git": "abc", "date": "d", "engine": base, "rows": rows, "complete": False}))
    kept, prior = _resumable_rows(path, runs, base)
    assert kept == rows and prior == {"rows": 2, "git": "abc", "date": "d"}
    for bad in ({"engine": {"block_size": 32}}, {"complete": True},
                {"rows": [rows[1], rows[0]]}):
        path.write_text(json.dumps({"git": "abc", "engine": base, "rows": rows, "complete": False, **bad}))
        with pytest.raises(SystemExit, match="--resume"):
            _resumable_rows(path, runs, base)


def test_predicted_micro_batches_recall_one_after_the_other():
    """bench/predict.py: two micro-batches' recalls share one host gather and one link, so a layer takes at least
    pre + sync + 2 x recall + land; the GPU work of both and one micro-batch's chain are the other bounds."""
    from types import SimpleNamespace as NS

    from bench import predict

    def call(fn: str, count: int):
        return NS(program=NS(key=fn, function=fn, group="sparse"), count=count)

    layers, k, misses, unit = 2, 2, 4, 100_000
    rows = {fn: {"cost": {"bytes": 0.0, "launches": 10}} for fn in ("sparse_pre", "attend", "land_attend_finish")}
    rows["logits"] = {"cost": {"bytes": 0.0, "launches": 1}}
    calls = [call(fn, layers * k) for fn in ("sparse_pre", "attend", "land_attend_finish")] + [call("logits", 1)]
    st = predict.SystemStep("pulseinfer", "A", ["offload"] * 2, [], {4: calls}, [float(misses)] * layers, k,
                            NS(ablation=NS(recall="interruptible")), {"host_io": "xla"}, unit, 0)
    model = predict.Model(bandwidth=1e12, t_launch=1e-6, t_sync=0.0, h2d=1e9, t_copy=0.0, gather_rate=1e9,
                          numpy_gather_rate=1e9, copy_rate=1e9)
    out = predict.predict_step(st, rows, model)
    recall = 2 * misses * unit / 1e9  # gather, then copy: 800 us
    pre = early = land = 10e-6  # 10 launches of 1 us per micro-batch
    assert out["step_s"] == pytest.approx(layers * (pre + k * recall + land) + 1e-6)
    assert out["gpu_held_by_gather_s"] == pytest.approx(layers * k * recall / 2)  # (the XLA gathers hold the GPU)
    assert out["step_s"] > layers * (pre + max(recall, early) + land)  # more than one micro-batch's chain
    st1 = dataclasses.replace(st, micro_batches=1, misses=[2.0 * misses] * layers, sparse={8: calls})
    one = predict.predict_step(st1, rows, model)  # one micro-batch moving the same bytes: one recall of twice the size
    assert one["step_s"] == pytest.approx(layers * (2 * pre + 2 * recall + 2 * land) + 1e-6)


@pytest.mark.parametrize("host_io", ["numpy", "numpy-pinned", "xla"])
def test_predicted_recall_ahead_is_bounded_by_the_gpu_or_the_link(host_io):
    """bench/predict.py, recall="ahead": one call per sparse layer and no sync; the step's recalls run one after the
    other beside the GPU's work, so the step is the larger of the two, and reports which. The numpy gather (on the
    recall thread, then PJRT's bounce copy; "numpy-pinned": into pinned staging, no bounce) never holds the GPU; the
    XLA host gather holds it for its duration."""
    from types import SimpleNamespace as NS

    from bench import predict

    def call(fn: str, count: int):
        return NS(program=NS(key=fn, function=fn, group="sparse"), count=count)

    layers, unit = 4, 10_000
    rows = {"ahead_layer": {"cost": {"bytes": 0.0, "launches": 50}}, "logits": {"cost": {"bytes": 0.0, "launches": 1}}}
    calls = [call("ahead_layer", layers), call("logits", 1)]
    model = predict.Model(bandwidth=1e12, t_launch=1e-6, t_sync=1.0, h2d=1e9, t_copy=0.0, gather_rate=1e9,
                          numpy_gather_rate=2e9, copy_rate=2e9, staging_gather_rate=1e9)
    for misses, bound in ((1.0, False), (10.0, True)):
        st = predict.SystemStep("pulseinfer", "A", ["offload"] * 2, [], {1 if misses == 1 else 16: calls},
                                [misses] * layers, 1, NS(ablation=NS(recall="ahead")), {"host_io": host_io}, unit, 0)
        out = predict.predict_step(st, rows, model)
        nbytes = layers * misses * unit
        gpu, recall = layers * 50e-6 + 1e-6, 2 * nbytes / 1e9  # (t_sync never counts; gather [+ bounce] + copy)
        held = nbytes / 1e9 if host_io == "xla" else 0.0
        assert out["gpu_held_by_gather_s"] == pytest.approx(held)
        assert out["step_s"] == pytest.approx(max(gpu + held, recall))
        assert out["recall_bound"] is (bound if host_io != "xla" else recall > gpu + held)
        assert out["plan_syncs"] == 0 and out["step_launches"] == layers * 50 + 1


def test_predicted_host_time_is_the_points_row_or_interpolates_the_measured_batches(tmp_path):
    """bench/predict.py's host time per step: the measured main-thread time of the step's recall schedule at the
    point itself where `host_overhead.py --points` measured it (at that batch), else linear between the measured
    batches, clamped outside them; None where that schedule was not measured."""
    import json

    from bench import predict

    key = "main_thread_cpu_ms_per_step_p50"
    rows = [{"batch": 1, key: 20.0}, {"batch": 9, key: 60.0},
            {"batch": 5, key: 9.0, "driver_cpu_ms_per_step_p50": 7.0, "point": "C"}]  # (the replay's 2 ms left out)
    (tmp_path / "a.json").write_text(json.dumps({"rows": rows}))
    files = {"ahead": tmp_path / "a.json", "same-layer": tmp_path / "missing.json"}
    assert predict.host_seconds("ahead", 5, "C", files) == pytest.approx(0.007)
    assert predict.host_seconds("ahead", 3, "A", files) == pytest.approx(0.0135)  # between batch 1 and C's 5
    assert predict.host_seconds("ahead", 24, None, files) == pytest.approx(0.060)
    assert predict.host_seconds("interruptible", 5, "C", files) is None


@pytest.mark.parametrize("point", ["A", "B", "C", "D"])
def test_ioaa_places_the_suite_points_no_slower_than_all_offloaded(point):
    """At the GPU suite's points admission places PulseInfer's requests as pulseinfer-no-ioaa does (all offloaded):
    no dense request beside offloaded ones, whose separate step would read the weights twice, so the predicted step
    (the same programs) is never slower than running every admitted request offloaded."""
    from pulseinfer_jax.models.config import ModelConfig
    from pulseinfer_jax.models.presets import PRESETS

    from bench import predict

    model_cfg = ModelConfig.from_hf_dict(PRESETS["llama-3.1-8b"], name="llama-3.1-8b")
    spec = predict.POINTS[point]
    placed = {}
    for system in ("pulseinfer", "pulseinfer-no-ioaa"):
        cfg, _, new = predict._engine_config(system, point)
        prompts = [spec["prompt"]] * spec["batch"]
        placed[system], _ = predict.admission(cfg, model_cfg, prompts, new, predict.DEFAULT_H2D)
    assert "dense" not in placed["pulseinfer-no-ioaa"] and "offload" in placed["pulseinfer-no-ioaa"]
    assert placed["pulseinfer"] == placed["pulseinfer-no-ioaa"]  # (at C the GPU runs 17 of 24 offloaded: 7 wait)
