"""Pinned host KV pool: where an offloaded request's sparse-layer KV lives, plus the transfers in and out.

Layout (the GPU cache's, minus the dense layers):

    pool: [Ls, NHB, 2, bs, Hkv, hd]   on `pinned_host`;  Ls = num_layers - dense_layers (the sparse layers)

Row 0 is the null row (never allocated): padded entries of a transfer read or write it, so transfers keep
a few bucketed shapes without masking. Rows are handed out by a `BlockAllocator`, one row per logical block
of an offloaded request (all Ls layers of it).

Transfers (all asynchronous: they return arrays whose copies may still be in flight):
  - `write_back(kv, gpu_blocks, rows)`: device -> host, sparse layers of whole GPU blocks into rows
    (a block leaving the GPU window, or a prompt spilled after prefill): one gather on the device, one
    device-to-host copy, then a dynamic-update-slice loop computed on the host (XLA's host scatter has
    crashed on pinned_host, openxla/xla#34565; DUS is the supported path). The pool is donated.
  - `gather_blocks(layer, rows)`: host -> device, coalesced whole blocks: gather on the host into one
    contiguous pinned staging buffer `[n, 2, bs, Hkv, hd]`, then ONE host-to-device copy.
  - `gather_units(layer, rows, heads)`: host -> device, coalesced (block, head) units `[n, 2, bs, hd]`
    (headwise selection with the coalesced I/O path): one staging buffer, one copy.
  - `fragment_units(layer, rows, heads)`: host -> device, the per-head offloading baseline: one copy per
    (block, head) unit, issued by XLA from a loop of dynamic slices of the host pool; `[n, 2, bs, hd]`.
Index vectors are padded to powers of two (entries past the real ones point at the null row) so the
number of compiled variants stays logarithmic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on
from jaxtyping import Array, Float, Int

from host_offload.memory import device_sharding, host_sharding
from pulseinfer_jax.kv_cache import BlockAllocator, OutOfBlocksError, bucket

NULL_ROW = 0


def _pad_pow2(*vectors: np.ndarray) -> tuple[np.ndarray, ...]:
    """Pad index vectors with the null row / 0 to the next power of two (bounded number of compiled shapes)."""
    width = bucket(len(vectors[0]))
    return tuple(np.pad(np.asarray(v, np.int32), (0, width - len(v))) for v in vectors)


class HostKVPool:
    """Pinned host rows for offloaded KV blocks (see the module docstring for layout and transfers).

    Contract: rows are allocated per request (`allocate`/`free`, never shared); `write_back` is the only
    writer; reads never modify the pool. `check_integrity()` checks the allocator.
    """

    def __init__(self, *, num_rows: int, first_layer: int, num_layers: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype, device: jax.Device):
        if num_rows < 2:
            raise ValueError(f"host pool num_rows={num_rows} must be >= 2 (row 0 is the null row)")
        self.first_layer = first_layer  # GPU layer of pool layer 0
        self.shape = (num_layers - first_layer, num_rows, 2, block_size, num_kv_heads, head_dim)
        self.dtype = jnp.dtype(dtype)
        self.device = device
        self.host = host_sharding(device)
        self.dev = device_sharding(device)
        self.allocator = BlockAllocator(num_rows)
        # transfers issued (real entries only, padding excluded): the I/O accounting every path shares
        self.h2d_copies = 0
        self.h2d_bytes = 0
        self.d2h_copies = 0
        self.d2h_bytes = 0
        self.pool: Array = jax.jit(lambda: jnp.zeros(self.shape, self.dtype), out_shardings=self.host)()
        # shared by every pool on this device (engines reuse the compiled transfers)
        self._write, self._gather_blocks, self._gather_units, self._fragment = _transfers(device, first_layer)

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return self.shape[1]

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer (every head's K and V): the SoloHead transfer unit."""
        return int(np.prod(self.shape[2:])) * self.dtype.itemsize

    @property
    def unit_bytes(self) -> int:
        """Bytes of one (block, head) of one layer: the headwise transfer unit."""
        return self.layer_block_bytes // self.shape[4]

    @property
    def total_bytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    # ---- rows ----------------------------------------------------------------------------------
    def allocate(self, n: int, owner: int) -> list[int]:
        try:
            return self.allocator.allocate(n, owner)
        except OutOfBlocksError as e:
            raise OutOfBlocksError(f"host KV pool: {e}; raise host_kv_tokens") from None

    def free(self, rows: list[int], owner: int) -> None:
        self.allocator.free(rows, owner)

    def check_integrity(self) -> None:
        self.allocator.check_integrity()

    # ---- transfers -----------------------------------------------------------------------------
    def write_back(self, kv: Float[Array, "L NB 2 bs Hkv hd"], gpu_blocks: list[int], rows: list[int]) -> None:
        """Copy the sparse layers of GPU blocks `gpu_blocks` into host rows `rows` (asynchronous)."""
        if not gpu_blocks:
            return
        if len(gpu_blocks) != len(rows) or NULL_ROW in rows:
            raise ValueError(f"write_back needs one non-null row per block, got {gpu_blocks=} {rows=}")
        blocks, dst = _pad_pow2(gpu_blocks, rows)
        self.d2h_copies += 1
        self.d2h_bytes += len(rows) * self.shape[0] * self.layer_block_bytes
        self.pool = self._write(self.pool, kv, jnp.asarray(blocks), jax.device_put(dst, self.host),
                                jnp.int32(len(rows)))

    def gather_blocks(self, layer: int, rows: list[int]) -> Float[Array, "n 2 bs Hkv hd"]:
        """Whole blocks of pool layer `layer`, padded to a power of two: one host gather + one H2D copy."""
        (r,) = _pad_pow2(rows)
        self.h2d_copies += 1
        self.h2d_bytes += len(rows) * self.layer_block_bytes
        staging = self._gather_blocks(self.pool, jax.device_put(np.int32(layer), self.host),
                                      jax.device_put(r, self.host))
        return jax.device_put(staging, self.dev)

    def gather_units(self, layer: int, rows: list[int], heads: list[int]) -> Float[Array, "n 2 bs hd"]:
        """(block, head) units of pool layer `layer`, padded: one host gather + one H2D copy."""
        r, h = _pad_pow2(rows, heads)
        self.h2d_copies += 1
        self.h2d_bytes += len(rows) * self.unit_bytes
        staging = self._gather_units(self.pool, jax.device_put(np.int32(layer), self.host),
                                     jax.device_put(r, self.host), jax.device_put(h, self.host))
        return jax.device_put(staging, self.dev)

    def fragment_units(self, layer: int, rows: list[int], heads: list[int]) -> Float[Array, "n 2 bs hd"]:
        """(block, head) units of pool layer `layer`, padded: one host-to-device copy per real unit."""
        r, h = _pad_pow2(rows, heads)
        self.h2d_copies += len(rows)
        self.h2d_bytes += len(rows) * self.unit_bytes
        return self._fragment(self.pool, jnp.int32(layer), jnp.asarray(r), jnp.asarray(h), jnp.int32(len(rows)))

    def read(self, layer: int, row: int) -> np.ndarray:
        """One row of pool layer `layer` as numpy [2, bs, Hkv, hd] (tests, debugging; synchronous)."""
        return np.asarray(jax.device_get(self.pool))[layer, row]



@functools.cache
def _transfers(device: jax.Device, first_layer: int) -> tuple:
    """The jitted transfer functions for pools on `device` (write_back, gather_blocks, gather_units, fragment)."""
    host, dev = host_sharding(device), device_sharding(device)

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
    def gather_blocks(pool: Array, layer: Int[Array, ""], rows: Int[Array, " n"]) -> Array:
        return jax.lax.dynamic_index_in_dim(pool, layer, keepdims=False).at[rows].get(mode="clip")

    @compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    @jax.jit
    def gather_units(pool: Array, layer: Int[Array, ""], rows: Int[Array, " n"], heads: Int[Array, " n"]) -> Array:
        p = jax.lax.dynamic_index_in_dim(pool, layer, keepdims=False)  # [NHB, 2, bs, Hkv, hd]
        return p.at[rows, :, :, heads].get(mode="clip")  # [n, 2, bs, hd]

    def fragment(pool: Array, layer: Int[Array, ""], rows: Int[Array, " n"], heads: Int[Array, " n"],
                 count: Int[Array, ""]) -> Array:
        _, _, _, bs, _, hd = pool.shape
        n = rows.shape[0]

        def body(i, out):
            unit = jax.lax.dynamic_slice(pool, (layer, rows[i], 0, 0, heads[i], 0), (1, 1, 2, bs, 1, hd))
            return out.at[i].set(jax.device_put(unit, dev).reshape(2, bs, hd))  # one H2D copy per unit

        out = jnp.zeros((n, 2, bs, hd), pool.dtype, device=dev)
        return jax.lax.fori_loop(0, count, body, out)

    return (jax.jit(write_back, donate_argnums=0, out_shardings=host), jax.jit(gather_blocks, out_shardings=host),
            jax.jit(gather_units, out_shardings=host), jax.jit(fragment, out_shardings=dev))
