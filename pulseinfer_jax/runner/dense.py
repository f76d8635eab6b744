"""Jitted model steps over the paged cache: one prefill chunk of one request, one decode step of a batch.

A step runs its layers one of two ways (`EngineConfig.layer_loop`): `decode_step` / `prefill_step` are one
jitted call that scans the layers over the stacked weights; `decode_step_layerwise` / `prefill_step_layerwise`
dispatch one jitted call per layer with that layer's own weight arrays (`models.transformer.split_layers`),
as the sparse pipeline does (an engine running layer-wise keeps the weights only per layer, `LoadedModel.unstack`).
A scan reads layer i's weights by slicing the stacked arrays, which XLA may materialise as a copy of the layer's weights
every step (on CPU it does: `sparse_layer` measured 0.31 vs 0.89 ms for one MLP block); the layer-wise loop
never slices, at the price of one dispatch per layer. Which is faster on a GPU is measured by
`bench/dense_decode.py --layer-loop scan,layerwise`.

All steps donate the cache, so the per-layer K/V writes update it in place. The model (a frozen, hashable
`Transformer`) is a static argument: engines over equal configs share compiled code. Shapes are
bucketed by the caller (batch and block-table width to powers of two, prefill chunks to powers of two
up to the chunk size) so the number of compiled variants stays small.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pulseinfer_jax.kv.quant import tokens_per_block
from pulseinfer_jax.models.rope import rope_tables
from pulseinfer_jax.models.transformer import Transformer, head_params
from pulseinfer_jax.runner import sparse_layer
from pulseinfer_jax.runner.paged_attention import (
    chunked_prefill_attention,
    paged_decode_attention,
    paged_decode_attention_pallas,
    write_decode_kv,
    write_prefill_kv,
    write_prefill_units,
)

DECODE_ATTENTION = {"jnp": paged_decode_attention, "pallas": paged_decode_attention_pallas}

# XLA:CPU compiles without reassociation/contraction by default, which keeps the many small reductions and
# matrix-vector products of a decode step scalar (measured: SmolLM2 decode 27 ms -> 16 ms per step with
# these on). NaN/Inf/division/function semantics stay IEEE. Only CPU compiles get them (see _compiled).
CPU_FAST_MATH = {
    "xla_cpu_enable_fast_math": True,
    "xla_cpu_fast_math_honor_nans": True,
    "xla_cpu_fast_math_honor_infs": True,
    "xla_cpu_fast_math_honor_division": True,
    "xla_cpu_fast_math_honor_functions": True,
}


def _paged_attend(attention: str, block_tables: Int[Array, "B MB"], positions: Int[Array, " B"]):
    """The decode attention of one layer over the paged cache: attend(layer, q, k, v, cache) -> (o, cache) writes
    each row's new K/V at `positions`, then attends over its first `positions + 1` tokens."""
    lengths = positions + 1
    attend_fn = DECODE_ATTENTION[attention]

    def attend(layer, q, k, v, cache):
        cache = write_decode_kv(cache, layer, k[:, 0], v[:, 0], block_tables, positions)
        return attend_fn(q[:, 0], cache, layer, block_tables, lengths)[:, None], cache

    return attend


def _decode_step(
    model: Transformer,
    params: dict,
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    tokens: Int[Array, " B"],
    positions: Int[Array, " B"],
    block_tables: Int[Array, "B MB"],
    *,
    attention: str = "jnp",
) -> tuple[Array, Float[Array, "B V"]]:
    """Append each sequence's token at `positions` and return next-token logits (rows are independent).

    Inactive (padding) rows carry an all-null block table and write into the null block.
    `attention` picks the decode attention: "jnp" (XLA) or "pallas" (the sparse decode kernel).
    """
    x = model.embed(params, tokens[:, None])
    x, kv = model.layers(params, x, positions[:, None], _paged_attend(attention, block_tables, positions), kv)
    return kv, model.logits(params, x[:, 0])


def _one_layer(model: Transformer, lp: dict, kv: Array, x: Array, positions: Int[Array, "b t"], attend,
               layer: Int[Array, ""]) -> tuple[Array, Array]:
    """Layer `layer` (weights `lp`) over x at `positions`, attention by attend(layer, q, k, v, cache)."""
    cos, sin = rope_tables(model.cfg, positions)
    x, kv = model.layer(lp, x, cos, sin, lambda q, k, v, cache: attend(layer, q, k, v, cache), kv)
    return kv, x


def _decode_layer(
    model: Transformer,
    lp: dict,
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    x: Float[Array, "B 1 D"],
    positions: Int[Array, " B"],
    block_tables: Int[Array, "B MB"],
    layer: Int[Array, ""],
    *,
    attention: str = "jnp",
) -> tuple[Array, Float[Array, "B 1 D"]]:
    """Layer `layer` of `_decode_step`, with that layer's own weights `lp` (one compile serves every layer)."""
    return _one_layer(model, lp, kv, x, positions[:, None], _paged_attend(attention, block_tables, positions), layer)


def _chunk_entries(table: Int[Array, " MB"], start: Int[Array, ""], c: int, bs: int) -> Int[Array, " nb"]:
    """The c // bs entries of `table` that a block-aligned c-token chunk at `start` writes (0, a null block, past the
    table)."""
    nb = c // bs
    padded = jnp.concatenate([table, jnp.zeros((nb,), table.dtype)])
    return jax.lax.dynamic_slice(padded, (start // bs,), (nb,))


def _prefill_attend(block_table: Int[Array, " MB"], start: Int[Array, ""], c: int, bs: int, key_chunk: int):
    """The attention of a c-token prefill chunk starting at `start` (block aligned): attend(layer, q, k, v, cache)
    -> (o, cache) writes the chunk's K/V into its c // bs blocks (the null block past the table), then attends
    over the request's keys up to each query."""
    chunk_blocks = _chunk_entries(block_table, start, c, bs)

    def attend(layer, q, k, v, cache):
        cache = write_prefill_kv(cache, layer, k[0], v[0], chunk_blocks)
        o = chunked_prefill_attention(q[0], cache, layer, block_table, start, key_chunk=key_chunk)
        return o[None], cache

    return attend


def _prefill_step(
    model: Transformer,
    params: dict,
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    tokens: Int[Array, " C"],
    start: Int[Array, ""],
    n_valid: Int[Array, ""],
    block_table: Int[Array, " MB"],
    *,
    key_chunk: int,
) -> tuple[Array, Float[Array, " V"]]:
    """Prefill tokens at positions start..start+n_valid-1 (start block aligned); logits of the last one.

    C = tokens.shape[0] must be a multiple of the block size; the tail past n_valid is padding whose
    K/V land in the request's own (not yet used) slots or in the null block.
    """
    c = tokens.shape[0]
    positions = start + jnp.arange(c, dtype=jnp.int32)
    attend = _prefill_attend(block_table, start, c, tokens_per_block(kv), key_chunk)
    x, kv = model.layers(params, _prefill_embed(model, params, tokens), positions[None], attend, kv)
    return kv, _prefill_logits(model, params, x, n_valid)


def _prefill_embed(model: Transformer, params: dict, tokens: Int[Array, " C"]) -> Float[Array, "1 C D"]:
    return model.embed(params, tokens[None])


def _prefill_layer(
    model: Transformer,
    lp: dict,
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    x: Float[Array, "1 C D"],
    start: Int[Array, ""],
    block_table: Int[Array, " MB"],
    layer: Int[Array, ""],
    *,
    key_chunk: int,
) -> tuple[Array, Float[Array, "1 C D"]]:
    """Layer `layer` of `_prefill_step`, with that layer's own weights `lp` (one compile serves every layer)."""
    c = x.shape[1]
    positions = start + jnp.arange(c, dtype=jnp.int32)
    return _one_layer(model, lp, kv, x, positions[None], _prefill_attend(block_table, start, c, tokens_per_block(kv),
                                                                         key_chunk), layer)


def _prefill_attend_units(unit_table: Int[Array, " MB"], start: Int[Array, ""], c: int, kv: Array, key_chunk: int):
    """`_prefill_attend` over flat units (layer * NB + block): the chunk's K/V go to its units of `unit_table` (unit 0,
    the null block of layer 0, past the table) and it attends over the units read through the flat view of the cache
    (a free reshape). The same arithmetic as `_prefill_attend`: only the addresses differ."""
    n_layers, nblk = kv.shape[0], kv.shape[1]
    chunk_units = _chunk_entries(unit_table, start, c, tokens_per_block(kv))

    def attend(layer, q, k, v, cache):
        cache = write_prefill_units(cache, k[0], v[0], chunk_units)
        flat = cache.reshape(1, n_layers * nblk, *cache.shape[2:])
        o = chunked_prefill_attention(q[0], flat, jnp.int32(0), unit_table, start, key_chunk=key_chunk)
        return o[None], cache

    return attend


def _prefill_layer_units(
    model: Transformer,
    lp: dict,
    kv: Float[Array, "L NB 2 rows Hkv hd"],
    x: Float[Array, "1 C D"],
    start: Int[Array, ""],
    unit_table: Int[Array, " MB"],
    *,
    key_chunk: int,
) -> tuple[Array, Float[Array, "1 C D"]]:
    """One layer (weights `lp`) of a prompt chunk whose K/V live in flat units `unit_table` (logical block j of the
    prompt at unit `unit_table[j]`): the layer-segmented prefill of an offloaded prompt
    (runner/offloaded_prefill.py), which
    keeps one layer of the prompt's KV on the GPU at a time, in units of any layer slice."""
    c = x.shape[1]
    positions = start + jnp.arange(c, dtype=jnp.int32)
    attend = _prefill_attend_units(unit_table, start, c, kv, key_chunk)
    return _one_layer(model, lp, kv, x, positions[None], attend, jnp.int32(0))


def _prefill_logits(model: Transformer, params: dict, x: Float[Array, "1 C D"], n_valid: Int[Array, ""]
                    ) -> Float[Array, " V"]:
    """Logits of the chunk's last valid token."""
    return model.logits(params, jax.lax.dynamic_index_in_dim(x[0], n_valid - 1, keepdims=False))


@functools.cache
def _compiled(fn, platform: str):
    """jit `fn` once per platform: CPU compiles get CPU_FAST_MATH; model/key_chunk are static; kv is donated."""
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount + fn.__code__.co_kwonlyargcount]
    static = [a for a in ("model", "key_chunk", "attention") if a in names]
    opts = CPU_FAST_MATH if platform == "cpu" else None
    return jax.jit(fn, static_argnames=static, donate_argnames=[a for a in ("kv",) if a in names],
                   compiler_options=opts)


def decode_step(model: Transformer, params: dict, kv: jax.Array, *args: jax.Array,
                attention: str = "jnp") -> tuple[Array, Array]:
    """See `_decode_step`; compiled for the platform the cache lives on."""
    return _compiled(_decode_step, _platform(kv))(model, params, kv, *args, attention=attention)


def decode_step_layerwise(model: Transformer, params: dict, layer_params: list[dict], layer_ids: list[jax.Array],
                          kv: jax.Array, tokens: jax.Array, positions: jax.Array, block_tables: jax.Array, *,
                          attention: str = "jnp") -> tuple[Array, Array]:
    """`decode_step` driven layer by layer from Python (asynchronous dispatch): the same arithmetic, each layer
    with its own weights `layer_params[i]` and index `layer_ids[i]` (an int32 scalar on the device)."""
    layer = _compiled(_decode_layer, _platform(kv))
    head = head_params(params)
    x = sparse_layer.embed(model, head, tokens)
    for lp, idx in zip(layer_params, layer_ids, strict=True):
        kv, x = layer(model, lp, kv, x, positions, block_tables, idx, attention=attention)
    return kv, sparse_layer.logits(model, head, x)


def prefill_step(model: Transformer, params: dict, kv: jax.Array, *args: jax.Array,
                 key_chunk: int) -> tuple[Array, Array]:
    """See `_prefill_step`; compiled for the platform the cache lives on."""
    return _compiled(_prefill_step, _platform(kv))(model, params, kv, *args, key_chunk=key_chunk)


def prefill_step_layerwise(model: Transformer, params: dict, layer_params: list[dict], layer_ids: list[jax.Array],
                           kv: jax.Array, tokens: jax.Array, start: jax.Array, n_valid: jax.Array,
                           block_table: jax.Array, *, key_chunk: int) -> tuple[Array, Array]:
    """`prefill_step` driven layer by layer (each layer with its own weights `layer_params[i]` and index
    `layer_ids[i]`): what an engine whose weights are kept per layer (no stacked copy) runs."""
    platform = _platform(kv)
    layer = _compiled(_prefill_layer, platform)
    head = head_params(params)
    x = _compiled(_prefill_embed, platform)(model, head, tokens)
    for lp, idx in zip(layer_params, layer_ids, strict=True):
        kv, x = layer(model, lp, kv, x, start, block_table, idx, key_chunk=key_chunk)
    return kv, _compiled(_prefill_logits, platform)(model, head, x, n_valid)


def prefill_embed(model: Transformer, params: dict, tokens: jax.Array, platform: str) -> Array:
    """A prefill chunk's embeddings [1, C, D] (the first step of `prefill_step_layerwise`)."""
    return _compiled(_prefill_embed, platform)(model, head_params(params), tokens)


def prefill_layer_units(model: Transformer, lp: dict, kv: jax.Array, x: jax.Array, start: jax.Array,
                        unit_table: jax.Array, *, key_chunk: int) -> tuple[Array, Array]:
    """See `_prefill_layer_units`; compiled for the platform the cache lives on."""
    return _compiled(_prefill_layer_units, _platform(kv))(model, lp, kv, x, start, unit_table, key_chunk=key_chunk)


def prefill_logits(model: Transformer, params: dict, x: jax.Array, n_valid: jax.Array) -> Array:
    """Logits [V] of a prefill chunk's last valid token (the last step of `prefill_step_layerwise`)."""
    return _compiled(_prefill_logits, _platform(x))(model, head_params(params), x, n_valid)


def _platform(x: jax.Array) -> str:
    return next(iter(x.devices())).platform
