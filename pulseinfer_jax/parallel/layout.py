"""Where an engine's arrays live: one device, or a 1-D mesh axis `tp` whose devices split the heads.

`DeviceLayout` is the one object the engine, the loaders and the host pool ask for shardings. With one device every
sharding is that device's `SingleDeviceSharding` (exactly what a single-device engine always used); with
`tensor_parallel` = N > 1 it is a `NamedSharding` over a mesh of N devices with one axis, `tp` (axis type Auto:
XLA's partitioner propagates the shardings through the model and inserts the collectives, Megatron style):
  - attention heads and KV heads split over `tp` (q/k/v projections by column, the output projection by row:
    one all-reduce after attention), the MLP the same (gate / up by column, down by row: one all-reduce after it),
    the experts of an MoE layer split by expert (expert parallel, `models/moe.py`);
  - the paged KV cache `[L, NB, 2, bs, Hkv, hd]`, the key bounds and the host pool split on their KV-head axis:
    each device's blocks hold its own heads, and a block of one device is still one contiguous run of its heads;
  - the embedding and the LM head split by vocabulary when it divides, else replicated;
  - everything else (norms, the router, per-step indices) replicated.
Pallas kernels are not partitioned by XLA: under a `tp` mesh they run inside `shard_map` on each device's heads
(`parallel/kernels.py`), so the engine's steps trace under `DeviceLayout.context()` (the mesh as context).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

TP = "tp"  # the mesh axis that splits heads, MLP columns and experts


def split_spec(ndim: int, axis: int) -> PartitionSpec:
    """The spec of an `ndim`-D array split over `tp` on `axis` (negative: from the end), every other axis whole."""
    spec: list[str | None] = [None] * ndim
    spec[axis] = TP
    return PartitionSpec(*spec)


@dataclasses.dataclass(frozen=True)
class DeviceLayout:
    """The devices of an engine and the shardings of its arrays (see the module docstring)."""

    devices: tuple[jax.Device, ...]
    mesh: Mesh | None = None  # None: one device

    @classmethod
    def of(cls, tensor_parallel: int = 1, device: jax.Device | None = None,
           devices: Sequence[jax.Device] | None = None) -> DeviceLayout:
        """`tensor_parallel` devices: the first ones of `devices` (default: every device of the default backend, this
        process's and, under jax.distributed, the other processes'), or `device` alone when it is 1."""
        if tensor_parallel < 1:
            raise ValueError(f"tensor_parallel={tensor_parallel} must be >= 1")
        if tensor_parallel == 1:
            return cls((device or (devices[0] if devices else jax.devices()[0]),))
        pool = list(devices) if devices is not None else jax.devices()
        if len(pool) < tensor_parallel:
            raise ValueError(f"tensor_parallel={tensor_parallel} needs {tensor_parallel} devices but "
                             f"{len(pool)} are visible ({pool[0].platform}); lower tensor_parallel, or on a CPU "
                             "set XLA_FLAGS=--xla_force_host_platform_device_count=N (or jax_num_cpu_devices) "
                             "before jax starts")
        chosen = tuple(pool[:tensor_parallel])
        mesh = Mesh(chosen, (TP,), axis_types=(AxisType.Auto,))
        return cls(chosen, mesh)

    @classmethod
    def on(cls, where: jax.Device | DeviceLayout) -> DeviceLayout:
        """`where` itself if it is a layout, else the layout of that one device (what the host pool, its I/O backends
        and the sparse decoder accept)."""
        return where if isinstance(where, DeviceLayout) else cls.of(1, where)

    @property
    def tp(self) -> int:
        return len(self.devices)

    @property
    def device(self) -> jax.Device:
        """The first device (its platform and memory stand for all of them: a mesh is one kind of device)."""
        return self.devices[0]

    @property
    def platform(self) -> str:
        return self.device.platform

    def spec(self, spec: PartitionSpec, memory_kind: str | None = None) -> jax.sharding.Sharding:
        """`spec` on this layout's mesh (one device: that device)."""
        if self.mesh is None:
            return SingleDeviceSharding(self.device, memory_kind=memory_kind)
        return NamedSharding(self.mesh, spec, memory_kind=memory_kind)

    def replicated(self, memory_kind: str | None = None) -> jax.sharding.Sharding:
        """Every device holds the whole array (one device: that device)."""
        return self.spec(PartitionSpec(), memory_kind)

    def split(self, ndim: int, axis: int, memory_kind: str | None = None) -> jax.sharding.Sharding:
        """An `ndim`-D array split over `tp` on `axis` (one device: that device)."""
        return self.spec(split_spec(ndim, axis), memory_kind)

    def kv_heads(self, ndim: int, memory_kind: str | None = None) -> jax.sharding.Sharding:
        """A KV array whose KV-head axis is the second to last (the cache, the host pool, the key bounds), split by
        head."""
        return self.split(ndim, ndim - 2, memory_kind)

    def context(self) -> contextlib.AbstractContextManager:
        """The mesh as the tracing context (what `parallel/kernels.py` reads to shard Pallas kernels); nothing for
        one device."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def describe(self) -> str:
        if self.mesh is None:
            return f"1 device ({self.device.platform})"
        return f"tensor parallel over {self.tp} {self.platform} devices (mesh axis {TP!r})"
