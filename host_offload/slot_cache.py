"""GPU slot cache: which recalled KV blocks are resident in a request's slots, with LRU eviction.

One `SlotCache` serves one lane of one sparse layer of one request: SoloHead has one lane per layer (a slot
holds a whole block, every head), headwise selection has one lane per KV head (slot i of lane h holds head
h of a block, in column h of the lane's slot block i). Pure Python, no device code.

Contract of `plan(wanted)` (the middle blocks this step's selection needs in this lane, distinct keys):
  - hits: keys already in a slot; they are reused, nothing is transferred;
  - misses: keys not resident; each gets a slot, first from never-used slots, then by evicting the least
    recently used key that is not wanted this step (so a step never evicts what it is about to read);
  - every wanted key becomes most recently used; len(wanted) > capacity is a ValueError.
The caller must transfer each miss's data into its slot before reading it. `keys` ([capacity] int32, the key in
each slot, -1 = free) mirrors the residency as an array: the engine hands it to the device so selection can
favour resident blocks (`BlockScoring.resident_bonus`); pass a view to have it written in place.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np


class SlotCache:
    def __init__(self, capacity: int, keys: np.ndarray | None = None):
        if capacity < 1:
            raise ValueError(f"slot cache capacity={capacity} must be >= 1")
        if keys is None:
            keys = np.empty(capacity, np.int32)
        if keys.shape != (capacity,):
            raise ValueError(f"keys must be a [capacity={capacity}] array, got shape {keys.shape}")
        keys[:] = -1
        self.keys = keys  # [capacity] key held by each slot, -1 = free
        self.capacity = capacity
        self._slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # key -> slot, LRU first
        self._free = list(range(capacity - 1, -1, -1))
        self.hits = 0
        self.misses = 0

    def __contains__(self, key: int) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def slot(self, key: int) -> int:
        return self._slot_of[key]

    def plan(self, wanted: Sequence[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(hits, misses) as lists of (key, slot), in the order of `wanted`; see the module contract."""
        if len(set(wanted)) != len(wanted):
            raise ValueError(f"wanted keys must be distinct, got {list(wanted)}")
        if len(wanted) > self.capacity:
            raise ValueError(f"{len(wanted)} blocks wanted but the slot cache holds {self.capacity}; raise the "
                             "slot cache size to at least the selection budget")
        want = set(wanted)
        hits, misses = [], []
        for key in wanted:
            if key in self._slot_of:
                hits.append((key, self._slot_of[key]))
                self._slot_of.move_to_end(key)
        for key in wanted:
            if key in self._slot_of:
                continue
            if self._free:
                slot = self._free.pop()
            else:
                victim = next(k for k in self._slot_of if k not in want)  # LRU first; exists since len <= cap
                slot = self._slot_of.pop(victim)
            self._slot_of[key] = slot
            self.keys[slot] = key
            misses.append((key, slot))
        self.hits += len(hits)
        self.misses += len(misses)
        return hits, misses
