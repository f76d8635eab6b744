"""Host copies of preempted requests' GPU KV: a request's blocks leave the GPU pool whole and come back bit for bit.

When the GPU pool runs out while requests grow, the scheduler preempts the youngest running one
(`pulseinfer_jax/sched/scheduler.py`). Its blocks (every layer, K and V, float8 scales included) are gathered from the
cache in one program, copied to host memory and freed; when blocks free up it lands back in newly allocated blocks in
one program and resumes where it stopped. The space holds at most `capacity_blocks` GPU blocks' worth: a request that
does not fit is never half-copied (the scheduler recomputes it instead). A request moves in chunks of at most
`CHUNK_BLOCKS` blocks, one program each, so the GPU buffer a swap needs stays small when the pool is full (a 32K
request of Llama-3.1-8B in one piece: 4 GiB, bucketed 8 GiB). Chunk widths are bucketed to powers of two (padding
reads and writes the null block), so preemption compiles a handful of shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Shaped

from pulseinfer_jax.kv.blocks import NULL_BLOCK, bucket

CHUNK_BLOCKS = 256  # blocks one swap program moves (Llama-3.1-8B bf16: 2 MiB a block over its 32 layers, 512 MiB)


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


def _chunks(blocks: list[int]) -> list[list[int]]:
    return [blocks[i: i + CHUNK_BLOCKS] for i in range(0, len(blocks), CHUNK_BLOCKS)]


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
        parts = [np.asarray(_gather(kv, jnp.asarray(_padded(c))))[:, : len(c)]  # one chunk buffered at a time
                 for c in _chunks(blocks)]
        self._held[owner] = np.concatenate(parts, axis=1)  # (a copy: the padding's rows are not kept)
        self.swapped_out += 1

    def swap_in(self, kv: jax.Array, blocks: list[int], owner: int) -> jax.Array:
        """Write `owner`'s saved KV into `blocks` (as many as it had, in table order), forget it; returns the cache."""
        data = self._held.pop(owner)
        if data.shape[1] != len(blocks):
            self._held[owner] = data
            raise ValueError(f"request {owner} swapped out {data.shape[1]} blocks but {len(blocks)} were given back")
        self.swapped_in += 1
        start = 0
        for c in _chunks(blocks):
            idx = _padded(c)
            part = np.zeros((data.shape[0], len(idx), *data.shape[2:]), data.dtype)
            part[:, : len(c)] = data[:, start: start + len(c)]
            kv = _scatter(kv, jnp.asarray(idx), jnp.asarray(part))
            start += len(c)
        return kv

    def drop(self, owner: int) -> None:
        """Forget `owner`'s saved KV (it finished or was cancelled while swapped out)."""
        self._held.pop(owner, None)
