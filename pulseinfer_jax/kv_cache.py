"""Paged KV cache: layout, block allocator, per-request block tables.

Layout (one array for all layers):

    kv: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
             layer     block    K|V    token        head        feature

One block of one layer, `kv[l, b]`, is a single contiguous run of 2 * block_size * Hkv * head_dim
elements holding every KV head's K and V for `block_size` consecutive tokens of one request. That is
the unit that later moves between GPU and pinned host memory in one transfer (SoloHead recall);
`kv[l, b, :, :, h]` (two strided [block_size, head_dim] tiles) is the per-(block, head) unit of the
headwise baseline. Token-major inside a block makes a gathered run of blocks a plain
[tokens, Hkv * head_dim] matrix (no transpose before the attention matmuls) and lets prefill write a
chunk's [tokens, Hkv, head_dim] K/V without reordering.

Block 0 is the *null block*: never allocated, the target of padded writes (inactive batch rows,
the unused tail of a prefill chunk's table) and of padded block-table entries, which attention masks
by sequence length. Real data therefore never aliases garbage writes.

Token t of a request lives in block `table[t // block_size]`, slot `t % block_size`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NULL_BLOCK = 0


class OutOfBlocksError(RuntimeError):
    """The allocator cannot satisfy a request; nothing was allocated."""


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    num_layers: int
    num_blocks: int  # including the null block
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: jnp.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers (K and V, every head)."""
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim * jnp.dtype(
            self.dtype).itemsize

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def allocate(self, device: jax.Device | None = None) -> jax.Array:
        """Zero-filled cache array made on `device` and committed to it, as the donating step functions' outputs
        are: an uncommitted first cache would give every step function one more compile (measured)."""
        return zeros_on(self.shape, self.dtype, jax.sharding.SingleDeviceSharding(device or jax.devices()[0]))


def zeros_on(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding) -> jax.Array:
    """Zeros made where `sharding` says (device or pinned host memory) and committed there; no host copy."""
    return zeros_program(shape, dtype, sharding)()


def zeros_program(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding, memory_kind: str | None = None):
    """The jitted allocation `zeros_on` runs, in `memory_kind` (default: the sharding's; the ahead-of-time check
    passes it for compile-only devices, whose shardings carry none). The put inside gives the result's type that
    memory space (out_shardings alone leaves a pinned-host array typed as device memory, and the first call of
    each program it meets compiles once more for it)."""
    if (memory_kind or sharding.memory_kind) != "pinned_host":
        return jax.jit(lambda: jax.device_put(jnp.zeros(shape, dtype), jax.memory.Space.Device), out_shardings=sharding)
    from jax.experimental.compute_on import compute_on

    # written by the host, in place: zeros made on the device and copied over would need the pool's size in HBM
    @compute_on(compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    @jax.jit
    def host_zeros():
        return jnp.zeros(shape, dtype)

    return jax.jit(host_zeros, out_shardings=sharding)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum): padded batch / table / index widths, so the number of
    compiled shapes stays logarithmic."""
    return 1 << max(0, (max(n, minimum) - 1).bit_length())


TABLE_STEPS = 4  # block-table widths per doubling past 64 blocks


def bucket_blocks(n: int) -> int:
    """Padded width of a block table of n blocks: a power of two up to 64, then the next multiple of a quarter of
    the power of two at or below n (at most 25% padding; 4 widths, so 4 compiles, per doubling of the context).
    Power-of-two tables padded a 4,097-token context to 8,192: the jnp attention read, and the selection scored,
    twice what the sequence holds (ahead-of-time cost on an H200, bench/RESULTS.md)."""
    n = max(n, 1)
    if n <= 64:
        return bucket(n)
    step = (1 << (n.bit_length() - 1)) // TABLE_STEPS
    return -(-n // step) * step


class BlockAllocator:
    """Free-list allocator over blocks 1..num_blocks-1 (block 0 is the null block).

    Contract: `allocate(n)` returns n distinct blocks or raises OutOfBlocksError without side effects;
    `free(blocks)` returns blocks that are currently owned; a block is owned by at most one request;
    `check_integrity()` verifies free + owned == all usable blocks, disjointly.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is reserved as the null block)")
        self.num_blocks = num_blocks
        # Pop from the end: low ids first, which keeps tests readable and allocation deterministic.
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))
        self._owner: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, owner: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate n={n} blocks")
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks but only {len(self._free)} of {self.capacity} are free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._owner[b] = owner
        return out

    def free(self, blocks: list[int], owner: int) -> None:
        for b in blocks:
            if self._owner.get(b) != owner:
                raise RuntimeError(f"block {b} freed by request {owner} but owned by {self._owner.get(b)}")
        for b in blocks:
            del self._owner[b]
            self._free.append(b)

    def owned_by(self, owner: int) -> list[int]:
        return sorted(b for b, o in self._owner.items() if o == owner)

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("free list holds duplicate blocks")
        if NULL_BLOCK in free or NULL_BLOCK in self._owner:
            raise AssertionError("the null block was handed out")
        if free & set(self._owner):
            raise AssertionError(f"blocks both free and owned: {sorted(free & set(self._owner))}")
        if free | set(self._owner) != set(range(1, self.num_blocks)):
            raise AssertionError("blocks leaked: free + owned != all usable blocks")


class ExtentAllocator:
    """`BlockAllocator`'s contract over rows handed out in aligned extents of `extent` rows: `allocate(n)` returns
    n rows filling ceil(n / extent) whole extents in order (rows e * extent .. e * extent + extent - 1 of extent e;
    the last extent's unused rows stay with the owner), so logical block j of a request lies in extent j // extent
    of its own: two-level scoring keys a group's bound by `row // extent`. Extent 0 holds the null row 0 and is
    never handed out; sizes are in rows (`capacity`, `num_free`: whole free extents)."""

    def __init__(self, num_rows: int, extent: int):
        if extent < 1 or num_rows % extent or num_rows < 2 * extent:
            raise ValueError(f"num_rows={num_rows} must be a multiple of extent={extent}, at least two extents (the "
                             "first holds the null row)")
        self.extent = extent
        self.num_blocks = num_rows
        self._extents = BlockAllocator(num_rows // extent)

    @property
    def num_free(self) -> int:
        return self._extents.num_free * self.extent

    @property
    def capacity(self) -> int:
        return self._extents.capacity * self.extent

    def can_allocate(self, n: int) -> bool:
        return self._extents.can_allocate(-(-n // self.extent))

    def allocate(self, n: int, owner: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate n={n} rows")
        e = self.extent
        try:
            extents = self._extents.allocate(-(-n // e), owner)
        except OutOfBlocksError:
            raise OutOfBlocksError(f"need {n} rows ({-(-n // e)} extents of {e}) but only {self.num_free} of "
                                   f"{self.capacity} rows are free") from None
        return [x * e + i for x in extents for i in range(e)][:n]

    def free(self, rows: list[int], owner: int) -> None:
        self._extents.free(sorted({r // self.extent for r in rows}), owner)

    def owned_by(self, owner: int) -> list[int]:
        return [x * self.extent + i for x in self._extents.owned_by(owner) for i in range(self.extent)]

    def check_integrity(self) -> None:
        self._extents.check_integrity()

