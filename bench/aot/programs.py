"""A program the engine runs, with abstract arguments: what the ahead-of-time check compiles and costs.

A `Program` is one jitted function of the engine (`fn`, the very object the engine calls) with its static
arguments and its array arguments as `Spec`s (shape, dtype, memory kind), so that it can be lowered for a
compile-only GPU (`Program.lower(target)`) or described without any backend (`Program.signature`: the function
name and argument types exactly as `jax_log_compiles` prints them when the engine compiles it; the coverage test
compares the two). `Call` pairs a program with how often a decode step runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

HOST = "pinned_host"
PLACED = "in_shardings"  # an argument passed as numpy that the program's in_shardings place (no sharding of its own)


@dataclasses.dataclass(frozen=True)
class Spec:
    """An abstract array argument: shape, dtype and memory kind (None = the device's HBM; PLACED: given as numpy,
    where the jitted function's own in_shardings put it)."""

    shape: tuple[int, ...]
    dtype: Any
    memory: str | None = None

    @property
    def aval(self) -> str:
        """The argument as jax prints it in a compile log: `float32[2,3]`, `int32<host>[8]` in pinned host memory."""
        space = "<host>" if self.memory == HOST else ""
        return f"{jnp.dtype(self.dtype).name}{space}[{','.join(str(d) for d in self.shape)}]"

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * jnp.dtype(self.dtype).itemsize


def spec(shape, dtype, memory: str | None = None) -> Spec:
    return Spec(tuple(int(d) for d in shape), jnp.dtype(dtype), memory)


def specs_of(tree: Any, memory: str | None = None) -> Any:
    """Specs for every array-like leaf (arrays, numpy arrays, ShapeDtypeStructs) of `tree`."""
    return jax.tree.map(lambda a: spec(np.shape(a), a.dtype, memory), tree)


def _is_spec(x: Any) -> bool:
    return isinstance(x, Spec)


def _specs(args: Any) -> list[Spec]:
    """The array arguments of a call, in order (static leaves such as the model are not arrays)."""
    return [x for x in jax.tree.leaves(args, is_leaf=_is_spec) if isinstance(x, Spec)]


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program of the engine (see the module docstring).

    group: "kernel" (a Pallas kernel alone, at engine / bench shapes), "dense" / "prefill" / "sparse" (model
    steps), "host_io", "sampling", "probe" (the engine's start-up probes), "planted" (must be rejected).
    default: the engine runs it in its default configuration: a register spill or a launch-limit violation in it
    fails the check (other programs' are reported). must_reject: the compiler must refuse it (the check's teeth).
    pallas: kernels that must come out as Triton kernels (a Pallas call left in interpret mode is a loop of XLA
    ops: the program would compile, slowly wrong for a GPU).
    """

    key: str
    function: str
    group: str
    fn: Any = dataclasses.field(compare=False, repr=False)
    args: tuple = dataclasses.field(compare=False, repr=False)
    statics: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    default: bool = True
    must_reject: bool = False
    note: str = ""
    pallas: tuple[str, ...] = ()  # Pallas kernels (name prefixes) the compiled program must contain: not interpreted
    # per Pallas kernel name prefix, the fraction of its listed entries that hold data (padded tables: the kernels
    # mask the rest, the cost model does not count them; traffic.py)
    valid: tuple[tuple[str, float], ...] = ()
    # the key without `valid`: programs equal in it are one compile (their costs differ only by the valid fractions)
    compile_key: str = dataclasses.field(default="", compare=False)

    @property
    def signature(self) -> tuple[str, tuple[str, ...]]:
        """(function name, argument avals in order), the way jax logs the compile of this call (jax leaves out the
        arguments the program does not use: a logged signature is a subsequence of this one)."""
        return self.function, tuple(s.aval for s in _specs(self.args))

    @property
    def size(self) -> int:
        """How many array arguments the program takes: a proxy for its compile time (a whole step takes every
        layer's weights), by which the check schedules the largest first."""
        return len(_specs(self.args))

    @property
    def arg_bytes(self) -> int:
        return sum(s.nbytes for s in _specs(self.args))

    def lower(self, target) -> jax.stages.Lowered:
        """Lowered for `target` (bench.aot.target.CompileTarget): Specs become sharded structs there."""
        args = jax.tree.map(lambda s: target.struct(s.shape, s.dtype, s.memory) if isinstance(s, Spec) else s,
                            self.args, is_leaf=_is_spec)
        host = frozenset(i for i, s in enumerate(_specs(self.args)) if s.memory in (HOST, PLACED))
        return target.lower(self.fn, *args, host_args=host, **self.statics)


def program(function: str, group: str, fn: Any, args: tuple, statics: dict | None = None, *, tag: str = "",
            **kw) -> Program:
    """A Program whose key is its function, statics, tag and argument shapes (equal keys = one compile)."""
    statics = statics or {}
    shapes = " ".join(s.aval for s in _specs(args))
    models = [_short(a) for a in jax.tree.leaves(args, is_leaf=_is_spec) if hasattr(a, "cfg")]
    st = ",".join(models + [f"{k}={_short(v)}" for k, v in sorted(statics.items())])
    valid = "".join(f" {k}@{v:.3f}" for k, v in kw.get("valid", ()))  # (part of the cost, so of the key)
    compile_key = f"{function}{'[' + tag + ']' if tag else ''}({st}) {shapes}"
    return Program(compile_key + valid, function, group, fn, args, statics, compile_key=compile_key, **kw)


def _short(v: Any) -> str:
    name = getattr(v, "cfg", None)
    if name is not None:  # a Transformer: its model name, dtype and (mixture of experts) MoE options
        moe = f":{v.moe.strategy}-{v.moe.grouped_kernel}" if name.is_moe else ""
        return f"{getattr(name, 'name', '') or 'model'}:{jnp.dtype(v.dtype).name}{moe}"
    return repr(v)


@dataclasses.dataclass(frozen=True)
class Call:
    """`program` runs `count` times per decode step (fractions: amortised, e.g. a write-back every block)."""

    program: Program
    count: float = 1.0
