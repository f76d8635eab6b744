"""Host I/O backend "numpy-pinned": the numpy pool, its whole-block recalls gathered straight into pinned memory.

The "numpy" backend's recall is a numpy gather into a fresh pageable array, then `jax.device_put`, which makes PJRT
copy those bytes once more, into its own pinned bounce buffer, before the DMA. Here the gather writes into a
staging buffer that already lives in pinned host memory (a jax array on `pinned_host`, written in place through a
numpy view of each device's shard), and the copy to the device is a `device_put` between two memory spaces of the
same device: the DMA reads the staging directly, with no second host copy.

Staging buffers come from a ring per (shape, dtype): a buffer is written again only once the device copy made from it
has finished. The ring takes the oldest buffer if its copy is done and otherwise adds one (up to MAX_STAGING per
shape, then it waits for the oldest: the recall thread waits, the driver never does), so the gathers never wait for
copies in flight, which on a GPU may start only after the work queued before them. A staging returned by
`stage_blocks` and not copied is reused by the next gather of its shape.

The engine picks this backend for a GPU with recall ahead only if `host_pool.probe_host_io` passes for it (every
transfer bit for bit, and a staging rewritten after its copy leaves the copy unchanged); (block, head) units and
the per-head baseline stay on the "numpy" path.
"""

from __future__ import annotations

import collections
import ctypes

import jax
import numpy as np
from jaxtyping import Array, Float
from pulseinfer_jax.host_offload.memory import HOST_KIND
from pulseinfer_jax.host_offload.numpy_io import NumpyHostIO

from pulseinfer_jax.parallel.layout import DeviceLayout

MAX_STAGING = 32  # staging buffers per shape at most (a step's sparse layers of copies in flight)


def writable_view(shard: jax.Array) -> np.ndarray:
    """A numpy array over a single-device host array's own memory (writes land in the array, bypassing JAX)."""
    raw = (ctypes.c_char * shard.nbytes).from_address(shard.unsafe_buffer_pointer())
    return np.frombuffer(raw, shard.dtype).reshape(shard.shape)


class _Slot:
    """One staging buffer: the pinned array, a writable view of each device's shard (with the shard's index into
    the whole), and the device copy last made from it."""

    def __init__(self, shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding):
        self.array = jax.device_put(np.zeros(shape, dtype), sharding).block_until_ready()  # (no write in flight)
        self.views = [(writable_view(s.data), s.index) for s in self.array.addressable_shards]
        self.copy: Array | None = None


class PinnedStaging:
    """Rings of pinned staging buffers [n, 2, bs, Hkv, hd] (split by KV head like the device's cache)."""

    def __init__(self, host: jax.sharding.Sharding, device: jax.sharding.Sharding):
        self.host, self.device = host, device
        self._rings: dict[tuple, collections.deque[_Slot]] = {}  # oldest first
        self._by_array: dict[int, _Slot] = {}  # id(staging array) -> its slot (for `put`)

    def gather(self, layer: Float[np.ndarray, "R 2 bs Hkv hd"], rows: np.ndarray) -> jax.Array:
        """`layer[rows]` written into a staging buffer of its shape whose last copy has finished."""
        slot = self._free_slot((len(rows), *layer.shape[1:]), layer.dtype)
        for view, index in slot.views:  # each device's KV heads into its own shard
            self.take_rows(layer[(slice(None), *index[1:])], rows, view)
        return slot.array

    def _free_slot(self, shape: tuple[int, ...], dtype: np.dtype) -> _Slot:
        """From the ring of (shape, dtype): the oldest buffer if its copy is done, else a new one (at most MAX_STAGING:
        then the oldest, waited for); moved to the ring's end."""
        ring = self._rings.setdefault((shape, dtype.str), collections.deque())
        if ring and (ring[0].copy is None or ring[0].copy.is_ready() or len(ring) >= MAX_STAGING):
            slot = ring.popleft()
            if slot.copy is not None:
                slot.copy.block_until_ready()  # the DMA reading this buffer is done before it is overwritten
                slot.copy = None
        else:
            slot = _Slot(shape, dtype, self.host)
            self._by_array[id(slot.array)] = slot
        ring.append(slot)
        return slot

    def buffers(self) -> int:
        """Staging buffers made so far (every shape)."""
        return len(self._by_array)

    @staticmethod
    def take_rows(layer: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        """out[:] = layer[rows], rows checked first (then mode "clip": numpy's "raise" gathers into a temporary and
        copies it, about half the speed, bench/host_gather.py)."""
        if len(rows) and (rows.min() < 0 or rows.max() >= len(layer)):
            raise IndexError(f"pool rows {rows.min()}..{rows.max()} out of range for a pool of {len(layer)} rows")
        np.take(layer, rows, axis=0, out=out, mode="clip")

    def put(self, staging: jax.Array) -> Array:
        """One copy of a staging buffer to the device (pinned host -> device memory, no bounce)."""
        out = jax.device_put(staging, self.device)
        self._by_array[id(staging)].copy = out
        return out

    def owns(self, staging) -> bool:
        return isinstance(staging, jax.Array) and id(staging) in self._by_array


class PinnedNumpyHostIO(NumpyHostIO):
    name = "numpy-pinned"

    def __init__(self, device: jax.Device | DeviceLayout, first_layer: int):
        super().__init__(device, first_layer)
        self.staging = PinnedStaging(self.layout.kv_heads(5, HOST_KIND), self.dev)

    def _gather_blocks(self, layer: np.ndarray, rows: np.ndarray) -> jax.Array:
        return self.staging.gather(layer, rows)

    def to_device(self, staging) -> Array:
        if self.staging.owns(staging):
            return self.staging.put(staging)
        return super().to_device(staging)  # (block, head) units: numpy, through PJRT's bounce buffer

    def h2d_source(self, nbytes: int) -> jax.Array:
        return jax.device_put(np.zeros(nbytes, np.uint8), self.layout.replicated(HOST_KIND))
