"""Paged-KV attention in plain jnp: cache writes, batched decode, memory-bounded chunked prefill.

All functions take the full cache `kv: [L, NB, 2, rows, Hkv, hd]` (see kv/cache.py) plus a traced layer
index, so they run inside the layer scan with the cache as the (donated, in-place updated) carry.
Softmax statistics are float32 whatever the cache dtype. A float8 cache (kv/quant.py: rows = bs + r, the last r
holding per-(token, head) bfloat16 scales) is quantised where these functions write and dequantised (exactly, in
float32) where they read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pulseinfer_jax.kv.quant import (
    cache_basis,
    is_quantized,
    pack_blocks,
    tokens_per_block,
    unpack_blocks,
    write_tokens,
)
from pulseinfer_jax.pallas_kernels.common import matmul_precision

NEG_INF = -1e30


def write_decode_kv(
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    layer: Int[Array, ""],
    k: Float[Array, "B Hkv hd"],
    v: Float[Array, "B Hkv hd"],
    block_tables: Int[Array, "B MB"],
    positions: Int[Array, " B"],
) -> Array:
    """Write one new token per sequence at `positions` (inactive rows point at the null block)."""
    bs = tokens_per_block(kv)
    rows = jnp.arange(block_tables.shape[0])
    blk = block_tables[rows, positions // bs]  # [B]
    return write_tokens(kv, layer, blk, positions % bs, k, v)


def paged_decode_attention(
    q: Float[Array, "B Hq hd"],
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "B MB"],
    lengths: Int[Array, " B"],
) -> Float[Array, "B Hq hd"]:
    """softmax(q K^T / sqrt(hd)) V over the first `lengths[b]` tokens of each sequence's blocks (GQA).

    The gathered blocks form a [T, Hkv*hd] matrix per sequence; multiplying it by a block-diagonal
    query [Hq, Hkv*hd] (each query head non-zero only on its KV head's columns) gives every head's
    scores in one plain matmul with no transpose of the (large) K/V. The extra zero products cost
    Hkv x the (small) attention FLOPs; the pass over memory is what decode pays for.
    """
    b, hq, hd = q.shape
    bs, hkv = tokens_per_block(kv), kv.shape[4]
    g = hq // hkv
    mb = block_tables.shape[1]
    blocks = kv[layer, block_tables]  # [B, MB, 2, rows, Hkv, hd]
    # K / V stay in the cache dtype, the products accumulate in f32: converting the gathered K / V to f32 first made
    # XLA write (and re-read) them at twice their bytes (ahead-of-time cost on an H200, bench/RESULTS.md); a float8
    # cache's are dequantised into float32, where value x bfloat16 scale is exact (the Pallas kernel instead folds the
    # scales into its float32 scores and probabilities), and left in their rotated basis: q is rotated, o rotated back
    dt = jnp.float32 if is_quantized(kv.dtype) else kv.dtype
    k = unpack_blocks(blocks[:, :, 0], dt, rotated=True).reshape(b, mb * bs, hkv * hd)
    v = unpack_blocks(blocks[:, :, 1], dt, rotated=True).reshape(b, mb * bs, hkv * hd)
    eye = jnp.eye(hkv, dtype=jnp.float32)
    qbd = cache_basis(q, kv.dtype).astype(jnp.float32).reshape(b, hkv, g, 1, hd) * eye[None, :, None, :, None]
    qbd = (qbd.reshape(b, hq, hkv * hd) * (hd ** -0.5)).astype(dt)
    prec = matmul_precision(dt)  # true f32 for f32 caches (no TF32 on GPU)
    f32 = jnp.float32
    s = jnp.einsum("bqc,btc->bqt", qbd, k, precision=prec, preferred_element_type=f32)  # [B, Hq, T]
    valid = (jnp.arange(mb * bs)[None] < lengths[:, None])[:, None]  # [B, 1, T]
    s = jnp.where(valid, s, NEG_INF)
    p = jnp.where(valid, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    v = jnp.where(valid[:, 0, :, None], v, jnp.zeros((), v.dtype))  # a NaN in an unused slot must not leak (0 * NaN)
    o = jnp.einsum("bqt,btc->bqc", p.astype(v.dtype), v, precision=prec, preferred_element_type=f32)
    o = o.reshape(b, hkv, g, hkv, hd)
    o = jnp.einsum("bhghd->bhgd", o)  # each head's own KV head (the block diagonal)
    o = o / jnp.sum(p, axis=-1).reshape(b, hkv, g)[..., None]
    return cache_basis(o, kv.dtype).reshape(b, hq, hd).astype(q.dtype)


def paged_decode_attention_pallas(
    q: Float[Array, "B Hq hd"],
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "B MB"],
    lengths: Int[Array, " B"],
    *,
    interpret: bool | None = None,
) -> Float[Array, "B Hq hd"]:
    """Same contract as `paged_decode_attention`, computed by the Pallas sparse decode kernel.

    Every block of each sequence is listed (dense decode = sparse with everything selected). The
    kernel reads layer `layer` through block ids offset by layer * NB into the cache viewed as
    [L * NB, 2, bs, Hkv, hd] (a free reshape), so the layer's pool is never sliced out and copied.
    """
    from pulseinfer_jax.pallas_kernels.sparse_decode_attention import sparse_decode_attention
    from pulseinfer_jax.parallel import kernels as tp_kernels
    from pulseinfer_jax.selection.policy import selected_block_lens

    n_layers, nb = kv.shape[:2]
    bs = tokens_per_block(kv)
    b, mb = block_tables.shape
    every_block = jnp.broadcast_to(jnp.arange(mb, dtype=jnp.int32), (b, 1, mb))  # [B, 1, MB] logical
    lens = selected_block_lens(every_block, lengths, bs)  # [B, 1, MB] valid tokens per entry
    ids = jnp.where(lens > 0, block_tables[:, None] + layer * nb, -1).astype(jnp.int32)
    pool = kv.reshape(n_layers * nb, *kv.shape[2:])
    o, _, _ = tp_kernels.decode_attention(sparse_decode_attention, q, pool, ids, lens, interpret=interpret)
    return o


def write_prefill_kv(
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    layer: Int[Array, ""],
    k: Float[Array, "C Hkv hd"],
    v: Float[Array, "C Hkv hd"],
    chunk_blocks: Int[Array, " nb"],
) -> Array:
    """Write a block-aligned chunk of C = nb * bs tokens into blocks `chunk_blocks` (null block = drop)."""
    c, hkv, hd = k.shape
    bs = tokens_per_block(kv)
    nb = c // bs
    kv = kv.at[layer, chunk_blocks, 0].set(pack_blocks(k.reshape(nb, bs, hkv, hd), kv.dtype))
    return kv.at[layer, chunk_blocks, 1].set(pack_blocks(v.reshape(nb, bs, hkv, hd), kv.dtype))


def write_prefill_units(
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    k: Float[Array, "C Hkv hd"],
    v: Float[Array, "C Hkv hd"],
    chunk_units: Int[Array, " nb"],
) -> Array:
    """`write_prefill_kv` into flat units (layer * NB + block, see sparse_layer) instead of one layer's blocks: a
    chunk of
    C = nb * bs tokens into units `chunk_units` (unit 0, layer 0's null block = drop)."""
    c, hkv, hd = k.shape
    bs, nblk = tokens_per_block(kv), kv.shape[1]
    nb = c // bs
    li, bi = chunk_units // nblk, chunk_units % nblk
    kv = kv.at[li, bi, 0].set(pack_blocks(k.reshape(nb, bs, hkv, hd), kv.dtype))
    return kv.at[li, bi, 1].set(pack_blocks(v.reshape(nb, bs, hkv, hd), kv.dtype))


def chunked_prefill_attention(
    q: Float[Array, "C Hq hd"],
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    layer: Int[Array, ""],
    block_table: Int[Array, " MB"],
    start: Int[Array, ""],
    *,
    key_chunk: int,
) -> Float[Array, "C Hq hd"]:
    """Causal attention of chunk queries at positions start..start+C-1 over the sequence's cached keys.

    Keys are visited `key_chunk` tokens at a time with an online softmax, and only up to the chunk's
    last position (a dynamic trip count), so memory is O(C * key_chunk) whatever the context length.
    The chunk's own K/V must already be written to the cache.
    """
    c, hq, hd = q.shape
    bs, hkv = tokens_per_block(kv), kv.shape[4]
    g = hq // hkv
    kc_blocks = key_chunk // bs
    qg = cache_basis(q, kv.dtype).astype(jnp.float32) * (hd ** -0.5)  # (float8: the stored, rotated basis)
    qg = qg.reshape(c, hkv, g, hd).transpose(1, 2, 0, 3)
    qg = qg.reshape(hkv, g * c, hd)  # [Hkv, G*C, hd]
    q_pos = jnp.tile(start + jnp.arange(c), g)  # [G*C], matches the (g, c) flattening
    n_chunks = (start + c + key_chunk - 1) // key_chunk
    prec = matmul_precision(q.dtype if is_quantized(kv.dtype) else kv.dtype)  # true f32 for f32 (no TF32 on GPU)
    # pad the table so the last key chunk's dynamic slice stays in bounds
    table = jnp.concatenate([block_table, jnp.zeros((kc_blocks,), block_table.dtype)])

    def body(i, carry):
        acc, m, denom = carry
        ids = jax.lax.dynamic_slice(table, (i * kc_blocks,), (kc_blocks,))
        blocks = kv[layer, ids]  # [kcb, 2, rows, Hkv, hd]
        k = unpack_blocks(blocks[:, 0], jnp.float32, rotated=True).reshape(key_chunk, hkv, hd).transpose(1, 0, 2)
        v = unpack_blocks(blocks[:, 1], jnp.float32, rotated=True).reshape(key_chunk, hkv, hd).transpose(1, 0, 2)
        k_pos = i * key_chunk + jnp.arange(key_chunk)
        mask = k_pos[None, :] <= q_pos[:, None]  # [G*C, kc]
        s = jnp.einsum("hqd,hkd->hqk", qg, k, precision=prec)
        s = jnp.where(mask[None], s, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask[None], jnp.exp(s - m_new[..., None]), 0.0)
        v = jnp.where((k_pos <= start + c - 1)[None, :, None], v, 0.0)  # never touch unwritten slots
        scale = jnp.exp(m - m_new)
        acc = acc * scale[..., None] + jnp.einsum("hqk,hkd->hqd", p, v, precision=prec)
        return acc, m_new, denom * scale + jnp.sum(p, axis=-1)

    init = (jnp.zeros((hkv, g * c, hd), jnp.float32), jnp.full((hkv, g * c), NEG_INF, jnp.float32),
            jnp.zeros((hkv, g * c), jnp.float32))
    acc, _, denom = jax.lax.fori_loop(0, n_chunks, body, init)
    o = acc / denom[..., None]  # [Hkv, G*C, hd]
    o = cache_basis(o, kv.dtype)  # (float8: rotated back)
    return o.reshape(hkv, g, c, hd).transpose(2, 0, 1, 3).reshape(c, hq, hd).astype(q.dtype)
