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
        raise RuntimeError(f"device {device} has no {HOST_KIND!r} memory (it has {sorted(kinds)}); the 'xla' host I/O "
                           "needs pinned host memory: use host_io='numpy' (pageable host RAM) on this backend")
    return SingleDeviceSharding(device, memory_kind=HOST_KIND)
