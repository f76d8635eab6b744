"""Host I/O backend "xla": the pool is a jax array on `pinned_host`, its transfers are XLA programs.

This is PulseInfer's intended path on a GPU: the pool is page-locked DRAM the GPU's copy engines read and write
directly. What each program compiles to for an H200 (read from its optimised HLO and thunks by the ahead-of-time
check, bench/aot; bench/RESULTS.md "Host I/O" and bench/notes/offload_cpu_details.md):

  - write_back: one device gather of the blocks, then per block one dynamic-update-slice of the host pool, which
    XLA issues as an asynchronous device-to-host copy into the block's row (`dynamic-update-slice-start/done`), in
    a loop of known trip count (padding entries write zeros into the null row). The pool is donated and updated in
    place. `write_back_units` does the same for one pool layer's blocks read from flat units of the cache (the
    layer-segmented prefill of an offloaded prompt). (A host computation doing the update,
    `compute_on("device_host")`, compiled to a copy of the whole pool after it: the pool's size per write-back.)
  - stage_blocks / stage_units: a host computation (`compute_on("device_host")`: one `HostExecute`, XLA:CPU code)
    gathers the blocks into a pinned staging buffer (indices clipped: `fill` breaks with a memory-space mismatch);
    `to_device` is then ONE host-to-device copy of it: a coalesced recall is a host gather plus one DMA.
  - fragment_units: per (block, head) unit one dynamic slice of the host pool moved to the device, which XLA issues
    as an asynchronous host-to-device copy (`dynamic-slice-start/done`), in a loop of known trip count: one small
    copy per unit, the per-head offloading baseline. Padding entries copy the null row's unit.
Inside the programs, placements use memory spaces (`jax.memory.Space`), not shardings, so the same code compiles
the same way for a compile-only GPU (whose shardings carry no memory kind). Every call is asynchronous.

On the CPU backend the same code runs on the emulated memory kinds (the tests); whether a GPU's XLA accepts all
of it is checked at start-up by `host_pool.probe_host_io` (the engine falls back to "numpy" if not).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int
from pulseinfer_jax.host_offload.memory import HOST_KIND, host_sharding, zeros_on

from pulseinfer_jax.parallel.layout import DeviceLayout, split_spec


class XlaHostIO:
    name = "xla"
    host_gather = False  # (its gather is a host computation inside a GPU program, not host code)

    def __init__(self, device: jax.Device | DeviceLayout, first_layer: int):
        layout = DeviceLayout.on(device)
        host_sharding(layout.device)  # (a clear error where the backend has no pinned host memory)
        self.mesh = layout.mesh
        # the pool [Ls, R, 2, bs, Hkv, hd] and staging buffers [n, 2, bs, Hkv, hd] split by KV head under tensor
        # parallelism (each device's heads in its own pinned host memory); scalars replicated
        self.host, self.dev = layout.kv_heads(6, HOST_KIND), layout.kv_heads(5, "device")
        self.host_scalar, self.dev_scalar = layout.replicated(HOST_KIND), layout.replicated("device")
        (self._write, self._stage_blocks, self._stage_units, self._fragment,
         self._write_units) = transfers(self.host_scalar, self.dev_scalar, first_layer, self.mesh)
        # the copy up: a plain device_put (one DMA) where the runtime takes a program's pinned-host output, else a
        # jitted copy (docs/limits.md: jaxlib 0.12's CPU runtime refuses the plain put)
        self.copy_up = "device_put" if plain_put_takes_program_outputs(self.host_scalar, self.dev_scalar) else "jit"
        self._up = {5: _copy_up(self.copy_up, self.dev), 1: _copy_up(self.copy_up, self.dev_scalar)}
        self._layers: dict[int, tuple[Array, Array]] = {}  # pool layer -> its index on the host and on the device

    def _layer(self, layer: int) -> tuple[Array, Array]:
        """Pool layer `layer` as an int32 scalar on the host and on the device, made once (no copy per call)."""
        if layer not in self._layers:
            v = np.int32(layer)
            self._layers[layer] = (jax.device_put(v, self.host_scalar), jax.device_put(v, self.dev_scalar))
        return self._layers[layer]

    # ---- storage -------------------------------------------------------------------------------
    def h2d_source(self, nbytes: int) -> Array:
        """Bytes in the host memory a recall copies from (`HostKVPool.measure_h2d`): the pool's pinned memory."""
        return self.zeros((nbytes,), np.uint8)

    def zeros(self, shape: tuple[int, ...], dtype) -> Array:
        """A pool [Ls, R, 2, bs, Hkv, hd] (split by KV head under tensor parallelism) or a plain buffer (replicated)."""
        return zeros_on(shape, dtype, self.host if len(shape) == 6 else self.host_scalar)

    def load(self, data: np.ndarray) -> Array:
        return jax.block_until_ready(jax.device_put(data, self.host))

    def to_numpy(self, pool: Array) -> np.ndarray:
        return np.asarray(jax.device_get(pool))

    # ---- transfers -----------------------------------------------------------------------------
    def write_back(self, pool: Float[Array, "Ls R 2 bs Hkv hd"], kv: Float[Array, "L NB 2 bs Hkv hd"],
                   blocks: np.ndarray, rows: np.ndarray, count: int) -> Array:
        """blocks / rows: [n] int32 padded past `count` (padding writes zeros into the null row 0)."""
        return self._write(pool, kv, jnp.asarray(blocks), jnp.asarray(rows), jnp.int32(count))

    def write_back_units(self, pool: Float[Array, "Ls R 2 bs Hkv hd"], kv: Float[Array, "L NB 2 bs Hkv hd"],
                         units: np.ndarray, layer: int, rows: np.ndarray, count: int) -> Array:
        """units / rows: [n] int32 padded past `count` (padding writes zeros into the null row 0)."""
        return self._write_units(pool, kv, jnp.asarray(units), self._layer(layer)[1], jnp.asarray(rows),
                                 jnp.int32(count))

    def stage_blocks(self, pool: Array, layer: int, rows: np.ndarray) -> Float[Array, "n 2 bs Hkv hd"]:
        return self._stage_blocks(pool, self._layer(layer)[0], rows)  # rows: numpy, put on the host by the call

    def stage_units(self, pool: Array, layer: int, rows: np.ndarray, heads: np.ndarray) -> Float[Array, "n 2 bs hd"]:
        return self._stage_units(pool, self._layer(layer)[0], np.stack([rows, heads]))

    def to_device(self, staging: Array) -> Array:
        """One host-to-device copy (per device, of its heads, under tensor parallelism)."""
        return self._up[5 if staging.ndim == 5 else 1](staging)

    def stage_rows(self, pool: Array, layers: np.ndarray, rows: np.ndarray,
                   heads: np.ndarray | None = None) -> Float[Array, "n 2 bs Hkv hd"] | Float[Array, "n 2 bs hd"]:
        """Entry i = row rows[i] of pool layer layers[i] (with `heads`: its (block, head) unit): a whole step's recall
        in one host gather (index vectors numpy, put on the host by the call)."""
        blocks, units = row_transfers(self.host_scalar, self.mesh)
        if heads is None:
            return blocks(pool, np.stack([layers, rows]))
        return units(pool, np.stack([layers, rows, heads]))

    def fragment_units(self, pool: Array, layer: int, rows: np.ndarray, heads: np.ndarray,
                       count: int) -> Float[Array, "n 2 bs hd"]:
        """rows / heads: [n] padded past `count` with the null row's unit (copied too: a known trip count)."""
        return self._fragment(pool, self._layer(layer)[1], jnp.asarray(rows), jnp.asarray(heads))


@functools.cache
def plain_put_takes_program_outputs(host: jax.sharding.Sharding, dev: jax.sharding.Sharding) -> bool:
    """Whether `jax.device_put` copies an array that a program wrote to pinned host memory up to the device. The
    CPU runtime of jaxlib 0.12 refuses it (UNIMPLEMENTED: Unsupported layout used for PjRt CPU buffers:
    {0:S(5)}); a jitted copy works everywhere. Asked once per pair of shardings, at a single element."""
    made = jax.jit(lambda: jnp.zeros((1,), jnp.int32), out_shardings=host)()
    try:
        jax.block_until_ready(jax.device_put(made, dev))
    except jax.errors.JaxRuntimeError:
        return False
    return True


def _copy_up(how: str, dev: jax.sharding.Sharding):
    """The host-to-device copy of a staging buffer: `device_put` (one DMA, no program) or a jitted identity."""
    if how == "device_put":
        return functools.partial(jax.device_put, device=dev)
    return jax.jit(lambda staging: staging, out_shardings=dev)


@functools.cache
def row_transfers(host: jax.sharding.Sharding, mesh: jax.sharding.Mesh | None = None) -> tuple:
    """The jitted host gathers of a whole step's recall (`XlaHostIO.stage_rows`): (blocks, units), entry i from pool
    layer index[0, i], row index[1, i] (units: head index[2, i]), into one staging buffer in pinned host memory. Under a
    tensor-parallel `mesh` the blocks' gather runs per device on its own KV heads (the units' is single-device only)."""
    on_host = jax.memory.Space.Host

    @compute_on(compute_type="device_host", out_memory_spaces=on_host)
    @jax.jit
    def stage_rows(pool: Array, index: Int[Array, "2 n"]) -> Array:
        return pool.at[index[0], index[1]].get(mode="clip")  # [n, 2, bs, Hkv, hd]

    @compute_on(compute_type="device_host", out_memory_spaces=on_host)
    @jax.jit
    def stage_row_units(pool: Array, index: Int[Array, "3 n"]) -> Array:
        return pool.at[index[0], index[1], :, :, index[2]].get(mode="clip")  # [n, 2, bs, hd]

    def outer(fn):  # (every operand in the host memory space, as transfers' stage_blocks_outer)
        return lambda pool, index: fn(*(jax.device_put(a, on_host) for a in (pool, index)))

    if mesh is None:
        return (jax.jit(outer(stage_rows), in_shardings=(host, host), out_shardings=host),
                jax.jit(outer(stage_row_units), in_shardings=(host, host), out_shardings=host))
    pool_s = NamedSharding(mesh, split_spec(6, 4), memory_kind=HOST_KIND)
    staging_s = NamedSharding(mesh, split_spec(5, 3), memory_kind=HOST_KIND)
    blocks = jax.shard_map(outer(stage_rows), mesh=mesh, in_specs=(split_spec(6, 4), P()),
                           out_specs=split_spec(5, 3), check_vma=False)

    def single_device_only(*_):
        raise ValueError("per-(block, head) host transfers (headwise selection's I/O) run on one device only; use "
                         "selection='solohead' under tensor parallelism")

    return jax.jit(blocks, in_shardings=(pool_s, host), out_shardings=staging_s), single_device_only


@functools.cache
def transfers(host: jax.sharding.Sharding, dev: jax.sharding.Sharding, first_layer: int,
              mesh: jax.sharding.Mesh | None = None) -> tuple:
    """The jitted transfers (write_back, stage_blocks, stage_units, fragment, write_back_units) between a device's
    HBM (`dev`) and its pinned host memory (`host`) for pools whose layer 0 is GPU layer `first_layer`; shared by
    every pool there, so engines reuse the compiles. The shardings place the calls' inputs and outputs; inside,
    memory spaces place values (see the module docstring).

    With a tensor-parallel `mesh` (`host` / `dev` then its replicated shardings) the whole-block transfers run per
    device inside `shard_map`, each on its own KV heads: its slice of the pool in its own pinned host memory, its slice
    of the cache, the same block and row indices on every device, so a recalled block is still one gather and one
    copy per device. The per-(block, head) transfers of the headwise baseline are single-device only (their units mix
    the devices' heads): the engine refuses them under a mesh, and here they raise."""
    on_host, on_device = jax.memory.Space.Host, jax.memory.Space.Device

    def write_back(pool: Array, kv: Array, blocks: Int[Array, " n"], rows: Int[Array, " n"],
                   count: Int[Array, ""]) -> Array:
        staged = kv[first_layer:, blocks]  # [Ls, n, 2, bs, Hkv, hd]: one gather on the device
        pool = jax.device_put(pool, on_host)  # (the traced value's memory space; a no-op for the data)

        def body(i, p):  # one device-to-host copy per block, into its row (padding: zeros into the null row)
            blk = jnp.where(i < count, jax.lax.dynamic_slice_in_dim(staged, i, 1, axis=1), 0)
            return jax.lax.dynamic_update_slice(p, jax.device_put(blk, on_host), (0, rows[i], 0, 0, 0, 0))

        return jax.lax.fori_loop(0, blocks.shape[0], body, pool)

    def write_back_units(pool: Array, kv: Array, units: Int[Array, " n"], layer: Int[Array, ""],
                         rows: Int[Array, " n"], count: Int[Array, ""]) -> Array:
        # one layer's blocks from flat units (layer * NB + block; the layer-segmented prefill), copied as write_back
        staged = kv.reshape(kv.shape[0] * kv.shape[1], *kv.shape[2:])[units]  # [n, 2, bs, Hkv, hd]
        pool = jax.device_put(pool, on_host)

        def body(i, p):
            blk = jnp.where(i < count, jax.lax.dynamic_slice_in_dim(staged, i, 1, axis=0), 0)[None]
            return jax.lax.dynamic_update_slice(p, jax.device_put(blk, on_host), (layer, rows[i], 0, 0, 0, 0))

        return jax.lax.fori_loop(0, units.shape[0], body, pool)

    @compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    @jax.jit
    def stage_blocks(pool: Array, layer: Int[Array, ""], rows: Int[Array, " n"]) -> Array:
        return jax.lax.dynamic_index_in_dim(pool, layer, keepdims=False).at[rows].get(mode="clip")

    def stage_blocks_outer(pool: Array, layer: Int[Array, ""], rows: Int[Array, " n"]) -> Array:
        # every operand of the host computation in the host memory space (an argument in_shardings placed on the
        # host comes in typed as device memory: the host gather then fails on mixed memory spaces); no data moves
        return stage_blocks(*(jax.device_put(a, on_host) for a in (pool, layer, rows)))

    @compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    @jax.jit
    def stage_units(pool: Array, layer: Int[Array, ""], rows_heads: Int[Array, "2 n"]) -> Array:
        p = jax.lax.dynamic_index_in_dim(pool, layer, keepdims=False)  # [R, 2, bs, Hkv, hd]
        return p.at[rows_heads[0], :, :, rows_heads[1]].get(mode="clip")  # [n, 2, bs, hd]

    def stage_units_outer(pool: Array, layer: Int[Array, ""], rows_heads: Int[Array, "2 n"]) -> Array:
        return stage_units(*(jax.device_put(a, on_host) for a in (pool, layer, rows_heads)))  # (as stage_blocks_outer)

    def fragment(pool: Array, layer: Int[Array, ""], rows: Int[Array, " n"], heads: Int[Array, " n"]) -> Array:
        _, _, _, bs, _, hd = pool.shape
        n = rows.shape[0]
        pool = jax.device_put(pool, on_host)

        def body(i, out):  # one host-to-device copy per (block, head) unit
            unit = jax.lax.dynamic_slice(pool, (layer, rows[i], 0, 0, heads[i], 0), (1, 1, 2, bs, 1, hd))
            unit = jax.device_put(unit, on_device).reshape(1, 2, bs, hd)
            return jax.lax.dynamic_update_slice(out, unit, (i, 0, 0, 0))

        return jax.lax.fori_loop(0, n, body, jnp.zeros((n, 2, bs, hd), pool.dtype))

    # the stage calls take their index arrays as numpy and place them in pinned host memory themselves
    # (in_shardings): one call per recall instead of a device_put and a call (~70 us less per recall on CPU)
    if mesh is None:
        placed = (host, host, host)
        return (jax.jit(write_back, donate_argnums=0, out_shardings=host),
                jax.jit(stage_blocks_outer, in_shardings=placed, out_shardings=host),
                jax.jit(stage_units_outer, in_shardings=placed, out_shardings=host),
                jax.jit(fragment, out_shardings=dev),
                jax.jit(write_back_units, donate_argnums=0, out_shardings=host))
    heads6, heads5, rep = split_spec(6, 4), split_spec(5, 3), P()
    pool_s, staging_s = NamedSharding(mesh, heads6, memory_kind=HOST_KIND), NamedSharding(mesh, heads5,
                                                                                          memory_kind=HOST_KIND)

    def per_device(fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def single_device_only(*_):
        raise ValueError("per-(block, head) host transfers (headwise selection's I/O) run on one device only; use "
                         "selection='solohead' under tensor parallelism")

    return (jax.jit(per_device(write_back, (heads6, heads6, rep, rep, rep), heads6), donate_argnums=0,
                    out_shardings=pool_s),
            jax.jit(per_device(stage_blocks_outer, (heads6, rep, rep), heads5), in_shardings=(pool_s, host, host),
                    out_shardings=staging_s),
            single_device_only, single_device_only,
            jax.jit(per_device(write_back_units, (heads6, heads6, rep, rep, rep, rep), heads6), donate_argnums=0,
                    out_shardings=pool_s))
