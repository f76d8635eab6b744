"""float8 KV cache (kv_dtype="float8_e4m3fn") end to end: the model's logits through it are exactly those of the model
with K / V rounded as it stores them, near the goldens; bytes per block, pool sizes and recall bytes at float8's;
the choice reported; refusals. (Kernels: test_sparse_decode_attention.py; attention: test_attention.py; host pool
transfers: test_host_offload.py; offload paths: test_offload.py; tensor parallel: test_tensor_parallel.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, TINY_FAMILIES
from pulseinfer_jax.models.loading import load_model
from test_hf_parity import _golden, paged_logits

from pulseinfer_jax import Engine, EngineConfig, generate_long
from pulseinfer_jax.kv import quant as kq
from pulseinfer_jax.runner import paged_attention

FP8 = kq.STORAGE  # the float8 cache's arrays: e4m3 bytes and bfloat16 scale bytes as uint8
GOLDEN_MEAN_ERR = 0.15  # mean |logit error| over the golden positions, in units of the logits' std (measured <= 0.107)


def _rounded(x):
    return kq.round_trip(x).astype(x.dtype)


@pytest.mark.parametrize("family", ["llama31", "qwen3"])
def test_float8_cache_is_the_model_with_rounded_kv(monkeypatch, family):
    """Through a float8 cache the model computes exactly what it computes over a float32 cache whose writes are K / V
    rounded the same way (kv_quant.round_trip: rotated, rounded, rotated back): nothing else is lost, nothing
    re-quantised, no stray slot read."""
    m = load_model(TINY / family)
    prompt = _golden(family)[0][0]
    _, fp8 = paged_logits(m, prompt, FP8, block_size=4, chunk=8)
    pack, write = paged_attention.pack_blocks, paged_attention.write_tokens
    monkeypatch.setattr(paged_attention, "pack_blocks", lambda x, dt: pack(_rounded(x), dt))
    monkeypatch.setattr(paged_attention, "write_tokens",
                        lambda kv, li, bi, off, k, v: write(kv, li, bi, off, _rounded(k), _rounded(v)))
    jax.clear_caches()  # (the float32 programs must trace the patched writers)
    _, rounded = paged_logits(m, prompt, jnp.float32, block_size=4, chunk=8)
    monkeypatch.undo()
    jax.clear_caches()
    np.testing.assert_allclose(fp8, rounded, atol=1e-5, rtol=1e-5)


def test_float8_logits_near_the_goldens():
    """Every tiny family through a float8 cache: mean |logit error| against the float32 goldens within
    GOLDEN_MEAN_ERR of the logits' std. (The tiny checkpoints are random, head_dim 16 / 32: a much harsher case than a
    trained model, bench/RESULTS.md "float8 KV" has SmolLM2's numbers.)"""
    for family in TINY_FAMILIES:
        m = load_model(TINY / family)
        for prompt, logits, _ in _golden(family):
            half, got = paged_logits(m, prompt, FP8)
            want = logits[half - 1:]
            assert np.isfinite(got).all()
            err = np.abs(got - want).mean() / want.std()
            assert err <= GOLDEN_MEAN_ERR, (family, err)


def test_float8_bytes_pools_and_recalls(tiny4):
    """The same GPU byte budget holds 64 / 18 x the tokens of a float32 cache (head_dim 16: 16 value rows and 2 scale
    rows of bytes against 16 rows of 4-byte elements), the host pool's rows and every recall move float8 blocks, and
    the results report the choice."""
    prompts = [np.random.default_rng(i).integers(3, tiny4.cfg.vocab_size, n).tolist() for i, n in enumerate((61, 38))]
    base = dict(block_size=16, max_batch=4, prefill_chunk=32, key_chunk=32, gpu_kv_budget=1 << 20)
    engines = {}
    for kv in ("auto", "float8_e4m3fn"):
        e = Engine(tiny4, EngineConfig.of(**base, kv_dtype=kv))
        e.ensure_pool(None)
        engines[kv] = e
    f32, f8 = engines["auto"], engines["float8_e4m3fn"]
    assert f8.kv.dtype == FP8 and f8.kv.shape[3] == 18 and f32.kv.shape[3] == 16
    assert f8.spec.bytes_per_block * 64 == f32.spec.bytes_per_block * 18
    assert f8.spec.num_blocks == (1 << 20) // f8.spec.bytes_per_block  # (the budget's blocks)
    assert f8.kv.nbytes == f8.spec.total_bytes
    res = generate_long(prompts, tiny4, max_new_tokens=12, ignore_eos=True, engine_config=EngineConfig.of(
        **base, kv_dtype="float8_e4m3fn", mode="offload", budget_tokens=48, window_tokens=16, dense_layers=2))
    pool_bytes = kq.layer_block_bytes(16, tiny4.cfg.num_kv_heads, tiny4.cfg.head_dim, FP8)  # (1-byte elements)
    for r in res:
        s = r.stats
        assert s["kv_dtype"] == "float8_e4m3fn" and s["offloaded"]
        assert s["recalled_blocks"] > 0 and s["recall_bytes"] == s["recalled_blocks"] * pool_bytes


def test_float8_refusals_and_report(tiny):
    with pytest.raises(ValueError, match="kv_dtype"):
        EngineConfig.of(kv_dtype="int8")
    e = Engine(tiny, EngineConfig.of(kv_dtype="float8_e4m3fn"))
    assert e.backends.as_dict()["kv_dtype"] == "float8_e4m3fn"
    assert "kv_dtype float8_e4m3fn: as configured" in e.backends.summary()
    assert Engine(tiny, EngineConfig()).backends.kv_dtype == "float32"


def test_the_startup_check_runs_the_float8_kernel():
    from pulseinfer_jax.startup_checks import check_attention

    assert check_attention(jax.devices()[0], jnp.bfloat16, "float8_e4m3fn", interpret=True) is None


def test_spill_recall_land_move_float8_blocks_bit_for_bit(tiny4, monkeypatch):
    """Every recalled float8 block lands in its GPU slot byte for byte as its host row holds it (values and scales):
    what the spill wrote is what attention reads, never re-quantised on the way."""
    from pulseinfer_jax.runner import sparse_decoder, sparse_layer
    from pulseinfer_jax.selection import slot_plan

    land = sparse_layer.land_attend_finish
    checked = []

    def checking(model, lp, x, q, kv, layer, plan, staging, early, *rest, **kw):
        kv, x = land(model, lp, x, q, kv, layer, plan, staging, early, *rest, **kw)
        if staging is not None:
            info, got = np.asarray(plan.info), np.asarray(kv[int(layer)])
            rows, _ = slot_plan.recall_lanes(info)
            taken = np.arange(info.shape[2] - 4) < info[:, :, -3:-2]
            slots = np.asarray(plan.misses)[taken]  # the misses' slot blocks, in the order they were staged
            stage = np.asarray(staging)
            for i in range(len(rows)):
                assert np.array_equal(got[slots[i]], stage[i])  # landed = staged
                host = engine.host_pool.read(int(layer) - engine.host_pool.first_layer, int(rows[i]))
                assert np.array_equal(stage[i], host)  # staged = the spilled host row
                checked.append(1)
        return kv, x

    monkeypatch.setattr(sparse_decoder.sparse_layer, "land_attend_finish", checking)
    cfg = EngineConfig.of(block_size=4, max_batch=4, prefill_chunk=32, key_chunk=32, window_tokens=8, sink_blocks=1,
                          mode="offload", budget_tokens=24, dense_layers=2, kv_dtype="float8_e4m3fn",
                          recall="interruptible")  # (recall ahead lands in its layer call: test_offload.py checks it)
    engine = Engine(tiny4, cfg)
    prompts = [np.random.default_rng(i).integers(3, tiny4.cfg.vocab_size, n).tolist() for i, n in enumerate((61, 38))]
    res = generate_long(prompts, engine, max_new_tokens=8, ignore_eos=True)
    assert all(r.stats["recalled_blocks"] > 0 for r in res) and len(checked) > 20
