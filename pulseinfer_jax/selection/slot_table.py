"""GPU slot caches: which recalled KV blocks are resident in each request's slots, with LRU eviction (numpy).

Every sparse request has, per sparse layer and lane, an LRU cache of `capacity` slots (SoloHead: one lane, a
slot holds a whole block, every head; headwise: one lane per KV head, slot i of lane h holds head h of a block,
in column h of the request's slot block i). The engine plans them on the device, fused into each sparse layer's
selection call (pulseinfer_jax/selection/slot_plan.py); this module is the contract written in numpy: `SlotTable` holds
every request's caches in one set of arrays and `plan` is vectorised over requests, lanes and wanted blocks. It is
the reference the device planner is tested against (slot for slot), and what scripts use (`SlotCache`, one
request's one-layer cache, e.g. bench/slot_cache_sweep.py).

Contract of `plan(sparse_layer, rows, wanted, wanted_rows)` (per table row = request and lane: the middle
blocks this step's selection needs there, distinct keys >= 0, padded with -1; `wanted_rows` their host rows,
the lookup key, unique to the request that owns them):
  - hits: keys already in a slot of their lane; they are reused, nothing is transferred;
  - misses: keys not resident; each gets a slot, first from never-used slots (lowest slot first), then by
    evicting the least recently used key that is not wanted this step (so a step never evicts what it is about
    to read), misses served in the order of `wanted`;
  - afterwards the lane's recency order is: the older keys, then this step's hits, then its misses (each in
    the order of `wanted`); more than `capacity` keys in a lane, or a repeated key, is a ValueError.
The caller must transfer each miss's data into its slot before reading it. `keys(row)` ([sparse layers, lanes,
capacity] int32, the logical block in each slot, -1 = free) mirrors the residency (the device's selection favours
resident blocks from its own copy: `BlockScoring.resident_bonus`).
`SlotCache` is one request's one-layer cache over its own table (scripts and tests): `plan(wanted)` returns
(key, slot) lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jaxtyping import Bool, Int

_PROTECTED = np.iinfo(np.int64).max  # recency stamp of a slot that must not be a victim now (wanted, or unused)


class SlotTable:
    """The slot caches of every request of an engine: one row per request (see the module contract)."""

    def __init__(self, sparse_layers: int, lanes: int, max_capacity: int, key_rows: int = 64, table_rows: int = 4):
        if sparse_layers < 1 or lanes < 1 or max_capacity < 1:
            raise ValueError(f"SlotTable needs sparse_layers, lanes, max_capacity >= 1, got {sparse_layers}, {lanes}, "
                             f"{max_capacity}")
        self.sparse_layers, self.lanes, self.max_capacity = sparse_layers, lanes, max_capacity
        shape = (sparse_layers, table_rows, lanes, max_capacity)
        self._stamp = np.full(shape, _PROTECTED, np.int64)  # recency per slot: free < 0 ascending, unused = never
        self._key = np.full(shape, -1, np.int32)  # logical block held by each slot
        self._key_row = np.full(shape, -1, np.int32)  # ... and its host row
        self._pos_of = np.full((sparse_layers, lanes, max(1, key_rows) + 1), -1, np.int32)  # host row -> slot
        self._capacity = np.zeros(table_rows, np.int64)  # per table row, 0 = not in use
        self._free = list(range(table_rows - 1, -1, -1))
        self._clock = 0

    # ---- rows ----------------------------------------------------------------------------------
    def add(self, capacity: int) -> int:
        """A new request's caches (every slot free); returns its table row."""
        if not 1 <= capacity <= self.max_capacity:
            raise ValueError(f"slot cache capacity={capacity} must be in 1..{self.max_capacity}")
        if not self._free:
            n = len(self._capacity)
            grow = lambda a, fill: np.concatenate([a, np.full_like(a, fill)], axis=1)  # noqa: E731
            self._stamp, self._key, self._key_row = (grow(self._stamp, _PROTECTED), grow(self._key, -1),
                                                     grow(self._key_row, -1))
            self._capacity = np.concatenate([self._capacity, np.zeros(n, np.int64)])
            self._free = list(range(2 * n - 1, n - 1, -1))
        row = self._free.pop()
        self._capacity[row] = capacity
        self._stamp[:, row] = _PROTECTED
        self._stamp[:, row, :, :capacity] = np.arange(capacity) - capacity  # free slots: lowest taken first
        self._key[:, row] = -1
        self._key_row[:, row] = -1
        return row

    def remove(self, row: int) -> None:
        """Forget a request's caches (its host rows may go to another request next)."""
        if not self._capacity[row]:
            raise ValueError(f"slot table row {row} is not in use")
        held = self._key_row[:, row]  # [SL, S, C]
        sl, lane, _ = np.nonzero(held >= 0)
        self._pos_of[sl, lane, held[held >= 0]] = -1
        self._capacity[row] = 0
        self._stamp[:, row] = _PROTECTED
        self._key[:, row] = self._key_row[:, row] = -1
        self._free.append(row)

    def keys(self, row: int) -> Int[np.ndarray, "SL S C"]:
        """The logical block held by each slot of a request (-1 = free): a copy."""
        return self._key[:, row, :, : self._capacity[row]].copy()

    # ---- one layer of a step -------------------------------------------------------------------
    def plan(self, sparse_layer: int, rows: Int[np.ndarray, " B"], wanted: Int[np.ndarray, "B S W"],
             wanted_rows: Int[np.ndarray, "B S W"]) -> tuple[Int[np.ndarray, "B S W"], Bool[np.ndarray, "B S W"]]:
        """Plan one layer of a step for the requests in table rows `rows` (see the module contract): returns the
        slot of every wanted key (-1 for padding) and whether it was a hit; misses are the other valid entries."""
        rows = np.asarray(rows, np.int64)
        wanted, wanted_rows = np.asarray(wanted), np.asarray(wanted_rows)
        b, lanes = len(rows), self.lanes
        if wanted.shape[:2] != (b, lanes) or wanted_rows.shape != wanted.shape:
            raise ValueError(f"wanted / wanted_rows must be [{b} requests, {lanes} lanes, W], got {wanted.shape} / "
                             f"{wanted_rows.shape}")
        cap = self._capacity[rows]
        if (cap == 0).any():
            raise ValueError(f"slot table rows {rows[cap == 0].tolist()} are not in use")
        valid = wanted >= 0
        count = valid.sum(axis=2)  # [B, S]
        over = count > cap[:, None]
        if over.any():
            raise ValueError(f"{int(count.max())} blocks wanted but the slot cache holds {int(cap[over.any(1)][0])}; "
                             "raise the slot cache size to at least the selection budget")
        srt = np.sort(np.where(valid, wanted_rows, -1), axis=2)
        if ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any():
            raise ValueError(f"wanted keys must be distinct per lane, got {wanted.tolist()}")
        top = int(wanted_rows.max()) if wanted_rows.size else -1
        if top + 1 >= self._pos_of.shape[2]:  # grow the key space (doubling; the last column is a dump)
            grown = np.full(self._pos_of.shape[:2] + (max(2 * self._pos_of.shape[2], top + 2),), -1, np.int32)
            grown[..., : self._pos_of.shape[2] - 1] = self._pos_of[..., :-1]
            self._pos_of = grown
        dump = self._pos_of.shape[2] - 1  # masked-out writes land in this column (never a real key)
        c = self.max_capacity
        pos_of = self._pos_of[sparse_layer]  # view [S, keys + 1]
        li = np.broadcast_to(np.arange(lanes)[None, :, None], wanted.shape)
        pos = np.where(valid, pos_of[li, np.where(valid, wanted_rows, dump)], -1)
        hit = pos >= 0
        miss = valid & ~hit
        # the batch's state [B, S, C + 1], flattened: one spare column (index c) absorbs masked-out writes
        stamp = _with_spare(self._stamp[sparse_layer, rows], _PROTECTED)
        key_row = _with_spare(self._key_row[sparse_layer, rows], -1)
        key = _with_spare(self._key[sparse_layer, rows], -1)
        fs, fr, fk = stamp.reshape(-1), key_row.reshape(-1), key.reshape(-1)
        lane_base = (np.arange(b * lanes) * (c + 1)).reshape(b, lanes, 1)  # flat index of each lane's slot 0
        # victims: the free slots (lowest first), then the least recently used, never a slot wanted now
        hit_at = lane_base + np.where(hit, pos, c)
        cand = stamp.copy()
        cand.reshape(-1)[hit_at] = _PROTECTED
        rank = np.cumsum(miss, axis=2) - 1  # the k-th miss of a lane takes its k-th victim
        need = int(rank[..., -1].max()) + 1 if rank.size else 0
        victim = np.full(wanted.shape, c, np.int64)
        if need:
            cand = cand[..., :c]
            if need < c // 4:  # the few oldest slots only (stamps are distinct, so no tie decides)
                part = np.argpartition(cand, need - 1, axis=2)[..., :need]
                order = np.take_along_axis(part, np.argsort(np.take_along_axis(cand, part, axis=2), axis=2), axis=2)
            else:
                order = np.argsort(cand, axis=2)
            k = order.shape[2]
            picked = order.reshape(-1)[(np.arange(b * lanes) * k).reshape(b, lanes, 1) + np.clip(rank, 0, k - 1)]
            victim = np.where(miss, picked, c)
        vic_at = lane_base + victim
        old = fr[vic_at]  # evicted host rows (-1: a free slot, or not a miss)
        pos_of[li, np.where(old >= 0, old, dump)] = -1
        pos_of[li, np.where(miss, wanted_rows, dump)] = np.where(miss, victim, -1)
        fr[vic_at] = np.where(miss, wanted_rows, -1)
        fk[vic_at] = np.where(miss, wanted, -1)
        # recency: this step's hits, then its misses, after every older key
        self._clock += 1
        base = self._clock * (2 * c + 2)
        fs[hit_at] = base + np.cumsum(hit, axis=2) - 1
        fs[vic_at] = base + c + 1 + rank
        self._stamp[sparse_layer, rows] = stamp[..., :c]
        self._key_row[sparse_layer, rows] = key_row[..., :c]
        self._key[sparse_layer, rows] = key[..., :c]
        return np.where(miss, victim, pos).astype(np.int32), hit


def _with_spare(a: np.ndarray, fill) -> np.ndarray:
    """[..., C] -> [..., C + 1] with `fill` in the extra column (a target for masked-out writes)."""
    out = np.empty(a.shape[:-1] + (a.shape[-1] + 1,), a.dtype)
    out[..., :-1] = a
    out[..., -1] = fill
    return out


class SlotCache:
    """One request's caches of one sparse layer, over a table of its own (the module contract; scripts and
    tests). Keys are any ints >= 0 (they double as the lookup key)."""

    def __init__(self, capacity: int, *, lanes: int = 1):
        if capacity < 1:
            raise ValueError(f"slot cache capacity={capacity} must be >= 1")
        self._table = SlotTable(1, lanes, capacity, table_rows=1)
        self._row = self._table.add(capacity)
        self.capacity, self.lanes = capacity, lanes
        self.hits = 0
        self.misses = 0

    @property
    def keys(self) -> np.ndarray:
        """[capacity] (one lane) or [lanes, capacity]: the key held by each slot, -1 = free (a copy)."""
        k = self._table.keys(self._row)[0]
        return k[0] if self.lanes == 1 else k

    def __contains__(self, key: int) -> bool:
        return bool((self._table.keys(self._row)[0, 0] == key).any())

    def __len__(self) -> int:
        return int((self._table.keys(self._row)[0] >= 0).sum())

    def slot(self, key: int) -> int:
        (where,) = np.nonzero(self._table.keys(self._row)[0, 0] == key)
        if not len(where):
            raise KeyError(key)
        return int(where[0])

    def plan(self, wanted: Sequence[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """One lane: (hits, misses) as lists of (key, slot), in the order of `wanted`."""
        if self.lanes != 1:
            raise ValueError(f"plan() is the one-lane form; this cache has {self.lanes} lanes: use plan_lanes")
        w = np.asarray(list(wanted), np.int64).reshape(1, -1)
        slots, hit = self.plan_lanes(w)
        pairs = [(int(k), int(s)) for k, s in zip(w[0], slots[0], strict=True)]
        return ([p for p, h in zip(pairs, hit[0], strict=True) if h],
                [p for p, h in zip(pairs, hit[0], strict=True) if not h])

    def plan_lanes(self, wanted: Int[np.ndarray, "S W"]) -> tuple[Int[np.ndarray, "S W"], Bool[np.ndarray, "S W"]]:
        """Every lane at once: (slot of each wanted key, -1 for padding; whether it was a hit)."""
        wanted = np.asarray(wanted)
        if wanted.ndim != 2 or wanted.shape[0] != self.lanes:
            raise ValueError(f"wanted must be [lanes={self.lanes}, W], got shape {wanted.shape}")
        slots, hit = self._table.plan(0, np.array([self._row]), wanted[None], wanted[None])
        self.hits += int(hit.sum())
        self.misses += int(((wanted >= 0) & ~hit[0]).sum())
        return slots[0], hit[0]
