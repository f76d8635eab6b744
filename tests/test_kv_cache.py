"""Block allocator and scheduler properties (pure Python, no model)."""

import random

import pytest

from pulseinfer_jax.kv.blocks import NULL_BLOCK, BlockAllocator, ExtentAllocator, OutOfBlocksError, blocks_for
from pulseinfer_jax.request import Request, SamplingParams, Status
from pulseinfer_jax.sched.scheduler import Scheduler


def test_blocks_for_boundaries():
    assert [blocks_for(n, 16) for n in (1, 15, 16, 17, 32, 33)] == [1, 1, 1, 2, 2, 3]


def test_allocator_random_ops_keep_integrity():
    rng = random.Random(0)
    alloc = BlockAllocator(50)
    owned: dict[int, list[int]] = {}
    for step in range(2000):
        if owned and rng.random() < 0.45:
            owner = rng.choice(sorted(owned))
            alloc.free(owned.pop(owner), owner)
        else:
            n = rng.randint(0, 12)
            owner = step
            if alloc.can_allocate(n):
                blocks = alloc.allocate(n, owner)
                assert len(set(blocks)) == n and NULL_BLOCK not in blocks
                owned[owner] = blocks
            else:
                free_before = alloc.num_free
                with pytest.raises(OutOfBlocksError):
                    alloc.allocate(n, owner)
                assert alloc.num_free == free_before  # failed allocation has no side effect
        alloc.check_integrity()
        all_owned = [b for bl in owned.values() for b in bl]
        assert len(all_owned) == len(set(all_owned))
        assert alloc.num_free + len(all_owned) == alloc.capacity


def test_allocator_rejects_foreign_free_and_detects_corruption():
    alloc = BlockAllocator(8)
    a = alloc.allocate(3, owner=1)
    with pytest.raises(RuntimeError, match="owned by"):
        alloc.free(a, owner=2)
    alloc._free.append(a[0])  # corrupt it on purpose
    with pytest.raises(AssertionError):
        alloc.check_integrity()
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(1)


def test_extent_allocator_hands_out_aligned_extents():
    """Rows come in whole aligned extents, in order (logical block j of an owner lies in its extent j // 4), never
    from extent 0 (the null row's); the sizes are in rows and a failed allocation changes nothing."""
    rng = random.Random(1)
    alloc = ExtentAllocator(48, 4)  # 11 usable extents
    assert alloc.capacity == 44 and alloc.num_free == 44
    owned: dict[int, list[int]] = {}
    for step in range(1500):
        if owned and rng.random() < 0.45:
            owner = rng.choice(sorted(owned))
            alloc.free(owned.pop(owner), owner)
        else:
            n = rng.randint(0, 13)
            if alloc.can_allocate(n):
                rows = alloc.allocate(n, step)
                assert len(rows) == n and min(rows, default=4) >= 4
                for j, r in enumerate(rows):  # aligned: block j at offset j % 4 of the extent of block j - j % 4
                    assert r % 4 == j % 4 and r // 4 == rows[j - j % 4] // 4
                owned[step] = rows
            else:
                free_before = alloc.num_free
                with pytest.raises(OutOfBlocksError, match="extents of 4"):
                    alloc.allocate(n, step)
                assert alloc.num_free == free_before and -(-n // 4) * 4 > free_before
        alloc.check_integrity()
        extents = [r // 4 for rows in owned.values() for r in rows]
        assert alloc.num_free == alloc.capacity - 4 * len(set(extents))
        assert len({(o, r // 4) for o, rows in owned.items() for r in rows}) == len(set(extents))  # not shared
    with pytest.raises(ValueError, match="multiple of extent"):
        ExtentAllocator(10, 4)
    with pytest.raises(ValueError, match="two extents"):
        ExtentAllocator(4, 4)


def _req(i, prompt_len, max_new=4):
    return Request(i, list(range(prompt_len)), SamplingParams(max_new_tokens=max_new), max_new)


def test_scheduler_reserves_fifo_and_frees():
    alloc = BlockAllocator(1 + 6)  # 6 usable blocks of 4 tokens
    s = Scheduler(alloc, block_size=4, max_batch=8, watermark=0)
    reqs = [_req(0, 8), _req(1, 8), _req(2, 5)]  # prompt + first token: 3, 3, 2 blocks
    for r in reqs:
        s.add(r)
    admitted = s.admit()
    assert admitted == reqs[:2]  # FIFO: request 2 would fit but waits behind nobody; pool is full
    assert alloc.num_free == 0 and s.waiting[0] is reqs[2]
    for r in admitted:
        s.prefill_done(r)
    s.finish(reqs[0], "length")
    assert reqs[0].status is Status.FINISHED and reqs[0].blocks == []
    assert s.admit() == [reqs[2]]
    alloc.check_integrity()


def test_scheduler_respects_max_batch_and_rejects_oversized():
    alloc = BlockAllocator(100)
    s = Scheduler(alloc, block_size=4, max_batch=2)
    for i in range(4):
        s.add(_req(i, 3))
    assert len(s.admit()) == 2 and len(s.waiting) == 2
    with pytest.raises(ValueError, match="prompt of 1000 tokens .* GPU KV pool holds 99"):
        s.add(_req(9, 1000))
