"""Paged attention (jnp) against a dense per-sequence reference: shuffled tables, boundaries, NaN poison."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pulseinfer_jax.runner.paged_attention import (
    chunked_prefill_attention,
    paged_decode_attention,
    write_decode_kv,
    write_prefill_kv,
)

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _dense_attention(q, k, v, causal_offset=None):
    """q [T, Hq, hd], k/v [S, Hkv, hd] -> [T, Hq, hd] in float64 numpy; causal if causal_offset given."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(q.shape[-1])
    if causal_offset is not None:
        t_pos = causal_offset + np.arange(q.shape[0])
        s = np.where(np.arange(k.shape[0])[None, None] <= t_pos[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", p, v)


def _pool(rng, nb, hkv, bs, hd, dtype):
    kv = np.full((2, nb, 2, bs, hkv, hd), np.nan, np.float32)  # NaN everywhere: stray reads show
    return jnp.asarray(kv, dtype)


def _write_sequences(rng, kv, lengths, scale=1.0):
    """Random K / V of `lengths` tokens written token by token through the decode writer into layer 1 of `kv`, in
    shuffled blocks: (kv, block tables, [(k, v)] per sequence)."""
    from pulseinfer_jax.kv.quant import tokens_per_block

    nb, hkv, hd, bs = kv.shape[1], kv.shape[4], kv.shape[5], tokens_per_block(kv)
    mb = max(-(-n // bs) for n in lengths) + 1
    ids = rng.permutation(np.arange(1, nb))  # shuffled physical blocks
    tables = np.zeros((len(lengths), mb), np.int32)
    seqs, used = [], 0
    for b, n in enumerate(lengths):
        nblk = -(-n // bs)
        tables[b, :nblk] = ids[used:used + nblk]
        used += nblk
        k = rng.standard_normal((n, hkv, hd)).astype(np.float32) * scale
        v = rng.standard_normal((n, hkv, hd)).astype(np.float32) * scale
        seqs.append((k, v))
        for t in range(n):
            kv = write_decode_kv(kv, jnp.int32(1), jnp.asarray(k[t:t + 1]), jnp.asarray(v[t:t + 1]),
                                 jnp.asarray(tables[b:b + 1]), jnp.asarray([t]))
    return kv, tables, seqs


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bs,group,hd", [(8, 1, 64), (16, 4, 64), (32, 2, 128), (16, 8, 64)])
def test_decode_attention_matches_dense(dtype, bs, group, hd):
    rng = np.random.default_rng(bs * 100 + group + hd)
    hkv = 2
    lengths = [1, bs - 1, bs, bs + 1, 5 * bs + 3]
    nb = 1 + sum(-(-n // bs) for n in lengths) + 3
    kv, tables, seqs = _write_sequences(rng, _pool(rng, nb, hkv, bs, hd, dtype), lengths)
    q = rng.standard_normal((len(lengths), hkv * group, hd)).astype(np.float32)
    out = paged_decode_attention(jnp.asarray(q, dtype), kv, jnp.int32(1), jnp.asarray(tables),
                                 jnp.asarray(lengths))
    assert not np.isnan(np.asarray(out, np.float32)).any()
    for b, (k, v) in enumerate(seqs):
        kq, vq = (np.asarray(jnp.asarray(x, dtype), np.float32) for x in (k, v))
        qq = np.asarray(jnp.asarray(q[b:b + 1], dtype), np.float32)
        ref = _dense_attention(qq, kq, vq)[0]
        np.testing.assert_allclose(np.asarray(out[b], np.float32), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("bs,kc_blocks,group", [(8, 2, 2), (16, 1, 4), (4, 4, 1)])
def test_chunked_prefill_matches_causal_dense(bs, kc_blocks, group):
    rng = np.random.default_rng(bs + kc_blocks)
    hkv, hd, chunk = 2, 64, 4 * bs
    n = 3 * chunk - bs + 1  # ends one token into a block
    nblk = -(-n // bs)
    nb = nblk + 4
    kv = _pool(rng, nb, hkv, bs, hd, jnp.float32)
    table = np.zeros(nblk + 3, np.int32)
    table[:nblk] = rng.permutation(np.arange(1, nb))[:nblk]
    k = rng.standard_normal((n, hkv, hd)).astype(np.float32)
    v = rng.standard_normal((n, hkv, hd)).astype(np.float32)
    q = rng.standard_normal((n, hkv * group, hd)).astype(np.float32)
    padded_table = np.concatenate([table, np.zeros(chunk // bs, np.int32)])
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        kc = np.zeros((chunk, hkv, hd), np.float32)
        vc = np.zeros((chunk, hkv, hd), np.float32)
        qc = np.zeros((chunk, hkv * group, hd), np.float32)
        kc[:m], vc[:m], qc[:m] = k[start:start + m], v[start:start + m], q[start:start + m]
        blocks = padded_table[start // bs: start // bs + chunk // bs]
        kv = write_prefill_kv(kv, jnp.int32(0), jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(blocks))
        out = chunked_prefill_attention(jnp.asarray(qc), kv, jnp.int32(0), jnp.asarray(table), jnp.int32(start),
                                        key_chunk=kc_blocks * bs)
        ref = _dense_attention(q[start:start + m], k[:start + m], v[:start + m], causal_offset=start)
        np.testing.assert_allclose(np.asarray(out[:m]), ref, atol=2e-5, rtol=2e-5)


def test_decode_write_lands_in_the_right_slot():
    bs, hkv, hd = 4, 2, 8
    kv = jnp.zeros((1, 6, 2, bs, hkv, hd))
    tables = jnp.asarray([[3, 5, 0], [2, 0, 0]], jnp.int32)
    k = jnp.ones((2, hkv, hd)) * jnp.asarray([1.0, 2.0])[:, None, None]
    kv = write_decode_kv(kv, jnp.int32(0), k, -k, tables, jnp.asarray([6, 0]))
    got = np.asarray(kv)
    assert (got[0, 5, 0, 2] == 1).all() and (got[0, 5, 1, 2] == -1).all()  # pos 6 -> block 5 slot 2
    assert (got[0, 2, 0, 0] == 2).all()
    assert np.count_nonzero(got) == 2 * 2 * hkv * hd  # nothing else touched
    assert jax.numpy.isfinite(kv).all()


def _fake_quant(x):
    """K or V as a float8 cache returns it (kv_quant.round_trip: rotated, e4m3 under a bfloat16 scale per (token,
    head), rotated back)."""
    from pulseinfer_jax.kv.quant import round_trip

    return np.asarray(round_trip(jnp.asarray(x)))


def _fp8_pool(nb, hkv, bs, hd):
    """A float8 cache [2, nb, 2, bs + r, Hkv, hd] (its uint8 storage) of e4m3 NaN bytes (0x7f) everywhere, scale rows
    included."""
    from pulseinfer_jax.kv.quant import block_rows

    return jnp.full((2, nb, 2, block_rows(bs, hd, jnp.uint8), hkv, hd), 0x7F, jnp.uint8)


@pytest.mark.parametrize("bs,group", [(8, 2), (16, 4)])
def test_float8_decode_attention_reads_what_was_written(bs, group):
    """Tokens written one by one into a float8 cache poisoned with NaN bytes: attention equals dense attention over
    the quantised K / V (f32 rounding), for lengths at block boundaries."""
    rng = np.random.default_rng(bs + group)
    hkv, hd = 2, 64
    lengths = [1, bs - 1, bs, bs + 1, 3 * bs + 3]
    nb = 1 + sum(-(-n // bs) for n in lengths) + 2
    kv, tables, seqs = _write_sequences(rng, _fp8_pool(nb, hkv, bs, hd), lengths, scale=3.0)
    q = rng.standard_normal((len(lengths), hkv * group, hd)).astype(np.float32)
    out = np.asarray(paged_decode_attention(jnp.asarray(q), kv, jnp.int32(1), jnp.asarray(tables),
                                            jnp.asarray(lengths)))
    assert not np.isnan(out).any()
    for b, (k, v) in enumerate(seqs):
        ref = _dense_attention(q[b:b + 1], _fake_quant(k), _fake_quant(v))[0]
        np.testing.assert_allclose(out[b], ref, atol=2e-5, rtol=2e-5)


def test_float8_chunked_prefill_reads_what_was_written():
    bs, hkv, hd, group, chunk = 8, 2, 64, 2, 16
    rng = np.random.default_rng(5)
    n = 3 * chunk - bs + 1
    nblk = -(-n // bs)
    nb = nblk + 3
    kv = _fp8_pool(nb, hkv, bs, hd)
    table = np.zeros(nblk + 2, np.int32)
    table[:nblk] = rng.permutation(np.arange(1, nb))[:nblk]
    k, v = (rng.standard_normal((n, hkv, hd)).astype(np.float32) for _ in "kv")
    q = rng.standard_normal((n, hkv * group, hd)).astype(np.float32)
    padded = np.concatenate([table, np.zeros(chunk // bs, np.int32)])
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        kc, vc, qc = (np.zeros((chunk,) + a.shape[1:], np.float32) for a in (k, v, q))
        kc[:m], vc[:m], qc[:m] = k[start:start + m], v[start:start + m], q[start:start + m]
        kv = write_prefill_kv(kv, jnp.int32(0), jnp.asarray(kc), jnp.asarray(vc),
                              jnp.asarray(padded[start // bs: start // bs + chunk // bs]))
        out = chunked_prefill_attention(jnp.asarray(qc), kv, jnp.int32(0), jnp.asarray(table), jnp.int32(start),
                                        key_chunk=2 * bs)
        ref = _dense_attention(q[start:start + m], _fake_quant(k[:start + m]), _fake_quant(v[:start + m]),
                               causal_offset=start)
        np.testing.assert_allclose(np.asarray(out[:m]), ref, atol=2e-5, rtol=2e-5)
