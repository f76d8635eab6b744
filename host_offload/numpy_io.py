"""Host I/O backend "numpy": the pool is a numpy array in ordinary (pageable) host RAM.

The fallback where the "xla" backend (pinned_host memory + XLA host computations) does not compile or run
on a device: the same transfers, counted the same way, through the most portable JAX calls there are.

  - write_back (and write_back_units, one layer's blocks read from flat units): one gather of the blocks on the
    device, `copy_to_host_async()` (one device-to-host copy), queued; queued writes land in the numpy pool (numpy
    assignment) before the next read of the pool, so a block written back this step can be recalled this step.
  - stage_blocks / stage_units: numpy fancy indexing gathers the selected blocks into one fresh contiguous
    staging array; `to_device`: ONE `jax.device_put` of it (PJRT copies pageable memory through its own
    pinned bounce buffer: expect a lower bandwidth than from pinned memory, which `bench/io_sweep.py
    --host-io` measures).
  - fragment_units: one `jax.device_put` per (block, head) unit, stacked on the device.

Every staging array is freshly allocated and never written again: on the CPU backend `device_put` of a numpy
array may alias its memory, so nothing handed to it may change afterwards. The gathers may run on the pool's recall
thread (`recall_thread.py`) while the driver queues write-backs: one lock orders every access to the queue and the
pool's data.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from pulseinfer_jax.parallel.layout import DeviceLayout

MAX_QUEUED_WRITES = 64  # queued write-backs are landed at the latest after this many (bounds their memory)


class NumpyHostIO:
    name = "numpy"
    host_gather = True  # (numpy gathers: host code, run on the recall thread when started ahead)

    def __init__(self, device: jax.Device | DeviceLayout, first_layer: int):
        self.layout = layout = DeviceLayout.on(device)
        self.dev = layout.kv_heads(5, "device")  # staging [n, 2, bs, Hkv, hd]: split by KV head under tensor parallel
        self.unit_dev = layout.replicated("device")
        self._stage_on_device = _device_gather(first_layer)
        # (staged [Ls, n, ...] or [n, ...], rows, pool, pool layer: None = every sparse layer)
        self._queued: list[tuple[jax.Array, np.ndarray, np.ndarray, int | None]] = []
        self._lock = threading.RLock()  # the queue and the pool's data: the driver's thread and the recall thread

    # ---- storage -------------------------------------------------------------------------------
    def zeros(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        return np.zeros(shape, jnp.dtype(dtype))  # calloc: pages are touched only when written

    def load(self, data: np.ndarray) -> np.ndarray:
        with self._lock:
            self._queued.clear()
        return np.array(data, copy=True)

    def to_numpy(self, pool: np.ndarray) -> np.ndarray:
        self.land()
        return pool

    def land(self, queued: list | None = None) -> None:
        """Write every queued write-back (or those of `queued`, taken off the queue before) into its pool (waits
        for their device-to-host copies)."""
        with self._lock:
            if queued is None:
                queued, self._queued = self._queued, []
            for staged, rows, pool, layer in queued:
                if layer is None:
                    pool[:, rows] = np.asarray(staged)[:, : len(rows)]
                else:
                    pool[layer, rows] = np.asarray(staged)[: len(rows)]

    # ---- transfers -----------------------------------------------------------------------------
    def write_back(self, pool: Float[np.ndarray, "Ls R 2 bs Hkv hd"], kv: Float[Array, "L NB 2 bs Hkv hd"],
                   blocks: np.ndarray, rows: np.ndarray, count: int) -> np.ndarray:
        """blocks / rows: [n] int32 padded past `count` (padding is not written)."""
        staged = self._stage_on_device(kv, jnp.asarray(blocks))  # [Ls, n, 2, bs, Hkv, hd] on the device
        staged.copy_to_host_async()
        self._queue(staged, rows[:count], pool, None)
        return pool

    def write_back_units(self, pool: Float[np.ndarray, "Ls R 2 bs Hkv hd"], kv: Float[Array, "L NB 2 bs Hkv hd"],
                         units: np.ndarray, layer: int, rows: np.ndarray, count: int) -> np.ndarray:
        """One pool layer's blocks from flat units of the cache; units / rows padded past `count` (not written)."""
        staged = _unit_gather(kv, jnp.asarray(units))  # [n, 2, bs, Hkv, hd] on the device
        staged.copy_to_host_async()
        self._queue(staged, rows[:count], pool, layer)
        return pool

    def _queue(self, staged: jax.Array, rows: np.ndarray, pool: np.ndarray, layer: int | None) -> None:
        with self._lock:
            self._queued.append((staged, np.array(rows), pool, layer))
            if len(self._queued) >= MAX_QUEUED_WRITES:
                self.land()

    def stage_blocks(self, pool: np.ndarray, layer: int, rows: np.ndarray) -> np.ndarray:
        return self.staging_job(pool, layer, rows)()

    def stage_units(self, pool: np.ndarray, layer: int, rows: np.ndarray, heads: np.ndarray) -> np.ndarray:
        return self.staging_job(pool, layer, rows, heads)()

    def staging_job(self, pool: np.ndarray, layer: int | np.ndarray, rows: np.ndarray, heads: np.ndarray | None = None):
        """`stage_blocks` (or, with `heads`, `stage_units`) to run later, on another thread: it sees the write-backs
        queued until now and none queued after (it takes them off the queue now and lands them first). `layer`: one
        pool layer, or one per entry (a whole step's recall: entry i from pool layer layer[i])."""
        writes = self.take_writes()
        if np.ndim(layer) == 0:
            src, at = (lambda: pool[layer]), rows
        else:
            src, at = (lambda: flat_rows(pool)), np.asarray(layer, np.int64) * pool.shape[1] + rows

        def job() -> np.ndarray:
            with self._lock:
                self.land(writes)
                if heads is None:
                    return self._gather_blocks(src(), at)
                return src()[at, :, :, heads]  # [n, 2, bs, hd], a fresh contiguous array
        return job

    def _gather_blocks(self, layer: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return np.take(layer, rows, axis=0)  # [n, 2, bs, Hkv, hd], a fresh contiguous array

    def take_writes(self) -> list:
        with self._lock:
            queued, self._queued = self._queued, []
            return queued

    def to_device(self, staging: np.ndarray) -> Array:
        return jax.device_put(staging, self.dev if staging.ndim == 5 else self.unit_dev)

    def h2d_source(self, nbytes: int) -> np.ndarray:
        """Bytes in the host memory a recall copies from (`HostKVPool.measure_h2d`)."""
        return self.zeros((nbytes,), np.uint8)

    def fragment_units(self, pool: np.ndarray, layer: int, rows: np.ndarray, heads: np.ndarray,
                       count: int) -> Float[Array, "n 2 bs hd"]:
        with self._lock:
            self.land()
            units = [jax.device_put(np.array(pool[layer, r, :, :, h], copy=True), self.unit_dev)
                     for r, h in zip(rows[:count], heads[:count], strict=True)]  # one copy per unit
        if len(rows) > count:
            units += [jnp.zeros(pool.shape[2:4] + pool.shape[5:], pool.dtype, device=self.unit_dev)] * (
                len(rows) - count)
        return jnp.stack(units)


def flat_rows(pool: Float[np.ndarray, "Ls R 2 bs Hkv hd"]) -> Float[np.ndarray, "LsR 2 bs Hkv hd"]:
    """The pool's rows of every layer as one axis (pool layer l, row r at l * R + r): a view, never a copy."""
    if not pool.flags.c_contiguous:
        raise ValueError("the host pool must be one C-contiguous array (a flat view of its rows would copy it)")
    return pool.reshape(-1, *pool.shape[2:])


@jax.jit
def _unit_gather(kv: Float[Array, "L NB 2 bs Hkv hd"], units: Array) -> Array:
    return kv.reshape(kv.shape[0] * kv.shape[1], *kv.shape[2:])[units]


@functools.cache
def _device_gather(first_layer: int):
    return jax.jit(lambda kv, blocks: kv[first_layer:, blocks])
