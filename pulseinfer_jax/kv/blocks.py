"""Block math and block allocators, shared by the GPU KV pool (`pulseinfer_jax.kv.cache`) and the host KV pool
(`host_pool.py`): block 0 is the null block, never handed out."""

from __future__ import annotations

NULL_BLOCK = 0


class OutOfBlocksError(RuntimeError):
    """The allocator cannot satisfy a request; nothing was allocated."""


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum): padded batch / table / index widths, so the number of
    compiled shapes stays logarithmic."""
    return 1 << max(0, (max(n, minimum) - 1).bit_length())


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
        self.peak_used = 0  # high-water mark of blocks handed out at once

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

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
        self.peak_used = max(self.peak_used, len(self._owner))
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
