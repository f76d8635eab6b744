"""float8 KV quantisation (pulseinfer_jax/kv/quant.py): error bounds per granularity, zeros, outliers, shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pulseinfer_jax.kv.quant import FP8, FP8_MAX, dequantize, quantize


def _kv(seed=0, shape=(3, 16, 2, 64)):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("granularity,scale_shape", [("token", (3, 16, 2, 1)), ("block", (3, 1, 2, 1))])
def test_round_trip_within_half_a_step(granularity, scale_shape):
    x = _kv()
    q, s = quantize(jnp.asarray(x), granularity)
    assert q.dtype == FP8 and s.shape == scale_shape and s.dtype == jnp.float32
    back = np.asarray(dequantize(q, s))
    # e4m3: 3 mantissa bits -> relative step 2^-3 for normals (half of it after rounding); subnormals below 2^-6
    # step by 2^-9 of the scale
    bound = np.maximum(np.abs(x) * 2.0 ** -4, np.asarray(s) * 2.0 ** -10)
    assert np.all(np.abs(back - x) <= bound * (1 + 1e-6))
    # the group's amax lands on float8's largest value exactly
    amax_axes = (-1,) if granularity == "token" else (-3, -1)
    assert np.allclose(np.max(np.abs(np.asarray(q, np.float32)), axis=amax_axes), FP8_MAX)


def test_zero_groups_stay_zero_and_finite():
    x = _kv()
    x[1] = 0.0  # a whole block of zeros (its block scale and every token scale of it: amax 0)
    x[0, 3, 1] = 0.0  # one (token, head)
    for g in ("token", "block"):
        q, s = quantize(jnp.asarray(x), g)
        back = np.asarray(dequantize(q, s))
        assert np.all(np.isfinite(back)) and np.all(np.isfinite(np.asarray(s)))
        assert np.all(back[1] == 0.0) and np.all(back[0, 3, 1] == 0.0)


@pytest.mark.parametrize("factor,block_worse", [(100.0, False), (1e5, True)])
def test_an_outlier_costs_a_block_scale_only_past_floats_range(factor, block_worse):
    """float8 is a float: under a block scale a 100x outlier leaves the other tokens their 3 mantissa bits (the same
    error as per-token scales); only values below amax / 2^15 fall into e4m3's subnormals and lose them."""
    x = _kv(1)
    x[0, 5] *= factor
    err = {}
    for g in ("token", "block"):
        q, s = quantize(jnp.asarray(x), g)
        back = np.asarray(dequantize(q, s))
        others = np.delete(np.arange(16), 5)
        err[g] = float(np.abs(back[0, others] - x[0, others]).max())
    if block_worse:
        assert err["token"] < err["block"] / 4, err
    else:
        assert err["block"] < 2 * err["token"], err


def test_appending_a_token_leaves_the_others_bit_for_bit_with_token_scales():
    x = _kv(2)
    q1, s1 = quantize(jnp.asarray(x[:, :8]), "token")
    q2, s2 = quantize(jnp.asarray(x), "token")
    assert np.array_equal(np.asarray(q1).view(np.uint8), np.asarray(q2)[:, :8].view(np.uint8))
    assert np.array_equal(np.asarray(s1), np.asarray(s2)[:, :8])


def test_dtype_and_bad_granularity():
    x = jnp.asarray(_kv(), jnp.bfloat16)
    q, s = quantize(x)
    assert dequantize(q, s, jnp.bfloat16).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="granularity"):
        quantize(x, "head")
    with pytest.raises(ValueError, match="code"):
        quantize(x, code="int4")


@pytest.mark.parametrize("hadamard", [False, True])
def test_the_fp8_bench_runs_on_a_real_checkpoint(tmp_path, hadamard):
    """bench/kv_fp8.py end to end on the tiny SmolLM2 twin, plain and in the cache's rotated basis: every layer's errors
    finite, K / V within float8's step."""
    import json

    from conftest import TINY

    from bench.kv_fp8 import main

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    assert main(["--model", str(TINY / "smollm2"), "--text", str(text), "--tokens", "64", "--queries", "8",
                 "--out", str(tmp_path)] + ["--hadamard"] * hadamard) == 0
    r = json.loads((tmp_path / "kv_fp8_cpu.json").read_text())
    for g in ("token", "token-pow2", "token-e5m2", "token-bf16", "block"):
        rows = r["per_layer"][g]
        assert len(rows) == 2 and all(np.isfinite(list(row.values())).all() for row in rows)
        assert all(row["k_rel_err"] < 2.0 ** -4 and row["v_rel_err"] < 2.0 ** -4 for row in rows)
    assert r["summary"]["token"]["bytes_per_kv_element"] > r["summary"]["block"]["bytes_per_kv_element"] > 1


# ---- the cache's float8 storage: values + a bfloat16 scale per (token, head) in the block's scale rows ------------
@pytest.mark.parametrize("bs,hd", [(16, 64), (16, 16), (4, 16), (8, 32)])  # one scale row, two, ...
def test_packed_blocks_hold_values_and_scales_and_unpack_exactly(bs, hd):
    from pulseinfer_jax.kv import quant as kq

    x = _kv(3, (3, bs, 2, hd))
    x[1] = 0.0  # an all-zero block: scale 1, zeros back
    x[2, 1, 0] *= 1e4  # an outlier token costs only itself
    blocks = kq.pack_blocks(jnp.asarray(x), FP8)
    r = kq.scale_rows(bs, hd)
    assert r == -(-2 * bs // hd) and blocks.shape == (3, bs + r, 2, hd) and blocks.dtype == kq.STORAGE
    assert kq.tokens_per_block(blocks) == bs
    xr = np.asarray(kq.rotate(jnp.asarray(x)))  # the stored basis: each head's features rotated
    q, s = quantize(jnp.asarray(xr), "token", code="bf16")
    stored = np.asarray(kq.unpack_blocks(blocks, jnp.float32, rotated=True))
    assert np.array_equal(stored, np.asarray(dequantize(q, s)))  # values x bfloat16 scales: exact in float32
    back = np.asarray(kq.unpack_blocks(blocks, jnp.float32))  # rotated back
    np.testing.assert_allclose(back, np.asarray(kq.rotate(jnp.asarray(stored))), rtol=0, atol=1e-6 * np.abs(x).max())
    np.testing.assert_allclose(back, np.asarray(kq.round_trip(jnp.asarray(x))), rtol=0, atol=1e-6 * np.abs(x).max())
    assert np.all(back[1] == 0.0)
    np.testing.assert_array_equal(np.asarray(kq.block_scales(blocks)), np.asarray(s)[..., 0])
    # the amax element of each stored row is kept to bfloat16's precision, not float8's
    amax = np.abs(xr).max(-1)
    got = np.take_along_axis(np.abs(stored), np.abs(xr).argmax(-1)[..., None], -1)[..., 0]
    assert np.all(np.abs(got - amax) <= amax * 2.0 ** -8)
    # scale bytes fill 2 bs bytes of each head's scale rows, zeros after
    run = np.swapaxes(np.asarray(blocks[:, bs:]), 1, 2).reshape(3, 2, r * hd)
    assert not run[..., 2 * bs:].any()
    bits = run[..., :2 * bs].reshape(3, 2, bs, 2).astype(np.uint32)
    want = np.asarray(s)[..., 0].astype(np.float32).view(np.uint32) >> 16  # [3, bs, 2] bfloat16 bits
    assert np.array_equal((bits[..., 1] << 8) | bits[..., 0], np.swapaxes(want, 1, 2))
    assert kq.pack_blocks(jnp.asarray(x), jnp.bfloat16).shape == x.shape  # other dtypes: a cast


def test_extreme_magnitudes_saturate_without_nan():
    from pulseinfer_jax.kv import quant as kq

    x = np.zeros((1, 4, 1, 16), np.float32)
    x[0, 0] = 1e-30
    x[0, 1] = 3e37  # (the rotation may grow an element by sqrt(hd): float32's max / 4 at hd 16 stays finite)
    x[0, 2, 0, 0] = -7.0
    back = np.asarray(kq.unpack_blocks(kq.pack_blocks(jnp.asarray(x), FP8), jnp.float32))
    assert np.all(np.isfinite(back))
    assert back[0, 2, 0, 0] == -7.0 and np.allclose(back[0, 1, 0], 3e37, rtol=2.0 ** -8)


@pytest.mark.parametrize("hd", [16, 64, 128, 80])
def test_rotation_is_orthonormal_and_its_own_inverse(hd):
    """The cache's basis: H symmetric with H H = I (80 = 5 x 16: Sylvester's 16 x 16 matrix along the diagonal)."""
    from pulseinfer_jax.kv import quant as kq

    h = kq.hadamard(hd)
    np.testing.assert_array_equal(h, h.T)
    np.testing.assert_allclose(h @ h, np.eye(hd), atol=1e-6)
    p = hd & -hd
    assert set(np.unique(np.abs(h[:p, :p]))) == {np.float32(p ** -0.5)}
    x = jnp.asarray(_kv(5, (4, 2, hd)))
    np.testing.assert_allclose(np.asarray(kq.rotate(kq.rotate(x))), np.asarray(x), atol=1e-5)


def test_round_trip_error_is_the_stored_basis_error():
    """The rotation is orthonormal, so a token's error norm after rotating back is its error in the stored basis:
    within e4m3's half step (2^-4 relative for normals, 2^-10 scale at the bottom) of every stored element; an
    outlier channel 50x the others included."""
    from pulseinfer_jax.kv import quant as kq

    x = _kv(6, (64, 2, 64))
    x[:32, :, 3] *= 50.0
    err = np.linalg.norm(np.asarray(kq.round_trip(jnp.asarray(x))) - x, axis=-1)  # [tokens, heads]
    xr = np.asarray(kq.rotate(jnp.asarray(x)))
    bound = 2.0 ** -4 * np.linalg.norm(xr, axis=-1) + 8 * 2.0 ** -10 * np.abs(xr).max(-1) / FP8_MAX
    assert np.all(err <= bound * (1 + 1e-5)) and np.all(err > 0)


def test_write_tokens_appends_without_touching_the_block():
    """A decode append writes one token's values and its scale's two bytes; the block's other tokens stay bit for
    bit, and the result is what packing the whole block at once gives."""
    from pulseinfer_jax.kv import quant as kq

    bs, hd = 16, 16  # two scale rows: token 9's scale bytes 18, 19 sit in the second
    x = jnp.asarray(_kv(4, (bs, 2, hd)))
    full = np.asarray(kq.pack_blocks(x, FP8))
    kv = jnp.zeros((2, 3, 2, bs + 2, 2, hd), kq.STORAGE)
    kv = kv.at[1, 2, 0].set(kq.pack_blocks(x.at[9:].set(0.0), FP8))  # tokens 0..8 prefilled
    before = np.asarray(kv).copy()
    kv = kq.write_tokens(kv, jnp.array([1]), jnp.array([2]), jnp.array([9]), x[9][None], x[9][None])
    after = np.asarray(kv)
    assert np.array_equal(after[1, 2, 0, :bs][9], full[9])
    assert np.array_equal(after[1, 2, 0, 17, :, 2:4], full[17, :, 2:4])
    changed = {tuple(c) for c in np.argwhere(after != before)}
    assert {c[:4] for c in changed} <= {(1, 2, h, 9) for h in (0, 1)} | {(1, 2, h, 17) for h in (0, 1)}
    assert all(c[3] != 17 or c[5] in (2, 3) for c in changed)  # in the scale rows, only token 9's two bytes


def _write_per_field(kv, li, bi, off, k, v):
    """write_tokens' contract field by field (values, then each scale byte of K and V): the reference of its one
    scatter."""
    from pulseinfer_jax.kv import quant as kq

    if not kq.is_quantized(kv.dtype):
        return kv.at[li, bi, 0, off].set(k.astype(kv.dtype)).at[li, bi, 1, off].set(v.astype(kv.dtype))
    bs, hd = kq.tokens_per_block(kv), kv.shape[-1]
    cast = (lambda a: a) if kv.dtype == kq.STORAGE else kq.as_float8
    for half, x in ((0, k), (1, v)):
        values, scale_bytes = kq.encode(x)
        kv = kv.at[li, bi, half, off].set(cast(values))
        for byte in range(kq.SCALE_BYTES):
            row, col = kq.scale_position(off, byte, bs, hd)
            kv = kv.at[li, bi, half, row, :, col].set(cast(scale_bytes[..., byte]))
    return kv


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "storage", "float8"])
@pytest.mark.parametrize("bs,hd", [(16, 128), (16, 16), (8, 64)])
def test_write_tokens_is_the_per_field_write_bit_for_bit(dtype, bs, hd):
    """One scatter of every byte the new tokens write equals writing values and scale bytes field by field, over
    random bytes elsewhere (untouched), several layers and blocks, offsets at block boundaries, a shared layer index."""
    from pulseinfer_jax.kv import quant as kq

    rng = np.random.default_rng(bs * hd)
    if dtype in ("storage", "float8"):
        kv = jnp.asarray(rng.integers(0, 256, (3, 5, 2, kq.block_rows(bs, hd, FP8), 2, hd)), kq.STORAGE)
        kv = kq.as_float8(kv) if dtype == "float8" else kv
    else:
        kv = jnp.asarray(rng.normal(size=(3, 5, 2, bs, 2, hd)), dtype)
    li = jnp.array([0, 2, 1, 2], jnp.int32)
    bi = jnp.array([4, 0, 3, 1], jnp.int32)
    off = jnp.array([0, bs - 1, bs // 2, 1], jnp.int32)
    k = jnp.asarray(rng.normal(size=(4, 2, hd)) * 5, jnp.float32)
    v = jnp.asarray(rng.normal(size=(4, 2, hd)), jnp.float32)
    view = (lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))) if dtype == "float8" else np.asarray
    for layer in (li, jnp.int32(2)):
        got = kq.write_tokens(kv, layer, bi, off, k, v)
        want = _write_per_field(kv, layer, bi, off, k, v)
        assert got.dtype == kv.dtype and got.shape == kv.shape
        np.testing.assert_array_equal(view(got), view(want))
        assert not np.array_equal(view(got), view(kv))


def test_storage_geometry_and_refusals():
    from pulseinfer_jax.kv import quant as kq

    assert kq.block_rows(16, 64, FP8) == 17 and kq.block_rows(16, 16, FP8) == 18
    assert kq.block_rows(16, 64, "bfloat16") == 16
    assert kq.layer_block_bytes(16, 8, 128, FP8) * 32 == kq.layer_block_bytes(16, 8, 128, jnp.bfloat16) * 17
    for bs, hd in ((16, 64), (16, 16), (32, 16), (5, 64), (128, 64)):
        rows = kq.block_rows(bs, hd, FP8)
        assert kq.tokens_per_block(jnp.zeros((3, 2, rows, 2, hd), kq.STORAGE)) == bs
        assert kq.tokens_per_block(jnp.zeros((3, 2, rows, 2, hd), FP8)) == bs  # (a float8-typed view reads the same)
    assert kq.resolve_kv_dtype("auto", jnp.bfloat16) == "bfloat16"
    assert kq.resolve_kv_dtype("float8_e4m3fn", jnp.bfloat16) == "float8_e4m3fn"
    assert kq.storage_dtype("float8_e4m3fn") == jnp.uint8 and kq.storage_dtype("bfloat16") == jnp.bfloat16
    with pytest.raises(ValueError, match="kv_dtype"):
        kq.resolve_kv_dtype("int8", jnp.float32)
