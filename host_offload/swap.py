"""Host copies of preempted requests' GPU KV: a request's blocks leave the GPU pool whole and come back bit for bit.

When the GPU pool runs out while requests grow, the scheduler preempts the youngest running one
(`pulseinfer_jax/sched/scheduler.py`). Its blocks (every layer, K and V, float8 scales included) are gathered from the
cache in one program, copied to host memory and freed; when blocks free up it lands back in newly allocated blocks in
one program and resumes where it stopped. The space holds at most `capacity_blocks` GPU blocks' worth: a request that
does not fit is never half-copied (the scheduler recomputes it instead). Block-count widths are bucketed to powers
of two (padding reads and writes the null block), so preemption compiles a handful of shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Shaped

from pulseinfer_jax.kv.blocks import NULL_BLOCK, bucket


@jax.jit
def _gather(kv: Shaped[Array, "L NB 2 r Hkv hd"], blocks: jax.Array) -> Shaped[Array, "L n 2 r Hkv hd"]:
    return kv[:, blocks]


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(kv: Shaped[Array, "L NB 2 r Hkv hd"], blocks: jax.Array,
             data: Shaped[Array, "L n 2 r Hkv hd"]) -> Shaped[Array, "L NB 2 r Hkv hd"]:
    return kv.at[:, blocks].set(data)


def _padded(blocks: list[int]) -> np.ndarray:
    """`blocks` padded with the null block to a power-of-two width (the null block is a scratch target)."""
    out = np.full(bucket(len(blocks)), NULL_BLOCK, np.int32)
    out[: len(blocks)] = blocks
    return out


class SwapSpace:
    """Host memory for preempted requests' KV, `capacity_blocks` GPU blocks' worth (0: none, preemption recomputes)."""

    def __init__(self, capacity_blocks: int):
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks={capacity_blocks} must be >= 0")
        self.capacity_blocks = capacity_blocks
        self._held: dict[int, np.ndarray] = {}  # owner -> [L, n, 2, r, Hkv, hd] (n = its blocks, unpadded)
        self.swapped_out = 0  # requests copied out so far
        self.swapped_in = 0

    @property
    def used_blocks(self) -> int:
        return sum(a.shape[1] for a in self._held.values())

    def can_hold(self, n: int) -> bool:
        return self.used_blocks + n <= self.capacity_blocks

    def swap_out(self, kv: jax.Array, blocks: list[int], owner: int) -> None:
        """Copy `owner`'s `blocks` (in table order) to host memory; the caller frees them afterwards."""
        if owner in self._held:
            raise RuntimeError(f"request {owner} is already swapped out")
        if not self.can_hold(len(blocks)):
            raise RuntimeError(f"the swap space cannot hold {len(blocks)} more blocks ({self.used_blocks} of "
                               f"{self.capacity_blocks} used); check can_hold first")
        data = np.asarray(_gather(kv, jnp.asarray(_padded(blocks))))  # waits for the copy: the blocks are freed next
        self._held[owner] = data[:, : len(blocks)].copy()
        self.swapped_out += 1

    def swap_in(self, kv: jax.Array, blocks: list[int], owner: int) -> jax.Array:
        """Write `owner`'s saved KV into `blocks` (as many as it had, in table order), forget it; returns the cache."""
        data = self._held.pop(owner)
        if data.shape[1] != len(blocks):
            self._held[owner] = data
            raise ValueError(f"request {owner} swapped out {data.shape[1]} blocks but {len(blocks)} were given back")
        idx = _padded(blocks)
        pad = np.zeros((data.shape[0], len(idx) - len(blocks), *data.shape[2:]), data.dtype)
        self.swapped_in += 1
        return _scatter(kv, jnp.asarray(idx), jnp.asarray(np.concatenate([data, pad], axis=1)))

    def drop(self, owner: int) -> None:
        """Forget `owner`'s saved KV (it finished or was cancelled while swapped out)."""
        self._held.pop(owner, None)
