"""Host KV pool: where an offloaded request's sparse-layer KV lives, plus the transfers in and out.

Layout (the GPU cache's, minus the dense layers):

    pool: [Ls, R, 2, bs, Hkv, hd]   in host memory;  Ls = num_layers - dense_layers (the sparse layers)

(float8 KV, kv/quant.py: uint8 bytes, bs + ceil(2 bs / hd) rows, the last ones holding the scales, moved with the
block bit for bit.)

Row 0 is the null row (never allocated): padded entries of a transfer read it, so transfers keep a few
bucketed shapes without masking. Rows are handed out by a `BlockAllocator`, one row per logical block of an
offloaded request (all Ls layers of it); with `row_align` > 1 (two-level scoring) by an `ExtentAllocator`, in
aligned extents of that many rows.

Transfers (all asynchronous: they return arrays whose copies may still be in flight):
  - `write_back(kv, gpu_blocks, rows)`: device -> host, sparse layers of whole GPU blocks into rows (a block
    leaving the GPU window, or a prompt spilled after prefill): one device gather, one device-to-host copy.
  - `write_back_units(kv, units, rows, layer)`: device -> host, one pool layer of flat cache units (layer * NB +
    block) into rows: a prompt's layer as the layer-segmented prefill computes it.
  - `gather_blocks(layer, rows)`: host -> device, coalesced whole blocks: a host gather into one contiguous
    staging buffer `[n, 2, bs, Hkv, hd]` (`stage_blocks`), then ONE host-to-device copy.
  - `gather_units(layer, rows, heads)`: host -> device, coalesced (block, head) units `[n, 2, bs, hd]`
    (headwise selection with the coalesced I/O path): one staging buffer, one copy.
  - `fragment_units(layer, rows, heads)`: host -> device, the per-head offloading baseline: one copy per
    (block, head) unit; `[n, 2, bs, hd]`.
  - `recall_blocks` / `recall_units`: `gather_blocks` / `gather_units` started, as a `Recall`: where the backend
    gathers in host code ("numpy") on the pool's recall thread (`recall_thread.py`), so the caller goes on at once;
    otherwise made on the spot.
Index vectors are padded to powers of two so the number of compiled variants stays logarithmic.

The backends of `HOST_IO` move the bytes (the accounting above is the pool's, the same for every one):
  - "xla" (`xla_io.py`): the pool on `pinned_host`, host gathers as XLA host computations: the intended path;
  - "numpy" (`numpy_io.py`): the pool in pageable RAM, numpy gathers, plain `device_put`s: no GPU program
    in the recall, so a recall on the recall thread overlaps the GPU's step, and the fallback where the others fail
    their start-up check (`probe_host_io`);
  - "numpy-pinned" (`pinned_staging.py`): "numpy" with whole blocks gathered straight into pinned staging buffers,
    so the copy to the device reads them directly (no bounce copy): the engine's `host_io="auto"` with recall ahead
    on a GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float
from pulseinfer_jax.host_offload.numpy_io import NumpyHostIO
from pulseinfer_jax.host_offload.pinned_staging import PinnedNumpyHostIO
from pulseinfer_jax.host_offload.recall_thread import Recall, RecallThread
from pulseinfer_jax.host_offload.xla_io import XlaHostIO

from pulseinfer_jax.kv.blocks import BlockAllocator, ExtentAllocator, OutOfBlocksError, bucket
from pulseinfer_jax.kv.quant import block_rows
from pulseinfer_jax.parallel.layout import DeviceLayout

NULL_ROW = 0
HOST_IO = {"xla": XlaHostIO, "numpy": NumpyHostIO, "numpy-pinned": PinnedNumpyHostIO}


def _pad_pow2(*vectors: np.ndarray, at_least: int = 0) -> tuple[np.ndarray, ...]:
    """Pad index vectors with the null row / 0 to the next power of two of their length (or of `at_least`, if more):
    a bounded number of compiled shapes."""
    width = bucket(max(len(vectors[0]), at_least))
    out = np.zeros((len(vectors), width), np.int32)  # (np.pad costs ~10x this per call: it runs every layer)
    for o, v in zip(out, vectors, strict=True):
        o[: len(v)] = v
    return tuple(out)


class HostKVPool:
    """Host rows for offloaded KV blocks (see the module docstring for layout, transfers and backends).

    Contract: rows are allocated per request (`allocate`/`free`, never shared); `write_back` is the only
    writer; reads never modify the pool. `check_integrity()` checks the allocator.
    """

    def __init__(self, *, num_rows: int, first_layer: int, num_layers: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype, device: jax.Device | DeviceLayout, io: str = "xla", row_align: int = 1):
        if num_rows < 2:
            raise ValueError(f"host pool num_rows={num_rows} must be >= 2 (row 0 is the null row)")
        if io not in HOST_IO:
            raise ValueError(f"host pool io={io!r}; use one of {', '.join(HOST_IO)}")
        self.first_layer = first_layer  # GPU layer of pool layer 0
        rows = block_rows(block_size, head_dim, dtype)  # (float8: more, the scales)
        self.shape = (num_layers - first_layer, num_rows, 2, rows, num_kv_heads, head_dim)
        self.dtype = jnp.dtype(dtype)
        # under tensor parallelism (`device` a DeviceLayout over several devices) the pool is split by KV head, each
        # device's heads in its own host memory, and every whole-block transfer runs on each device for its heads
        self.layout = DeviceLayout.on(device)
        self.device = self.layout.device
        self.io = HOST_IO[io](self.layout, first_layer)
        self.row_align = row_align  # rows go out in aligned extents of this many (two-level scoring's groups)
        self.reset_allocator()
        # transfers issued (real entries only, padding excluded): the I/O accounting every path shares
        self.h2d_copies = 0
        self.h2d_bytes = 0
        self.d2h_copies = 0
        self.d2h_bytes = 0
        self.pool = self.io.zeros(self.shape, self.dtype)  # the backend's storage (jax array or numpy)
        self._thread: RecallThread | None = None  # made at the first recall of a host-code backend

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def io_name(self) -> str:
        return self.io.name

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

    def reset_allocator(self) -> None:
        """Every row free again (a new run over the same pool)."""
        n, a = self.num_rows, self.row_align
        self.allocator = BlockAllocator(n) if a == 1 else ExtentAllocator(n, a)

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
        self.pool = self.io.write_back(self.pool, kv, blocks, dst, len(rows))

    def write_back_units(self, kv: Float[Array, "L NB 2 bs Hkv hd"], units: list[int], rows: list[int],
                         layer: int) -> None:
        """Copy flat units `units` (layer * NB + block) of the cache into host rows `rows` of pool layer `layer`
        (asynchronous): one layer of a prompt as the layer-segmented prefill computes it."""
        if not units:
            return
        if len(units) != len(rows) or NULL_ROW in rows:
            raise ValueError(f"write_back_units needs one non-null row per unit, got {units=} {rows=}")
        if not 0 <= layer < self.shape[0]:
            raise ValueError(f"pool layer {layer} is outside [0, {self.shape[0]})")
        src, dst = _pad_pow2(units, rows)
        self.d2h_copies += 1
        self.d2h_bytes += len(rows) * self.layer_block_bytes
        self.pool = self.io.write_back_units(self.pool, kv, src, layer, dst, len(rows))

    def stage_blocks(self, layer: int, rows: list[int]):
        """The host half of `gather_blocks`: the blocks gathered into one host staging buffer, padded
        [n, 2, bs, Hkv, hd] (a jax array on pinned_host, or numpy; "numpy-pinned": a buffer of its ring, reused by a
        later gather of its shape once it is copied or if it never is); nothing is counted."""
        (r,) = _pad_pow2(rows)
        self.sync()
        return self.io.stage_blocks(self.pool, layer, r)

    def to_device(self, staging) -> Array:
        """One host-to-device copy of a staging buffer (the other half of `gather_blocks`; not counted)."""
        return self.io.to_device(staging)

    def gather_blocks(self, layer: int, rows: list[int]) -> Float[Array, "n 2 bs Hkv hd"]:
        """Whole blocks of pool layer `layer`, padded to a power of two: one host gather + one H2D copy."""
        self.h2d_copies += 1
        self.h2d_bytes += len(rows) * self.layer_block_bytes
        return self.io.to_device(self.stage_blocks(layer, rows))

    def gather_units(self, layer: int, rows: list[int], heads: list[int]) -> Float[Array, "n 2 bs hd"]:
        """(block, head) units of pool layer `layer`, padded: one host gather + one H2D copy."""
        r, h = _pad_pow2(rows, heads)
        self.h2d_copies += 1
        self.h2d_bytes += len(rows) * self.unit_bytes
        self.sync()
        return self.io.to_device(self.io.stage_units(self.pool, layer, r, h))

    @property
    def recalls_off_thread(self) -> bool:
        """Whether `recall_blocks` / `recall_units` gather on the recall thread (a backend gathering in host code)."""
        return self.io.host_gather

    def recall_blocks(self, layer: int, rows: list[int]) -> Recall:
        """`gather_blocks`, started (counted now): on the recall thread where `recalls_off_thread`, else made here."""
        if not self.io.host_gather:
            return Recall(made=self.gather_blocks(layer, rows))
        self.h2d_copies += 1
        self.h2d_bytes += len(rows) * self.layer_block_bytes
        (r,) = _pad_pow2(rows)
        return self._submit(self.io.staging_job(self.pool, layer, r))

    def recall_units(self, layer: int, rows: list[int], heads: list[int]) -> Recall:
        """`gather_units`, started (counted now): on the recall thread where `recalls_off_thread`, else made here."""
        if not self.io.host_gather:
            return Recall(made=self.gather_units(layer, rows, heads))
        self.h2d_copies += 1
        self.h2d_bytes += len(rows) * self.unit_bytes
        r, h = _pad_pow2(rows, heads)
        return self._submit(self.io.staging_job(self.pool, layer, r, h))

    def recall_step(self, layers: np.ndarray, rows: np.ndarray, heads: np.ndarray | None = None, *,
                    at_least: int = 0) -> Recall:
        """A whole decode step's recall at once: entry i is row `rows[i]` of pool layer `layers[i]` (whole blocks; with
        `heads`, the (block, head) unit of head `heads[i]`), gathered into ONE staging buffer of a power of two entries
        (at least `at_least`; padding: the null row of layer 0) and sent up in ONE host-to-device copy; started
        (counted now) as a `Recall`, on the recall thread where `recalls_off_thread`."""
        if len(rows) and (np.min(rows) <= NULL_ROW or np.max(rows) >= self.num_rows):
            raise ValueError(f"recall_step: rows {np.min(rows)}..{np.max(rows)} outside the pool's rows "
                             f"[1, {self.num_rows})")
        self.h2d_copies += 1
        self.h2d_bytes += len(rows) * (self.layer_block_bytes if heads is None else self.unit_bytes)
        vectors = (layers, rows) if heads is None else (layers, rows, heads)
        index = _pad_pow2(*vectors, at_least=at_least)
        if self.io.host_gather:
            return self._submit(self.io.staging_job(self.pool, *index))
        self.sync()
        return Recall(made=self.io.to_device(self.io.stage_rows(self.pool, *index)))

    def _submit(self, stage) -> Recall:
        """`stage` (a backend's staging job: it sees the write-backs queued until it was made) and its copy to the
        device, on the recall thread."""
        if self._thread is None:
            self._thread = RecallThread()
        return self._thread.submit(lambda: self.io.to_device(stage()))

    def sync(self) -> None:
        """Wait for every recall started on the recall thread: the pool's data is then this thread's alone (before a
        gather here, or the pool's storage read whole or replaced)."""
        if self._thread is not None:
            self._thread.drain()

    def fragment_units(self, layer: int, rows: list[int], heads: list[int]) -> Float[Array, "n 2 bs hd"]:
        """(block, head) units of pool layer `layer`, padded: one host-to-device copy per real unit."""
        r, h = _pad_pow2(rows, heads)
        self.sync()
        self.h2d_copies += len(rows)
        self.h2d_bytes += len(rows) * self.unit_bytes
        return self.io.fragment_units(self.pool, layer, r, h, len(rows))

    # ---- whole-pool access (tests, benchmarks; synchronous) ------------------------------------
    def contents(self) -> Float[np.ndarray, "Ls R 2 bs Hkv hd"]:
        """The whole pool as numpy, every write-back landed."""
        self.sync()
        return self.io.to_numpy(self.pool)

    def read(self, layer: int, row: int) -> np.ndarray:
        """One row of pool layer `layer` as numpy [2, bs, Hkv, hd]."""
        return self.contents()[layer, row]

    def load(self, data: Float[np.ndarray, "Ls R 2 bs Hkv hd"]) -> None:
        """Replace the whole pool's contents (benchmarks filling it with known values)."""
        if data.shape != self.shape or data.dtype != self.dtype:
            raise ValueError(f"load: need {self.shape} {self.dtype}, got {data.shape} {data.dtype}")
        self.sync()
        self.pool = self.io.load(data)

    def measure_h2d(self, nbytes: int = 64 << 20, repeats: int = 3) -> float:
        """Host-to-device bytes/s of one large copy from this backend's host memory (best of `repeats`)."""
        import time

        src = self.io.h2d_source(nbytes)
        jax.block_until_ready(self.io.to_device(src))  # warm-up
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(self.io.to_device(src))
            best = min(best, time.perf_counter() - t0)
        return nbytes / best


def checked_host_io(io: str, device: jax.Device, *, on_gpu: bool, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype) -> tuple[str, str | None]:
    """Backend `io` if its transfers pass `probe_host_io` on `device`, else "numpy" (pageable RAM, the portable
    path): (backend, probe error or None). Checked on every platform: which transfers a runtime accepts differs
    between jax versions even where the memory kinds are emulated. Off a GPU the answer is kept per process (the
    tests build many engines); on a GPU each engine checks once."""
    if io == "numpy":
        return io, None
    kw = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=jnp.dtype(dtype).name, io=io)
    key = (device, *kw.items())
    if on_gpu or key not in _PASSED:
        err = probe_host_io(device, **kw)
        if err is not None:
            return "numpy", err
        if not on_gpu:
            _PASSED.add(key)
    return io, None


_PASSED: set[tuple] = set()  # (device, probe arguments) that passed off a GPU, in this process


def probe_host_io(device: jax.Device, *, block_size: int, num_kv_heads: int, head_dim: int, dtype,
                  io: str = "xla") -> str | None:
    """Run every transfer of backend `io` once on `device` with a tiny pool of the real block shape and
    dtype, checked bit for bit against numpy. None if all of it works, else what failed (one line)."""
    shape = (2, 4, 2, block_rows(block_size, head_dim, dtype), num_kv_heads, head_dim)  # layer 0 dense, 1 sparse
    rng = np.random.default_rng(0)
    if jnp.issubdtype(jnp.dtype(dtype), jnp.integer):  # a float8 cache's bytes: any byte
        kv_np = rng.integers(0, 256, shape).astype(jnp.dtype(dtype))
    else:
        kv_np = rng.standard_normal(shape, np.float32).astype(jnp.dtype(dtype))
    try:
        pool = HostKVPool(num_rows=4, first_layer=1, num_layers=2, block_size=block_size,
                          num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device, io=io)
        kv = jax.device_put(kv_np, device)
        pool.write_back(kv, [1, 3], [1, 3])
        h = num_kv_heads - 1
        got = [np.asarray(pool.gather_blocks(0, [3, 1]))[:2], np.asarray(pool.gather_units(0, [1, 3], [h, 0]))[:2],
               np.asarray(pool.fragment_units(0, [3], [h]))[:1], pool.contents()[0, [1, 2, 3]]]
        pool.write_back_units(kv, [2, 4 + 1], [2, 1], 0)  # flat units: layer 0 block 2, layer 1 block 1
        got.append(pool.contents()[0, [1, 2, 3]])
        # recalls of one shape, one after another: each keeps its bits (a reused staging buffer must not show)
        again = [pool.gather_blocks(0, [r]) for r in (1, 2, 3, 1, 3)]
        got.append(np.concatenate([np.asarray(a)[:1] for a in again]))
    except Exception as e:  # noqa: BLE001 - any lowering / runtime failure of the backend on this device
        return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    want = [kv_np[1, [3, 1]], np.stack([kv_np[1, 1, :, :, h], kv_np[1, 3, :, :, 0]]), kv_np[1, 3, :, :, h][None],
            np.stack([kv_np[1, 1], np.zeros_like(kv_np[1, 1]), kv_np[1, 3]]),
            np.stack([kv_np[1, 1], kv_np[0, 2], kv_np[1, 3]])]
    want.append(np.stack([want[-1][i] for i in (0, 1, 2, 0, 2)]))
    names = ("gather_blocks", "gather_units", "fragment_units", "write_back", "write_back_units", "repeated gathers")
    for name, g, w in zip(names, got, want, strict=True):
        if g.shape != w.shape or g.tobytes() != w.tobytes():
            return f"{name} returned wrong values on {device.platform}"
    return None
