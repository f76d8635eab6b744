"""Memory kinds: shardings for a device's HBM and its pinned host memory.

On a GPU the two kinds are `device` (HBM) and `pinned_host` (page-locked DRAM the GPU's copy engines read
directly). On the CPU backend all kinds exist but are the same RAM: the offload code runs unchanged there,
which is what the tests use; timings on CPU mean nothing for PCIe.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from pulseinfer_jax.kv.cache import device_zeros_program

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


def zeros_on(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding) -> jax.Array:
    """Zeros made where `sharding` says (device or pinned host memory) and committed there; no host copy."""
    return zeros_program(shape, dtype, sharding)()


def zeros_program(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding, memory_kind: str | None = None):
    """The jitted allocation `zeros_on` runs, in `memory_kind` (default: the sharding's; the ahead-of-time check
    passes it for compile-only devices, whose shardings carry none). The put inside gives the result's type that
    memory space (out_shardings alone leaves a pinned-host array typed as device memory, and the first call of
    each program it meets compiles once more for it)."""
    if (memory_kind or sharding.memory_kind) != "pinned_host":
        return device_zeros_program(shape, dtype, sharding)
    from jax.experimental.compute_on import compute_on

    # written by the host, in place: zeros made on the device and copied over would need the pool's size in HBM
    @compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    @jax.jit
    def host_zeros():
        return jnp.zeros(shape, dtype)

    return jax.jit(host_zeros, out_shardings=sharding)
