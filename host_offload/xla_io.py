"""Host I/O backend "xla": the pool is a jax array on `pinned_host`, host gathers are XLA host computations.

This is PulseInfer's intended path on a GPU: the pool is page-locked DRAM the GPU's copy engines read
directly; a coalesced recall gathers the selected blocks on the host (`compute_on("device_host")`) into one
pinned staging buffer and moves it with one asynchronous `device_put`. Every call is asynchronous.

  - write_back: one gather of the blocks on the device, one device-to-host copy, then a dynamic-update-slice
    loop computed on the host (XLA's host scatter has crashed on pinned_host, openxla/xla#34565; DUS is the
    supported path). The pool is donated.
  - stage_blocks / stage_units: the host gather into a pinned staging buffer (indices clipped: `fill` breaks
    with a memory-space mismatch); `to_device`: the one host-to-device copy.
  - fragment_units: one host-to-device copy per (block, head) unit, issued by XLA from a loop of dynamic
    slices of the host pool (XLA turns host->device dynamic slices into copies).

On the CPU backend the same code runs on the emulated memory kinds (the tests); whether a GPU's XLA accepts
all of it is checked at start-up by `host_pool.probe_host_io` (the engine falls back to "numpy" if not).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on
from jaxtyping import Array, Float, Int

from host_offload.memory import device_sharding, host_sharding
from pulseinfer_jax.kv_cache import zeros_on


class XlaHostIO:
    name = "xla"

    def __init__(self, device: jax.Device, first_layer: int):
        self.host, self.dev = host_sharding(device), device_sharding(device)
        self._write, self._stage_blocks, self._stage_units, self._fragment = transfers(self.host, self.dev,
                                                                                       first_layer)
        self._layers: dict[int, tuple[Array, Array]] = {}  # pool layer -> its index on the host and on the device

    def _layer(self, layer: int) -> tuple[Array, Array]:
        """Pool layer `layer` as an int32 scalar on the host and on the device, made once (no copy per call)."""
        if layer not in self._layers:
            v = np.int32(layer)
            self._layers[layer] = (jax.device_put(v, self.host), jax.device_put(v, self.dev))
        return self._layers[layer]

    # ---- storage -------------------------------------------------------------------------------
    def zeros(self, shape: tuple[int, ...], dtype) -> Array:
        return zeros_on(shape, dtype, self.host)

    def load(self, data: np.ndarray) -> Array:
        return jax.block_until_ready(jax.device_put(data, self.host))

    def to_numpy(self, pool: Array) -> np.ndarray:
        return np.asarray(jax.device_get(pool))

    # ---- transfers -----------------------------------------------------------------------------
    def write_back(self, pool: Float[Array, "Ls R 2 bs Hkv hd"], kv: Float[Array, "L NB 2 bs Hkv hd"],
                   blocks: np.ndarray, rows: np.ndarray, count: int) -> Array:
        """blocks / rows: [n] int32 padded (past `count`: block 0 into the null row)."""
        return self._write(pool, kv, jnp.asarray(blocks), jax.device_put(rows, self.host), jnp.int32(count))

    def stage_blocks(self, pool: Array, layer: int, rows: np.ndarray) -> Float[Array, "n 2 bs Hkv hd"]:
        return self._stage_blocks(pool, self._layer(layer)[0], rows)  # rows: numpy, put on the host by the call

    def stage_units(self, pool: Array, layer: int, rows: np.ndarray, heads: np.ndarray) -> Float[Array, "n 2 bs hd"]:
        return self._stage_units(pool, self._layer(layer)[0], np.stack([rows, heads]))

    def to_device(self, staging: Array) -> Array:
        return jax.device_put(staging, self.dev)

    def fragment_units(self, pool: Array, layer: int, rows: np.ndarray, heads: np.ndarray,
                       count: int) -> Float[Array, "n 2 bs hd"]:
        return self._fragment(pool, self._layer(layer)[1], jnp.asarray(rows), jnp.asarray(heads), jnp.int32(count))


@functools.cache
def transfers(host: jax.sharding.Sharding, dev: jax.sharding.Sharding, first_layer: int) -> tuple:
    """The jitted transfers (write_back, stage_blocks, stage_units, fragment) between a device's HBM (`dev`) and its
    pinned host memory (`host`) for pools whose layer 0 is GPU layer `first_layer`; shared by every pool there, so
    engines reuse the compiles. (Shardings, not a device: the ahead-of-time check builds them for compile-only
    devices, pulseinfer_jax/aot.)"""

    @compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    @jax.jit
    def scatter_rows(pool, staged, rows, count):
        def body(i, p):
            blk = jax.lax.dynamic_slice_in_dim(staged, i, 1, axis=1)
            return jax.lax.dynamic_update_slice(p, blk, (0, rows[i], 0, 0, 0, 0))

        return jax.lax.fori_loop(0, count, body, pool)

    def write_back(pool: Array, kv: Array, blocks: Int[Array, " n"], rows: Int[Array, " n"],
                   count: Int[Array, ""]) -> Array:
        staged = jax.device_put(kv[first_layer:, blocks], host)  # [Ls, n, 2, bs, Hkv, hd]: one D2H copy
        # the pool already lives on pinned_host; the explicit put gives its traced value the host memory space,
        # which compute_on's dynamic_update_slice requires of all operands (it fails without)
        return scatter_rows(jax.device_put(pool, host), staged, jax.device_put(rows, host),
                            jax.device_put(count, host))

    @compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    @jax.jit
    def stage_blocks(pool: Array, layer: Int[Array, ""], rows: Int[Array, " n"]) -> Array:
        return jax.lax.dynamic_index_in_dim(pool, layer, keepdims=False).at[rows].get(mode="clip")

    def stage_blocks_outer(pool: Array, layer: Int[Array, ""], rows: Int[Array, " n"]) -> Array:
        # the traced values get the host memory space explicitly (a pool no write-back has touched yet comes in
        # without it, and so do the arguments in_shardings placed on the host: the host gather then fails on mixed
        # memory spaces); a no-op for the data
        return stage_blocks(*(jax.device_put(a, host) for a in (pool, layer, rows)))

    @compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    @jax.jit
    def stage_units(pool: Array, layer: Int[Array, ""], rows_heads: Int[Array, "2 n"]) -> Array:
        p = jax.lax.dynamic_index_in_dim(pool, layer, keepdims=False)  # [R, 2, bs, Hkv, hd]
        return p.at[rows_heads[0], :, :, rows_heads[1]].get(mode="clip")  # [n, 2, bs, hd]

    def stage_units_outer(pool: Array, layer: Int[Array, ""], rows_heads: Int[Array, "2 n"]) -> Array:
        return stage_units(*(jax.device_put(a, host) for a in (pool, layer, rows_heads)))  # (as stage_blocks_outer)

    def fragment(pool: Array, layer: Int[Array, ""], rows: Int[Array, " n"], heads: Int[Array, " n"],
                 count: Int[Array, ""]) -> Array:
        _, _, _, bs, _, hd = pool.shape
        n = rows.shape[0]

        def body(i, out):
            unit = jax.lax.dynamic_slice(pool, (layer, rows[i], 0, 0, heads[i], 0), (1, 1, 2, bs, 1, hd))
            return out.at[i].set(jax.device_put(unit, dev).reshape(2, bs, hd))  # one H2D copy per unit

        out = jnp.zeros((n, 2, bs, hd), pool.dtype, device=dev)
        return jax.lax.fori_loop(0, count, body, out)

    # the stage calls take their index arrays as numpy and place them in pinned host memory themselves
    # (in_shardings): one call per recall instead of a device_put and a call (~70 us less per recall on CPU)
    on_host = (host, host, host)
    return (jax.jit(write_back, donate_argnums=0, out_shardings=host),
            jax.jit(stage_blocks_outer, in_shardings=on_host, out_shardings=host),
            jax.jit(stage_units_outer, in_shardings=on_host, out_shardings=host), jax.jit(fragment, out_shardings=dev))
