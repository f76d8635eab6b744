"""A GPU to compile for without one: compile-only devices from a `GpuTargetConfigProto` (no GPU, nothing runs).

jax's CUDA plugin builds compile-only devices from a target description (`topologies.get_topology_desc(platform=
"cuda", target_config=<text proto>)`); a program traced with `ShapeDtypeStruct` arguments sharded on a mesh of
them goes through XLA:GPU's whole pipeline (HLO passes, Triton for the Pallas kernels, PTX for sm_90a, ptxas)
and comes back as a `jax.stages.Compiled` that cannot run but can be read (optimised HLO, memory stats, and with
`dump_to` the thunk sequence: every kernel's grid, threads and shared memory).

Needs the CUDA plugin (`jax-cuda13-plugin` + `jax-cuda13-pjrt`, same version as jax) and `nvidia-cuda-nvcc` for
ptxas: `./run.sh compile-gpu` builds that environment. Without a GPU, jax must run on its CPU backend
(`use_cpu_backend()` before any backend starts, or JAX_PLATFORMS=cpu), else the CUDA plugin fails to initialise
and is not registered at all.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

TARGETS = pathlib.Path(__file__).resolve().parent / "targets"
H200 = TARGETS / "h200.txtpb"


@dataclasses.dataclass(frozen=True)
class GpuLimits:
    """The launch limits and speeds of a target, read from its GpuTargetConfigProto's `gpu_device_info`."""

    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    threads_per_block: int
    registers_per_block: int
    registers_per_sm: int
    threads_per_sm: int
    shared_memory_per_block: int  # the opt-in maximum a kernel may request
    shared_memory_per_sm: int
    memory_bandwidth: float  # bytes/s
    device_memory: int  # bytes

    @staticmethod
    def parse(text: str) -> GpuLimits:
        def field(name: str, default: float | None = None) -> float:
            m = re.search(rf"^\s*{name}:\s*([0-9.e+]+)\s*$", text, re.M)
            if m is None:
                if default is None:
                    raise ValueError(f"the GPU target config has no {name!r} (is it a GpuTargetConfigProto?)")
                return default
            return float(m.group(1))

        cc = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", text)
        major = int(re.search(r"major:\s*(\d+)", cc.group(1)).group(1)) if cc else 0
        minor_m = re.search(r"minor:\s*(\d+)", cc.group(1)) if cc else None
        name = re.search(r'device_description_str:\s*"([^"]*)"', text)
        return GpuLimits(
            name=name.group(1) if name else "GPU", compute_capability=(major, int(minor_m.group(1)) if minor_m else 0),
            sm_count=int(field("core_count")), threads_per_block=int(field("threads_per_block_limit")),
            registers_per_block=int(field("registers_per_block_limit")),
            registers_per_sm=int(field("registers_per_core_limit")),
            threads_per_sm=int(field("threads_per_core_limit")),
            shared_memory_per_block=int(field("shared_memory_per_block_optin")),
            shared_memory_per_sm=int(field("shared_memory_per_core")),
            memory_bandwidth=field("memory_bandwidth"), device_memory=int(field("device_memory_size", 0)))


def use_cpu_backend() -> None:
    """Make jax run on its CPU backend (tracing, the compile-only target's host side): the entry points' first
    call, before any backend starts; a clear error if one already did on another platform."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        if jax.default_backend() != "cpu":
            raise RuntimeError(f"jax already runs on {jax.default_backend()!r}; the compile-only target needs its CPU "
                               "backend: start the process with JAX_PLATFORMS=cpu")
        return
    jax.config.update("jax_platforms", "cpu")


class CompileTarget:
    """Compile-only devices of one GPU (see the module docstring); `lower` / `compile` programs for it."""

    def __init__(self, config_text: str, source: str = "<text>"):
        from jax.experimental import topologies

        self.config_text = config_text
        self.source = source
        self.limits = GpuLimits.parse(config_text)
        try:
            topo = topologies.get_topology_desc(platform="cuda", target_config=config_text, topology="1x1x1")
        except Exception as e:  # noqa: BLE001 - the plugin missing or failing to start: say what to do
            raise RuntimeError(
                f"no compile-only CUDA target ({type(e).__name__}: {str(e).splitlines()[0][:300]}); it needs "
                "jax-cuda13-plugin + jax-cuda13-pjrt of jax's version and JAX_PLATFORMS=cpu set before jax "
                "starts: run it through './run.sh compile-gpu'") from None
        self.mesh = topologies.make_mesh(topo, (1,), ("x",))
        self.device = self.mesh.devices.flat[0]

    @staticmethod
    def load(path: str | pathlib.Path | None = None) -> CompileTarget:
        """The target described by the GpuTargetConfigProto text file `path` (default: the project's H200)."""
        p = pathlib.Path(path) if path is not None else H200
        if not p.is_file():
            raise FileNotFoundError(f"GPU target config {p} does not exist; pass a GpuTargetConfigProto text file "
                                    f"(the GPU suite saves one: OUT/h200_target_config.txtpb)")
        return CompileTarget(p.read_text(), str(p))

    # ---- abstract arguments --------------------------------------------------------------------
    def sharding(self, memory_kind: str | None = None) -> NamedSharding:
        """The one device, in HBM (None) or in host memory ("pinned_host")."""
        return NamedSharding(self.mesh, P(), memory_kind=memory_kind)

    def struct(self, shape: tuple[int, ...], dtype: Any, memory_kind: str | None = None) -> jax.ShapeDtypeStruct:
        """An abstract argument on this target; memory_kind "in_shardings": none of its own (the program's
        in_shardings place it, as they do a numpy argument)."""
        sharding = None if memory_kind == "in_shardings" else self.sharding(memory_kind)
        return jax.ShapeDtypeStruct(tuple(int(d) for d in shape), jnp.dtype(dtype), sharding=sharding)

    def abstract(self, tree: Any, memory_kind: str | None = None) -> Any:
        """Every array-like leaf of `tree` (arrays, ShapeDtypeStructs) as a struct on this target."""
        return jax.tree.map(lambda a: self.struct(a.shape, a.dtype, memory_kind), tree)

    # ---- lowering / compiling ------------------------------------------------------------------
    def lower(self, fn: Any, *args: Any, host_args: frozenset[int] = frozenset(), **kwargs: Any) -> jax.stages.Lowered:
        """`fn` (a jitted function, or a plain one, jitted here) lowered for this target with abstract `args`;
        the flat array arguments numbered in `host_args` live in pinned host memory (see `_pin_arguments`)."""
        jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
        with jax.set_mesh(self.mesh):
            lowered = jitted.lower(*args, **kwargs)
        if host_args:
            _pin_arguments(lowered, host_args)
        return lowered

    def compile(self, lowered: jax.stages.Lowered, options: dict | None = None) -> jax.stages.Compiled:
        """XLA:GPU's whole pipeline for this target; `options` are XLA debug options (e.g. xla_dump_to)."""
        with jax.set_mesh(self.mesh):
            return lowered.compile(compiler_options=options or None)


def _pin_arguments(lowered: jax.stages.Lowered, host_args: frozenset[int]) -> None:
    """Mark flat arguments `host_args` of a lowered program as pinned host memory (`mhlo.memory_kind`), in place.

    A sharding's memory kind is dropped on compile-only devices (they list no memories, so jax canonicalises
    `NamedSharding(..., memory_kind="pinned_host")` to None), and without it XLA would compile a host-memory argument
    as device memory: a different program (measured: DUS into a host pool compiled as device kernels instead of
    async copies). The attribute is what jax writes for such an argument when the device has memories. Uses jax
    internals (the lowering's StableHLO module and its kept arguments); a clear error if they moved."""
    from jax._src.lib.mlir import ir

    try:
        low = lowered._lowering
        module = low.stablehlo()
        kept = sorted(low.compile_args["kept_var_idx"])
    except (AttributeError, KeyError) as e:
        raise RuntimeError(f"cannot mark host-memory arguments on this jax version ({e}): bench.aot.target "
                           "needs updating") from None
    with module.context:
        main = next(op for op in module.body.operations
                    if "sym_name" in op.attributes and ir.StringAttr(op.attributes["sym_name"]).value == "main")
        attrs = []
        for j, a in enumerate(main.arg_attrs):
            d = {n.name: n.attr for n in ir.DictAttr(a)}
            if kept[j] in host_args:
                d["mhlo.memory_kind"] = ir.StringAttr.get("pinned_host")
            attrs.append(ir.DictAttr.get(d))
        main.arg_attrs = ir.ArrayAttr.get(attrs)


def device_target_config(device: jax.Device | None = None) -> str:
    """The GpuTargetConfigProto (text) XLA compiles for on a real GPU `device` (default: the first device), read
    from the dump of a trivial compile: the file to replace targets/h200.txtpb with once a GPU run saved it."""
    import tempfile

    device = device or jax.devices()[0]
    with tempfile.TemporaryDirectory() as d:
        x = jax.device_put(jnp.zeros((8,), jnp.float32), device)
        jax.jit(lambda v: v + 1).lower(x).compile(compiler_options={"xla_dump_to": d})
        found = sorted(pathlib.Path(d).glob("*gpu_target_config.pbtxt"))
        if not found:
            raise RuntimeError(f"XLA wrote no GPU target config for {device.platform} device {device}: not a GPU?")
        return found[0].read_text()
