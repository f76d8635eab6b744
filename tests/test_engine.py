"""Engine behaviour: continuous batching, determinism, stop strings, streaming, long chunked prefill."""

import numpy as np
import pytest
from conftest import TINY
from pulseinfer_jax.models.loading import load_model

from pulseinfer_jax import Engine, EngineConfig, generate_long, stream_long


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY / "smollm2")  # has a tokenizer and a chat template


def _prompts(n, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(k)).tolist() for k in rng.integers(1, 60, n)]


def test_continuous_batching_equals_one_by_one(tiny):
    prompts = _prompts(7, tiny.cfg.vocab_size)
    alone = [generate_long([p], tiny, max_new_tokens=12, ignore_eos=True, block_size=8)[0].token_ids
             for p in prompts]
    # 2 requests at a time and a pool that holds only ~3 requests: the rest queue and join as others finish
    eng = Engine(tiny, EngineConfig.of(block_size=8, max_batch=2, prefill_chunk=16, key_chunk=16, kv_cache_tokens=240))
    res = generate_long(prompts, eng, max_new_tokens=12, ignore_eos=True, engine_config=eng.config)
    assert [r.token_ids for r in res] == alone
    assert eng.allocator.num_free == eng.allocator.capacity  # every block came back
    eng.allocator.check_integrity()
    admitted = [r.stats["admitted_at_step"] for r in res]
    assert admitted[:2] == [0, 0] and min(admitted[2:]) > 0  # the rest queued, then joined
    assert admitted == sorted(admitted)  # FIFO


def test_sampling_seeded_and_batch_independent(tiny):
    prompts = _prompts(3, tiny.cfg.vocab_size, seed=1)
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.9, ignore_eos=True)
    a = generate_long(prompts, tiny, seed=5, **kw)
    b = generate_long(prompts, tiny, seed=5, **kw)
    c = generate_long(prompts, tiny, seed=6, **kw)
    solo = generate_long(prompts[1:2], tiny, seed=5, **kw)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]
    # request 1 alone has a different index (0), so compare the batched run with a solo run at index 1
    solo1 = generate_long([[1], prompts[1]], tiny, seed=5, **kw)[1]
    assert solo1.token_ids == a[1].token_ids
    assert solo[0].stats["generated_tokens"] == 16


def test_stop_string_and_streaming(tiny):
    base = generate_long(["hello world"], tiny, max_new_tokens=20, ignore_eos=True)[0]
    assert base.text, "tiny model produced no text"
    stop = base.text[len(base.text) // 2: len(base.text) // 2 + 2]
    events = list(stream_long(["hello world"], tiny, max_new_tokens=20, ignore_eos=True, stop=[stop]))
    final = events[-1].result
    assert final.finish_reason == "stop"
    assert stop not in final.text and base.text.startswith(final.text)
    assert "".join(e.text for e in events) == final.text
    assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)


def test_eos_stops_and_chat_template(tiny):
    eos = tiny.tokenizer.eos_token_ids
    assert eos
    res = generate_long(["hi"], tiny, chat=True, max_new_tokens=64)[0]
    if res.finish_reason == "stop":
        assert res.token_ids[-1] in eos
    else:
        assert len(res.token_ids) == 64 and not set(res.token_ids) & set(eos)


def test_stats_fields(tiny):
    r = generate_long([[5, 6, 7]], tiny, max_new_tokens=4, ignore_eos=True)[0]
    for key in ("prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "ttft_s", "tpot_s"):
        assert key in r.stats
    assert r.stats["prompt_tokens"] == 3 and r.stats["generated_tokens"] == 4 and len(r.token_ids) == 4
    assert r.stats["ttft_s"] > 0 and r.stats["tpot_s"] >= 0
    assert r.stats["layer_loop"] == "scan" and r.stats["decode_attention"] == "jnp"  # the CPU defaults


def test_positions_cap_generation():
    m = load_model(TINY / "llama2")  # max_position_embeddings 512
    r = generate_long([[3 + i % 300 for i in range(500)]], m, max_new_tokens=50, ignore_eos=True)[0]
    assert len(r.token_ids) == 12 and r.finish_reason == "length"


def test_32k_prompt_chunked_prefill_is_consistent():
    """A 32K-token prompt prefills in bounded memory; two chunkings give the same continuation."""
    m = load_model("random:tiny-llama")
    prompt = np.random.default_rng(0).integers(0, m.cfg.vocab_size, 32768).tolist()
    a = generate_long([prompt], m, max_new_tokens=3, ignore_eos=True, prefill_chunk=1024, progress=False)[0]
    cfg = EngineConfig.of(prefill_chunk=4096, key_chunk=1024, progress=False)
    b = generate_long([prompt], m, max_new_tokens=3, ignore_eos=True, engine_config=cfg)[0]
    assert a.token_ids == b.token_ids
    assert a.stats["prompt_tokens"] == 32768


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.25), ("float16", 0.05)])
def test_half_precision_close_to_float32(dtype, tol):
    """bf16/f16 weights + KV run end to end and stay close to the f32 logits (relative to their spread)."""
    import jax.numpy as jnp
    from pulseinfer_jax.models.loading import load_model as load

    from pulseinfer_jax.kv.cache import CacheSpec
    from pulseinfer_jax.runner.dense import decode_step, prefill_step

    outs = {}
    for dt in ("float32", dtype):
        m = load(TINY / "qwen3", dtype=dt)
        c = m.cfg
        kv = CacheSpec(c.num_layers, 8, c.num_kv_heads, 16, c.head_dim, jnp.dtype(m.dtype)).allocate()
        table = jnp.asarray([3, 1, 5, 0], jnp.int32)
        toks = jnp.asarray(np.arange(3, 35) % c.vocab_size, jnp.int32)
        kv, _ = prefill_step(m.transformer, m.params, kv, toks, jnp.int32(0), jnp.int32(32), table, key_chunk=32)
        kv, lg = decode_step(m.transformer, m.params, kv, jnp.asarray([7], jnp.int32), jnp.asarray([32], jnp.int32),
                             table[None])
        assert kv.dtype == jnp.dtype(m.dtype) and lg.dtype == jnp.float32
        outs[dt] = np.asarray(lg[0])
    ref, got = outs["float32"], outs[dtype]
    assert np.isfinite(got).all()
    assert np.abs(got - ref).max() <= tol * ref.std()
    res = generate_long([[5, 6, 7]], TINY / "qwen3", dtype=dtype, max_new_tokens=4, ignore_eos=True)[0]
    assert len(res.token_ids) == 4


def test_pallas_decode_attention_backend_matches_jnp(tiny):
    """The engine's dense decode through the Pallas sparse kernel (interpret mode here) = the jnp path."""
    prompts = _prompts(3, tiny.cfg.vocab_size, seed=3)
    kw = dict(max_new_tokens=5, ignore_eos=True)
    ref = generate_long(prompts, tiny, **kw, engine_config=EngineConfig.of(block_size=8, prefill_chunk=16))
    got = generate_long(prompts, tiny, **kw,
                        engine_config=EngineConfig.of(block_size=8, prefill_chunk=16, decode_attention="pallas"))
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]


def _prefilled_cache(model, tables: list[list[int]], lengths: list[int], seed: int):
    """A 12-block, block-size-8 f32 cache with random prompts of `lengths` prefilled into `tables` (one row per
    sequence), plus the decode-step args (tokens, positions = lengths, tables)."""
    import jax.numpy as jnp

    from pulseinfer_jax.kv.cache import CacheSpec
    from pulseinfer_jax.runner.dense import prefill_step

    c = model.cfg
    kv = CacheSpec(c.num_layers, 12, c.num_kv_heads, 8, c.head_dim, jnp.float32).allocate()
    tables = jnp.asarray(tables, jnp.int32)
    rng = np.random.default_rng(seed)
    for row, n in enumerate(lengths):
        toks = jnp.asarray(rng.integers(3, c.vocab_size, 32), jnp.int32)
        kv, _ = prefill_step(model.transformer, model.params, kv, toks, jnp.int32(0), jnp.int32(n), tables[row],
                             key_chunk=32)
    return kv, (jnp.asarray([5, 6], jnp.int32), jnp.asarray(lengths, jnp.int32), tables)


def test_pallas_decode_step_logits_match_jnp(tiny):
    import jax.numpy as jnp

    from pulseinfer_jax.runner.dense import decode_step

    kv, args = _prefilled_cache(tiny, [[4, 9, 2, 0], [7, 1, 0, 0]], [21, 9], seed=0)  # shuffled, 0-padded
    kv2 = jnp.array(kv)
    _, ref = decode_step(tiny.transformer, tiny.params, kv, *args, attention="jnp")
    _, got = decode_step(tiny.transformer, tiny.params, kv2, *args, attention="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-4, rtol=0)


@pytest.mark.parametrize("attention", ["jnp", "pallas"])
def test_layerwise_decode_step_equals_scan(tiny, attention):
    """decode_step_layerwise (one call per layer, per-layer weights) computes decode_step's logits and cache
    writes; shuffled tables, a row exactly at a block boundary."""
    import jax.numpy as jnp
    from pulseinfer_jax.models.transformer import split_layers

    from pulseinfer_jax.runner.dense import decode_step, decode_step_layerwise

    c = tiny.cfg
    kv, args = _prefilled_cache(tiny, [[4, 9, 2, 0], [7, 1, 3, 0]], [21, 16], seed=1)  # shuffled, 0-padded
    kv2 = jnp.array(kv)
    kv_ref, ref = decode_step(tiny.transformer, tiny.params, kv, *args, attention=attention)
    ids = [jnp.int32(i) for i in range(c.num_layers)]
    kv_got, got = decode_step_layerwise(tiny.transformer, tiny.params, split_layers(tiny.params), ids,
                                        kv2, *args, attention=attention)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=1e-5)
    kv_got, kv_ref = np.asarray(kv_got), np.asarray(kv_ref)
    np.testing.assert_allclose(kv_got, kv_ref, atol=1e-5, rtol=1e-5)
    written = np.zeros(kv_ref.shape, bool)
    written[:, 2, :, 5] = written[:, 3, :, 0] = True  # position 21 -> block 2 slot 5; 16 -> block 3 slot 0
    assert (kv_got[written] != 0).all()
    np.testing.assert_array_equal(kv_got[~written], kv_ref[~written])  # nothing else touched
    assert kv2.is_deleted()  # the cache was donated, as in the scan step


def test_per_layer_params_layout_is_the_same_model(tiny):
    """Transformer functions accept params with the layers as a list (unstack_layers): same logits as stacked, and
    stacked_layers / split_layers convert both ways."""
    import jax
    import jax.numpy as jnp
    from pulseinfer_jax.models.transformer import split_layers, stacked_layers, unstack_layers

    per_layer = unstack_layers(tiny.params)
    assert isinstance(per_layer["layers"], list) and unstack_layers(per_layer) is per_layer
    assert split_layers(per_layer) is per_layer["layers"]
    toks = jnp.asarray(_prompts(1, tiny.cfg.vocab_size, seed=2)[0][:20])[None]
    np.testing.assert_allclose(np.asarray(tiny.transformer.forward(per_layer, toks)),
                               np.asarray(tiny.transformer.forward(tiny.params, toks)), rtol=1e-4, atol=1e-4)
    for a, b in zip(jax.tree.leaves(stacked_layers(per_layer)), jax.tree.leaves(tiny.params["layers"]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("spec", [str(TINY / "qwen2"), "random:smollm2-135m", "random:tiny-qwen3-moe",
                                  str(TINY / "qwen3_moe")])  # qwen2: q/k/v biases
def test_load_model_per_layer_layout(spec):
    """load_model(layout="layers") gives the stacked load's weights, one pytree per layer (no stacked array)."""
    import jax
    from pulseinfer_jax.models.transformer import stacked_layers

    a, b = load_model(spec), load_model(spec, layout="layers")
    assert isinstance(b.params["layers"], list) and len(b.params["layers"]) == a.cfg.num_layers
    assert b.layer_params is b.params["layers"]
    want = jax.tree.leaves(a.params)
    got = jax.tree.leaves({**b.params, "layers": stacked_layers(b.params)})
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="layout='rows' must be 'stacked' or 'layers'"):
        load_model(spec, layout="rows")


def test_api_loads_weights_as_the_engine_reads_them():
    from pulseinfer_jax.api import GenerateOptions, _engine_for

    eng = _engine_for(str(TINY / "llama31"), GenerateOptions(), EngineConfig.of(layer_loop="layerwise"))
    assert isinstance(eng.model.params["layers"], list)
    eng = _engine_for(str(TINY / "llama31"), GenerateOptions(), EngineConfig())  # scan off-GPU
    assert not isinstance(eng.model.params["layers"], list)


def test_engine_layer_loop_layerwise_same_tokens_as_scan(tiny):
    """Layer-wise prefill and decode give the scan engine's tokens, and keep the layer weights once: the model is
    converted to the per-layer layout in place (the stacked arrays dropped), which scan steps still run."""
    import dataclasses

    import jax

    prompts = _prompts(3, tiny.cfg.vocab_size, seed=5)
    prompts[0] = prompts[0] * 3  # several prefill chunks (16 tokens each)
    kw = dict(max_new_tokens=6, ignore_eos=True)
    scan = Engine(tiny, EngineConfig.of(block_size=8, prefill_chunk=16))
    assert scan.layer_loop == "scan"  # auto off-GPU
    ref = generate_long(prompts, scan, **kw, engine_config=scan.config)
    model = dataclasses.replace(tiny)  # a second LoadedModel over the same arrays: converting it leaves `tiny` be
    stacked = model.params["layers"]
    eng = Engine(model, EngineConfig.of(block_size=8, prefill_chunk=16, layer_loop="layerwise"))
    layers = model.params["layers"]
    assert isinstance(layers, list) and len(layers) == tiny.cfg.num_layers and eng.layer_params is layers
    kept = {id(a) for a in jax.tree.leaves(model.params)}
    assert not kept & {id(a) for a in jax.tree.leaves(stacked)}  # the model no longer holds a stacked array
    got = generate_long(prompts, eng, **kw, engine_config=eng.config)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert eng.layer_loop == "layerwise"
    assert Engine(model, eng.config).layer_params is eng.layer_params is model.layer_params  # one copy per model
    assert not isinstance(tiny.params["layers"], list)
    assert model.stacked_params is not model.params and tiny.stacked_params is tiny.params
    scan2 = Engine(model, EngineConfig.of(block_size=8, prefill_chunk=16))  # a scan engine re-stacks a copy
    assert [r.token_ids for r in generate_long(prompts, scan2, **kw, engine_config=scan2.config)] == \
        [r.token_ids for r in ref]
    with pytest.raises(ValueError, match="layer_loop='unrolled'; use one of auto, scan, layerwise"):
        EngineConfig.of(layer_loop="unrolled")


def test_backend_rule_per_platform():
    from pulseinfer_jax.backends import plan_backends

    gpu, cpu = plan_backends(EngineConfig(), "gpu"), plan_backends(EngineConfig(), "cpu")
    assert (gpu.decode_attention, gpu.layer_loop, gpu.weights_layout) == ("pallas", "layerwise", "layers")
    assert (cpu.decode_attention, cpu.layer_loop, cpu.weights_layout) == ("jnp", "scan", "stacked")
    assert gpu.sparse_attention is None and gpu.host_io is None  # dense mode: no offload backends
    off = plan_backends(EngineConfig.of(mode="offload"), "cuda")
    # recall ahead (the default) never waits: one micro-batch, one weight pass, the numpy pool gathered on the recall
    # thread into pinned staging (an XLA host gather would wait for the GPU's queued work); a same-layer recall: two,
    # the pinned pool
    assert (off.platform, off.sparse_attention, off.host_io, off.micro_batches) == ("gpu", "pallas", "numpy-pinned", 1)
    assert any(r.startswith("host_io auto: pageable pool gathered on the recall thread into pinned staging")
               for r in off.reasons)
    same = plan_backends(EngineConfig.of(mode="offload", recall="interruptible"), "gpu")
    assert (same.micro_batches, same.host_io) == (2, "xla")
    assert plan_backends(EngineConfig.of(mode="offload"), "cpu").host_io == "xla"  # (memory kinds emulated)
    assert plan_backends(EngineConfig.of(mode="offload", recall="interruptible"), "cpu").micro_batches == 1
    with pytest.raises(ValueError, match="recall='ahead' never waits"):
        EngineConfig.of(mode="offload", micro_batches=2)
    pinned = plan_backends(EngineConfig.of(decode_attention="jnp", layer_loop="scan", micro_batches=3,
                                           recall="sync", mode="auto"), "gpu")
    assert (pinned.decode_attention, pinned.layer_loop, pinned.micro_batches) == ("jnp", "scan", 3)
    assert "decode_attention as configured" in pinned.reasons
    assert plan_backends(EngineConfig.of(decode_attention="pallas"), "cpu").decode_attention == "pallas"
    with pytest.raises(ValueError, match="decode_attention"):
        EngineConfig.of(decode_attention="triton")


def test_gpu_backends_fall_back_when_their_check_fails(tiny, monkeypatch, caplog):
    """On a GPU each fast path is checked once when the engine is built; an "auto" one that fails is replaced by the
    safe path, said in the reasons, in `fallbacks` (the stats) and as a warning; the choices and what the checks
    cost are logged in one line; an explicit choice that fails raises, naming the option."""
    import logging
    import types

    from pulseinfer_jax.host_offload import host_pool

    import pulseinfer_jax.backends as backends

    gpu = types.SimpleNamespace(platform="gpu")
    calls = []
    monkeypatch.setattr(backends, "probe_pallas", lambda *a, **k: calls.append("pallas") or "TritonError: rejected")
    monkeypatch.setattr(host_pool, "probe_host_io", lambda *a, **k: calls.append("io") or "no pinned memory")
    monkeypatch.setattr("pulseinfer_jax.startup_checks.check_landing", lambda *a: calls.append("land"))
    with caplog.at_level(logging.INFO, logger="pulseinfer_jax"), pytest.warns(RuntimeWarning) as warned:
        r = backends.resolve_backends(EngineConfig.of(mode="offload", recall="interruptible"), gpu, tiny)
    assert (r.decode_attention, r.sparse_attention, r.host_io) == ("jnp", "jnp", "numpy")
    assert r.scoring.bounds_dtype == "kv" or r.sparse_attention == "jnp"
    assert any("the Pallas kernels failed their check" in m for m in r.reasons)
    assert any("host_io numpy" in m for m in r.reasons)
    assert r.as_dict()["fallbacks"] == {"decode_attention": "TritonError: rejected", "host_io": "no pinned memory"}
    assert calls == ["pallas", "pallas", "land", "io"] and r.check_seconds is not None
    assert len(warned) == 2 and "safe path runs instead" in str(warned[0].message)
    assert len(caplog.records) == 1 and "backends on gpu" in caplog.records[0].message
    assert "decode_attention=jnp" in caplog.records[0].message and "host_io numpy" in caplog.records[0].message
    assert "start-up checks pallas kernels" in caplog.records[0].message and "s in all" in caplog.records[0].message
    # chosen explicitly: checked too, and a failure is an error that names the option
    for explicit, match in ((dict(decode_attention="pallas"), "decode_attention='pallas' failed its start-up check"),
                            (dict(decode_attention="jnp", host_io="xla"), "host_io='xla' failed its start-up check")):
        calls.clear()
        with pytest.raises(backends.FastPathError, match=match):
            backends.resolve_backends(EngineConfig.of(mode="offload", **explicit), gpu, tiny)
        assert calls[0] == ("pallas" if "decode_attention" in match else "land")
    # every check passing: nothing falls back, the stats carry no fallbacks
    monkeypatch.setattr(backends, "probe_pallas", lambda *a, **k: None)
    monkeypatch.setattr(host_pool, "probe_host_io", lambda *a, **k: None)
    r = backends.resolve_backends(EngineConfig.of(mode="offload", decode_attention="pallas", host_io="xla"), gpu, tiny)
    assert (r.decode_attention, r.host_io, r.fallbacks) == ("pallas", "xla", ()) and "fallbacks" not in r.as_dict()
    # only the float8 bounds fail: the bounds fall back to the KV dtype, Pallas kept
    monkeypatch.setattr(backends, "probe_pallas",
                        lambda d, dt, sc, kv_dtype=None: None if sc is None or sc.bounds_dtype == "kv" else "fp8")
    with pytest.warns(RuntimeWarning, match="score_bounds_dtype kv"):
        r = backends.resolve_backends(EngineConfig.of(mode="offload", host_io="xla"), gpu, tiny)
    assert (r.sparse_attention, r.scoring.bounds_dtype) == ("pallas", "kv")
    # a landing that fails: offloading cannot run, whatever the other choices
    monkeypatch.setattr("pulseinfer_jax.startup_checks.check_landing", lambda *a: "land wrote other bytes")
    with pytest.raises(backends.FastPathError, match="landing of recalled blocks .* use mode='dense'"):
        backends.resolve_backends(EngineConfig.of(mode="offload"), gpu, tiny)
    assert backends.resolve_backends(EngineConfig.of(mode="dense"), gpu, tiny).fallbacks == ()


def test_pallas_probe_checks_the_kernels_against_their_references(monkeypatch):
    """The start-up check of the Pallas kernels compares each with its jnp reference: a kernel that returns wrong
    values, at one split count of the attention's merge, or a compile error, is reported (not raised), naming it.
    (The kernels stand in as their references here; the real kernels' checks: test_startup_checks.py.)"""
    import jax
    import jax.numpy as jnp
    import pulseinfer_jax.pallas_kernels.block_scoring as bsc
    import pulseinfer_jax.pallas_kernels.select_plan as spk
    import pulseinfer_jax.pallas_kernels.sparse_decode_attention as sda

    from pulseinfer_jax.backends import probe_pallas

    def as_reference(module, name, corrupt=None):
        ref = getattr(module, name + "_reference")

        def run(*a, interpret=None, **k):
            for drop in ("split_k", "blocks_per_step", "tile_k", "num_warps"):
                k.pop(drop, None)
            if name == "sparse_decode_attention" and len(a) == 5:  # (the merge's counters: returned as given)
                return (*ref(*a[:4], **k), a[4])
            out = ref(*a, **k)
            return corrupt(out) if corrupt else out

        monkeypatch.setattr(module, name, run)

    cpu = jax.devices("cpu")[0]
    for module, name in ((sda, "sparse_decode_attention"), (bsc, "block_scores"), (bsc, "append_and_score"),
                         (spk, "select_plan")):
        as_reference(module, name)
    assert probe_pallas(cpu, jnp.float32) is None
    real = sda.sparse_decode_attention
    monkeypatch.setattr(sda, "sparse_decode_attention", lambda *a, **k: tuple(x * 0 for x in real(*a, **k)))
    assert "sparse_decode_attention (one split) disagrees" in probe_pallas(cpu, jnp.float32)
    # only the largest split count's merge wrong (e.g. atomics that do not order the partials' stores)
    monkeypatch.setattr(sda, "sparse_decode_attention", lambda *a, **k: tuple(
        x * 0 if k.get("split_k") == sda.MAX_SPLIT_K and i == 0 else x for i, x in enumerate(real(*a, **k))))
    assert f"merge inside the kernel at {sda.MAX_SPLIT_K} splits disagrees" in probe_pallas(cpu, jnp.float32)
    monkeypatch.setattr(sda, "sparse_decode_attention", real)
    as_reference(bsc, "append_and_score", lambda out: (out[0], out[1], out[2].at[2].add(1.0)))
    assert "append_and_score (per_head=False) wrote other upper key bounds" in probe_pallas(cpu, jnp.float32)
    as_reference(bsc, "append_and_score")
    as_reference(spk, "select_plan", lambda out: out._replace(late_units=out.late_units + 1))
    assert "select_plan's late_units (step 0) differs" in probe_pallas(cpu, jnp.float32)
    assert probe_pallas(cpu, jnp.float32, None) is None  # (dense: the attention only)
    monkeypatch.setattr(sda, "sparse_decode_attention", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("ptxas")))
    assert probe_pallas(cpu, jnp.float32).startswith("RuntimeError: ptxas")
