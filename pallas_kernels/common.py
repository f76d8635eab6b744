"""Shared helpers of the Pallas kernels: interpret-mode default and explicit Triton compiler params.

Every kernel's public function takes `interpret: bool | None = None`; None lets the platform a program is
*compiled for* choose (`on_platform`): Pallas interpret mode in a program lowered for a CPU (the tests), the
Triton kernel (`pl.pallas_call`'s Triton lowering) in one lowered for a GPU, whatever the default backend of
the process that compiles it, so an ahead-of-time compile for a GPU from a CPU-only machine compiles the real
kernel (bench/aot). Block tables and index lists are passed as ordinary inputs (Triton has no scalar
prefetch).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

# shared memory one program (thread block) may use on the target GPUs: the opt-in maximum of the H100 and H200
# (227 KiB); kernels bound their tiles by it, since the compiler rejects a kernel over it
SHARED_MEMORY_PER_BLOCK = 232448


def resolve_interpret(interpret: bool | None) -> bool:
    """True -> Pallas interpret mode. None picks interpret mode unless the default backend is a GPU (for callers
    outside a kernel's own jit, e.g. benchmarks calling jax's own Pallas ops; the kernels use `on_platform`)."""
    if interpret is None:
        return jax.default_backend() != "gpu"  # (CUDA and ROCm devices both report platform "gpu")
    return bool(interpret)


def on_platform[T](run: Callable[[bool], T], interpret: bool | None) -> T:
    """`run(interpret)` with the caller's choice, or for None with the lowering platform's: interpret mode where
    the program is lowered for a CPU, the compiled kernel anywhere else (`jax.lax.platform_dependent`: both
    branches are traced, only the matching one is lowered, so no runtime branch is left)."""
    if interpret is not None:
        return run(bool(interpret))
    return jax.lax.platform_dependent(cpu=lambda: run(True), default=lambda: run(False))


def traced_zero() -> jax.Array:
    """A zero the kernel computes (its program id times 0, folded by Triton): the start of `tile`'s slices. Call it
    at the kernel's top level (interpret mode resolves program ids there, not inside its loops)."""
    return pl.program_id(0) * 0


def tile(n: int, zero: jax.Array) -> pl.Slice:
    """Positions [0, n) of a ref axis that may be shorter than n: a power-of-two tile (Triton's tensor sizes) over a
    smaller axis, for a masked load or store. Its start is `zero` (`traced_zero`), not the constant 0: jax >= 0.12
    refuses a static slice past an axis's end even under a mask; Triton masks the lanes past it and interpret mode
    pads them."""
    return pl.ds(zero, n)


def triton_params(num_warps: int = 4, num_stages: int = 2) -> plt.CompilerParams:
    """Explicit Triton compiler params (the Triton lowering does not guess them well for small tiles)."""
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def matmul_precision(dtype) -> jax.lax.Precision | None:
    """float32 computes in true float32 (GPUs would otherwise use TF32); narrower dtypes use the default."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two that divides n and is <= cap."""
    t = n & -n
    while t > cap:
        t //= 2
    return max(t, 1)
