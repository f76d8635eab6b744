"""Shared helpers of the Pallas kernels: interpret-mode default and explicit Triton compiler params.

Every kernel's public function takes `interpret: bool | None = None`; None means "interpret when the
default backend is not a GPU", so tests run the same kernels in Pallas interpret mode on CPU while a
GPU compiles them through the Triton lowering (`pl.pallas_call`). Block tables and index lists are passed
as ordinary inputs (Triton has no scalar prefetch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plt

GPU_PLATFORMS = ("gpu", "cuda", "rocm")  # platform names under which pallas_call lowers for a GPU


def resolve_interpret(interpret: bool | None) -> bool:
    """True -> Pallas interpret mode. None picks interpret mode unless the default backend is a GPU."""
    if interpret is None:
        return jax.default_backend() not in GPU_PLATFORMS
    return bool(interpret)


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
