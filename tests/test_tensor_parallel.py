"""Tensor parallelism on fake CPU devices (conftest starts jax with 8): the same greedy tokens as one device, dense and
offloaded, every weight and KV array split as the layout says, clear refusals."""

import jax
import numpy as np
import pytest
from conftest import TINY, record_sampled_logits
from pulseinfer_jax.models.sharding import check_sharded, kv_repeat

from pulseinfer_jax import Engine, EngineConfig, generate_long
from pulseinfer_jax.api import load_for_engine
from pulseinfer_jax.parallel.layout import TP, DeviceLayout

BASE = dict(block_size=4, max_batch=4, prefill_chunk=32, key_chunk=32)
OFFLOAD = dict(mode="offload", window_tokens=8, sink_blocks=1, dense_layers=1)
HEADS = (None, None, None, None, TP, None)  # the cache [L, NB, 2, bs, Hkv, hd] split by KV head

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake CPU) devices: see conftest")


def _prompts(vocab, lengths=(45, 30, 61), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def _spec(a) -> tuple:
    """The array's partition spec, one entry per axis."""
    s = tuple(a.sharding.spec)
    return s + (None,) * (a.ndim - len(s))


def _run(spec, tp, monkeypatch=None, max_new=16, **settings):
    cfg = EngineConfig.of(**BASE, tensor_parallel=tp, **settings)
    model = load_for_engine(spec, "float32", cfg)
    eng = Engine(model, cfg)
    seen = record_sampled_logits(monkeypatch) if monkeypatch is not None else None
    res = generate_long(_prompts(model.cfg.vocab_size), eng, max_new_tokens=max_new, ignore_eos=True)
    if monkeypatch is not None:
        monkeypatch.undo()
    return eng, [r.token_ids for r in res], seen


def _assert_split(eng):
    """Every weight and the KV cache split as the layout says: nothing that should be split is replicated."""
    place = eng.model.placement
    assert place is not None and place.tp == eng.layout.tp
    assert check_sharded(eng.model.params, place) == []
    assert _spec(eng.kv) == HEADS
    assert eng.kv.sharding.mesh.shape[TP] == eng.layout.tp
    for shard in eng.kv.addressable_shards:  # each device holds its own heads of every block
        assert shard.data.shape[4] == eng.model.cfg.num_kv_heads // eng.layout.tp
    layers = eng.model.params["layers"]
    lp = layers[0] if isinstance(layers, list) else layers
    split = {"wq": -1, "wk": -1, "wv": -1, "wo": -2, "w_gate": -1, "w_up": -1, "w_down": -2}
    for name, axis in split.items():  # the placement's own rules: each device holds 1 / tp of every projection
        if name in lp:
            a = lp[name]["kernel"]
            assert {sh.data.shape[axis] for sh in a.addressable_shards} == {a.shape[axis] // eng.layout.tp}, name


@pytest.mark.parametrize("family,tp", [("llama31", 4), ("qwen3", 2), ("qwen2", 2)])
def test_dense_tokens_and_logits_match_one_device(monkeypatch, family, tp):
    spec = TINY / family
    _, one, one_logits = _run(spec, 1, monkeypatch)
    one_logits = dict(one_logits)
    eng, split, split_logits = _run(spec, tp, monkeypatch)
    assert split == one
    _assert_split(eng)
    scale = max(float(np.max(np.abs(v))) for v in one_logits.values())
    worst = max(float(np.max(np.abs(split_logits[k] - one_logits[k]))) for k in one_logits)
    assert worst <= 1e-5 * scale, (worst, scale)  # f32: the all-reduces sum the heads' parts in another order


def test_smollm2_on_three_devices():
    """The embedded SmolLM2-135M (9 query / 3 KV heads, MLP 1,536, vocabulary 49,152): 3 devices, one KV head each,
    the same greedy text as one device."""
    outs = []
    for tp in (1, 3):
        cfg = EngineConfig.of(tensor_parallel=tp)
        eng = Engine(load_for_engine(None, "float32", cfg), cfg)
        outs.append(generate_long(["The capital of France is"], eng, max_new_tokens=8, chat=False)[0].text)
    assert outs[1] == outs[0] and outs[0].strip()
    _assert_split(eng)


def test_eight_devices_with_kv_heads_repeated():
    """8 query / 2 KV heads over 8 devices: each KV head repeated 4x, one per device, the arithmetic unchanged: the
    single device's tokens, dense and offloaded at full budget."""
    eng, split, _ = _run("random:tiny-llama-8h", 8, max_new=12)
    assert eng.model.cfg.num_kv_heads == 8 and eng.model.placement.kv_repeat == 4
    _assert_split(eng)
    _, one, _ = _run("random:tiny-llama-8h", 1, max_new=12)
    assert split == one
    off, offloaded, _ = _run("random:tiny-llama-8h", 8, max_new=12, budget_tokens=512, **OFFLOAD)
    assert offloaded == one and off.host_pool.h2d_bytes > 0


@pytest.mark.parametrize("tp,settings", [
    (2, dict(decode_attention="pallas", layer_loop="layerwise")),  # the Pallas kernel per device (interpret mode)
    (4, dict(layer_loop="layerwise")),
])
def test_dense_backends_match_one_device(tp, settings):
    _, one, _ = _run(TINY / "llama31", 1, max_new=8)
    eng, split, _ = _run(TINY / "llama31", tp, max_new=8, **settings)
    assert split == one
    _assert_split(eng)


@pytest.mark.parametrize("tp,settings", [
    (2, dict(host_io="xla")),
    (4, dict(host_io="numpy", decode_attention="pallas", layer_loop="layerwise")),
    (2, dict(host_io="numpy-pinned")),  # (each device's heads gathered into its own shard of the pinned staging)
])
def test_full_budget_offload_under_tp_equals_dense(tp, settings):
    """Lossless offloading under tensor parallelism: budget >= context gives the single-device dense tokens while the
    KV lives in per-device host pools (each device's heads) and is recalled."""
    _, dense, _ = _run(TINY / "llama31", 1, max_new=12)
    eng, off, _ = _run(TINY / "llama31", tp, max_new=12, budget_tokens=512, **OFFLOAD, **settings)
    assert off == dense
    _assert_split(eng)
    pool = eng.host_pool
    assert pool.h2d_bytes > 0 and pool.d2h_bytes > 0
    if settings["host_io"] == "xla":  # the pool split by KV head, each device's heads in its own pinned host memory
        assert _spec(pool.pool) == HEADS and pool.pool.sharding.memory_kind == "pinned_host"
    assert _spec(eng.sparse.bounds.fine.lo) == (None, TP, None)  # key bounds [rows, Hkv, hd] split like the cache
    assert _spec(eng.sparse.arrivals) == (TP,) and not np.asarray(eng.sparse.arrivals).any()  # a share per device
    eng.check_drained()


@pytest.mark.parametrize("settings", [dict(), dict(selection="headwise", host_io="numpy")])
def test_sparse_offload_selects_the_same_blocks_on_two_devices(settings):
    """A budget that drops blocks: SoloHead's block scores summed over every device's heads give each device the
    same selection as one device makes, so the tokens match too; the headwise baseline selects per KV head, each
    device for its own (its per-(block, head) copies through the numpy host I/O)."""
    kw = dict(budget_tokens=24, **OFFLOAD, **settings)  # 6 of the prompts' 8 to 16 blocks
    e1, one, _ = _run(TINY / "llama31", 1, max_new=12, **kw)
    e2, split, _ = _run(TINY / "llama31", 2, max_new=12, **kw)
    assert split == one
    assert e2.host_pool.h2d_bytes == e1.host_pool.h2d_bytes > 0  # the same blocks recalled (bytes of every head)
    assert e2.host_pool.h2d_copies == e1.host_pool.h2d_copies  # one coalesced copy per layer and step, per device


def test_moe_experts_split_across_devices():
    """Qwen3-MoE: experts split over the devices (expert parallel), the same tokens as one device."""
    eng, split, _ = _run(TINY / "qwen3_moe", 2, max_new=10)
    _, one, _ = _run(TINY / "qwen3_moe", 1, max_new=10)
    assert split == one
    _assert_split(eng)
    gate_up = eng.model.stacked_params["layers"]["moe"]["gate_up"]  # [L, d, E, 2f]
    assert {s.data.shape[2] for s in gate_up.addressable_shards} == {eng.model.cfg.num_experts // 2}


def test_refusals():
    cfg = EngineConfig.of(**BASE, tensor_parallel=2)
    with pytest.raises(ValueError, match="3 attention heads"):  # SmolLM2's tiny twin: 3 heads, 1 KV head
        load_for_engine(TINY / "smollm2", "float32", cfg)
    with pytest.raises(ValueError, match="needs 16 devices"):
        DeviceLayout.of(16)
    one = load_for_engine(TINY / "llama31", "float32", EngineConfig())
    with pytest.raises(ValueError, match="loaded for 1 device"):
        Engine(one, cfg)
    two = load_for_engine(TINY / "llama31", "float32", cfg)
    with pytest.raises(ValueError, match="selection='solohead'"):
        Engine(two, cfg.with_settings(mode="offload", selection="headwise", host_io="xla"))
    with pytest.raises(ValueError, match="tensor_parallel=0"):
        EngineConfig.of(tensor_parallel=0)
    c = one.cfg
    assert kv_repeat(c, 1) == 1 and kv_repeat(c, 2) == 1 and kv_repeat(c, 4) == 2


@pytest.mark.parametrize("layout", ["stacked", "layers"])
def test_weights_load_into_their_shards_bit_for_bit(monkeypatch, layout):
    """A checkpoint loads straight into its shards, in either layout, with the single device's values (KV heads
    repeated where devices outnumber them); a stacked weight is built one device's shard at a time on the host."""
    from pulseinfer_jax.models.loading import load_model
    from pulseinfer_jax.models.sharding import repeat_kv_heads

    built = []
    real = jax.make_array_from_callback

    def spy(shape, sharding, callback, *a, **kw):
        def recorded(index):
            out = callback(index)
            built.append((shape, out.shape))
            return out
        return real(shape, sharding, recorded, *a, **kw)

    monkeypatch.setattr(jax, "make_array_from_callback", spy)
    one = load_model(TINY / "llama31", layout=layout)
    four = load_model(TINY / "llama31", layout=layout, devices=DeviceLayout.of(4))
    assert check_sharded(four.params, four.placement) == []
    hd, rep = one.cfg.head_dim, four.placement.kv_repeat
    for path, leaf in jax.tree_util.tree_leaves_with_path(one.params):
        names = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        got = four.params
        for k in path:
            got = got[getattr(k, "key", getattr(k, "idx", None))]
        want = np.asarray(leaf)
        if {"wk", "wv"} & set(names):
            want = repeat_kv_heads(want, rep, hd)
        assert np.array_equal(np.asarray(got), want), names
    if layout == "stacked":  # every split weight's host array: one device's shard
        split = [(s, o) for s, o in built if int(np.prod(o)) < int(np.prod(s))]
        assert split and all(int(np.prod(o)) * 4 == int(np.prod(s)) for s, o in split)


def test_float8_kv_splits_with_its_scale_codes():
    """A float8 cache splits by KV head with each head's scale codes (row bs of its blocks): the same sparse
    offloaded tokens on two devices as on one, the host pool and the recalls at float8's bytes."""
    kw = dict(budget_tokens=24, kv_dtype="float8_e4m3fn", **OFFLOAD)
    e1, one, _ = _run(TINY / "llama31", 1, max_new=12, **kw)
    e2, split, _ = _run(TINY / "llama31", 2, max_new=12, **kw)
    assert split == one
    _assert_split(e2)
    assert e2.kv.dtype == jax.numpy.uint8 and e2.kv.shape[3] == BASE["block_size"] + 1  # (float8's bytes)
    assert e2.host_pool.h2d_bytes == e1.host_pool.h2d_bytes > 0
