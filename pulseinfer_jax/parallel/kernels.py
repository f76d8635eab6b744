"""Pallas kernels under tensor parallelism: each device runs the kernel on its own heads, inside `shard_map`.

XLA's partitioner cannot split a Pallas custom call (it would gather every input onto each device), so where the
tracing context holds a mesh with a `tp` axis of more than one device (`DeviceLayout.context()`), the calls below wrap
the kernel in `jax.shard_map` over `tp`: queries, KV heads and key bounds come in split by head, each device's
kernel sees exactly the single-device shapes with Hq / tp query and Hkv / tp KV heads (the same group size), and the
outputs leave split by head. Anything that mixes heads (SoloHead's block scores summed over heads) stays outside,
in plain jnp, where the partitioner adds the all-reduce. With no mesh (one device) the kernel is called directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from pulseinfer_jax.parallel.layout import TP, split_spec

Partial = tuple[Array, Array, Array]


def tp_size() -> int:
    """Devices on the `tp` axis of the context mesh (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or TP not in mesh.axis_names:
        return 1
    return mesh.shape[TP]


def decode_attention(fn: Callable[..., Partial], q: Float[Array, "B Hq hd"], pool: Float[Array, "U 2 bs Hkv hd"],
                     ids: Int[Array, "B S K"], lens: Int[Array, "B S K"], arrivals: Int[Array, " N"] | None = None,
                     **kw) -> tuple[Array, ...]:
    """`fn(q, pool, ids, lens[, arrivals], **kw)` (the sparse decode kernel's contract) per device on its heads; the
    lanes of a headwise selection (S = Hkv) split with their KV heads, SoloHead's single lane goes to every device.
    `arrivals` (the split merge's counters, `sparse_decode_attention`) split evenly over the devices: each device's
    kernel counts in its own share; they come back as a fourth output."""
    extra = () if arrivals is None else (arrivals,)
    if tp_size() == 1:
        return fn(q, pool, ids, lens, *extra, **kw)
    heads = split_spec(3, 1)
    lanes = heads if ids.shape[1] > 1 else P()
    share = (P(TP),) if extra else ()
    mapped = jax.shard_map(functools.partial(fn, **kw),
                           in_specs=(heads, split_spec(pool.ndim, -2), lanes, lanes, *share),
                           out_specs=(heads, split_spec(2, 1), split_spec(2, 1), *share), check_vma=False)
    return mapped(q, pool, ids, lens, *extra)


def block_scores(fn: Callable[..., Array], q: Float[Array, "B Hq hd"], meta_min: Float[Array, "M Hkv hd"],
                 meta_max: Float[Array, "M Hkv hd"], cand: Int[Array, "B K"], id_offset: Int[Array, ""] | None = None,
                 **kw) -> Float[Array, "B S K"]:
    """`fn(q, meta_min, meta_max, cand, id_offset, **kw)` (the block-scoring kernel's contract) per device on its
    heads: scores [B, heads, K] split by head (per query head or per KV head, whichever `fn` returns)."""
    if tp_size() == 1:
        return fn(q, meta_min, meta_max, cand, id_offset, **kw)
    if id_offset is None:
        id_offset = jnp.zeros((), jnp.int32)
    mapped = jax.shard_map(functools.partial(fn, **kw),
                           in_specs=(split_spec(3, 1), split_spec(3, 1), split_spec(3, 1), P(), P()),
                           out_specs=split_spec(3, 1), check_vma=False)
    return mapped(q, meta_min, meta_max, cand, id_offset)


def append_and_score(fn: Callable[..., tuple[Array, Array, Array]], q: Float[Array, "B Hq hd"],
                     meta_min: Float[Array, "M Hkv hd"], meta_max: Float[Array, "M Hkv hd"], cand: Int[Array, "B K"],
                     id_offset: Int[Array, ""] | None, append, pool: Float[Array, "U 2 bs Hkv hd"],
                     unit_offset: Int[Array, ""] | int = 0, **kw) -> tuple[Array, Array, Array]:
    """`fn(q, meta_min, meta_max, cand, id_offset, append, pool, unit_offset, **kw)` (`block_scoring.append_and_score`'s
    contract) per device on its heads: scores split by head, each device's key bounds updated from its heads' keys."""
    if tp_size() == 1:
        return fn(q, meta_min, meta_max, cand, id_offset, append, pool, unit_offset, **kw)
    if id_offset is None:
        id_offset = jnp.zeros((), jnp.int32)
    heads = split_spec(3, 1)
    mapped = jax.shard_map(functools.partial(fn, **kw),
                           in_specs=(heads, heads, heads, P(), P(), jax.tree.map(lambda _: P(), append),
                                     split_spec(pool.ndim, -2), P()),
                           out_specs=(heads, heads, heads), check_vma=False)
    return mapped(q, meta_min, meta_max, cand, id_offset, append, pool, jnp.asarray(unit_offset, jnp.int32))


def kept_scores(fn: Callable[..., Array], q: Float[Array, "B Hq hd"], pool: Float[Array, "U 2 bs Hkv hd"],
                units: Int[Array, "B KK"], lens: Int[Array, "B KK"], unit_offset: Int[Array, ""] | int = 0,
                **kw) -> Float[Array, "B S KK"]:
    """`fn(q, pool, units, lens, unit_offset, **kw)` (the kept blocks' scoring kernel's contract) per device on its
    heads: scores [B, heads, KK] split by head."""
    if tp_size() == 1:
        return fn(q, pool, units, lens, unit_offset, **kw)
    mapped = jax.shard_map(functools.partial(fn, **kw),
                           in_specs=(split_spec(3, 1), split_spec(pool.ndim, -2), P(), P(), P()),
                           out_specs=split_spec(3, 1), check_vma=False)
    return mapped(q, pool, units, lens, jnp.asarray(unit_offset, jnp.int32))


def replicated(fn: Callable[..., object], *args, **kw):
    """`fn(*args, **kw)` whole on every device (a kernel that mixes heads, e.g. the fused selection and slot plan):
    its inputs gathered, its outputs replicated."""
    if tp_size() == 1:
        return fn(*args, **kw)
    specs = jax.tree.map(lambda _: P(), args)
    return jax.shard_map(functools.partial(fn, **kw), in_specs=specs, out_specs=P(), check_vma=False)(*args)
