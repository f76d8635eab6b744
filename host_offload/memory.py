"""Memory kinds: shardings for a device's HBM and its pinned host memory.

On a GPU the two kinds are `device` (HBM) and `pinned_host` (page-locked DRAM the GPU's copy engines read
directly). On the CPU backend all kinds exist but are the same RAM: the offload code runs unchanged there,
which is what the tests use; timings on CPU mean nothing for PCIe.
"""

from __future__ import annotations

import jax
from jax.sharding import SingleDeviceSharding

HOST_KIND = "pinned_host"


def device_sharding(device: jax.Device) -> SingleDeviceSharding:
    return SingleDeviceSharding(device, memory_kind="device")


def host_sharding(device: jax.Device) -> SingleDeviceSharding:
    """Pinned host memory attached to `device`; a clear error where the backend has none."""
    kinds = {m.kind for m in device.addressable_memories()}
    if HOST_KIND not in kinds:
        raise RuntimeError(f"device {device} has no {HOST_KIND!r} memory (it has {sorted(kinds)}); KV offloading "
                           "needs a backend with pinned host memory (CUDA GPUs, or the CPU backend for tests)")
    return SingleDeviceSharding(device, memory_kind=HOST_KIND)


def measure_h2d_bandwidth(device: jax.Device, nbytes: int = 64 << 20, repeats: int = 3) -> float:
    """Host-to-device bytes/s of one large copy from pinned host memory (best of `repeats`)."""
    import time

    import numpy as np

    src = jax.device_put(np.zeros(nbytes // 4, np.float32), host_sharding(device))
    dev = device_sharding(device)
    jax.block_until_ready(jax.device_put(src, dev))  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(jax.device_put(src, dev))
        best = min(best, time.perf_counter() - t0)
    return nbytes / best
