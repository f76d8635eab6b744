"""The scheduler's `Placer` for offloaded requests: footprints for admission, host rows and sparse state on
admission, their release when a request finishes, and the sparse state of a preempted request moved to the GPU blocks
it lands back in."""

from __future__ import annotations

import numpy as np

from pulseinfer_jax.host_offload.host_pool import HostKVPool
from pulseinfer_jax.host_offload.placement import SparseKV, SparsePlan
from pulseinfer_jax.kv.blocks import BlockAllocator, blocks_for
from pulseinfer_jax.request import Request
from pulseinfer_jax.sched.admission import Candidate
from pulseinfer_jax.sched.pools import offload_blocks


class OffloadPlacer:
    """`scheduler.Placer` over one GPU allocator and one host pool."""

    def __init__(self, plan: SparsePlan, allocator: BlockAllocator, pool: HostKVPool, block_size: int):
        self.plan = plan
        self.allocator = allocator
        self.pool = pool
        self.block_size = block_size
        self._slot_rows_free: list[int] = []  # rows of the device slot-cache table (slot_plan.py), one per request
        self._slot_rows_next = 0
        # preempted offloaded requests: their slot-cache rows went back (the table stays at max_batch + 1 rows, the
        # size every decode program is compiled for); the engine keeps the rows' contents with the swapped KV
        self._parked: set[int] = set()
        # bytes of one step's full selection: middle blocks x one layer-block x sparse layers
        self.selection_bytes = plan.middle_blocks * pool.layer_block_bytes * plan.sparse_layers

    def _sizes(self, req: Request) -> tuple[int, int, int]:
        dense = blocks_for(req.need_tokens, self.block_size)
        a = self.pool.row_align  # rows = one per logical block, in whole extents
        return dense, offload_blocks(self.plan, req), -(-dense // a) * a

    def candidate(self, req: Request) -> Candidate:
        full, peak, rows = self._sizes(req)
        never = self.allocator.capacity + 1
        # IOAA weighs what a dense request grows to (capped at the pool, as it is); it is given its first blocks only
        dense = min(full, never - 1) if blocks_for(req.start_tokens, self.block_size) < never else never
        if not self.pool.allocator.can_allocate(rows) or req.mode == "dense":
            peak = never  # the host pool is full right now (offloading must wait), or the request wants dense
        if req.mode == "offload":
            dense = never
        return Candidate(req.index, dense, peak, float(self.selection_bytes))

    def fits_ever(self, req: Request, mode: str) -> str | None:
        _, peak, rows = self._sizes(req)
        dense = blocks_for(req.start_tokens, self.block_size)  # (dense KV grows as it decodes, preempting if need be)
        gpu_cap, host_cap = self.allocator.capacity, self.pool.allocator.capacity
        dense_ok = dense <= gpu_cap
        gpu_ok, host_ok = peak <= gpu_cap, rows <= host_cap
        bs, row_bytes = self.block_size, self.pool.layer_block_bytes * self.plan.sparse_layers
        host = (f"{rows} rows of the pinned host pool ({rows * bs} tokens, {rows * row_bytes / 2**20:.1f} MiB), which "
                f"holds {host_cap} ({host_cap * bs} tokens, {host_cap * row_bytes / 2**20:.1f} MiB)")
        if mode == "dense" and not dense_ok:
            return (f"its prompt of {len(req.prompt)} tokens and first generated token need {dense} KV blocks of {bs} "
                    f"but the GPU KV pool holds {gpu_cap} ({gpu_cap * bs} tokens); shorten the prompt, raise "
                    "gpu_kv_budget/kv_cache_tokens or use mode='offload'")
        if mode == "offload" and not gpu_ok:
            smallest = self.plan.slot_blocks == self.plan.middle_blocks
            return (f"offloaded it needs {peak} GPU blocks (of {gpu_cap}"
                    + (f", with the smallest slot cache: one step's selection, {self.plan.slot_blocks} blocks"
                       if smallest else "")
                    + "); raise gpu_kv_budget/kv_cache_tokens, or lower max_new_tokens"
                    + ("" if smallest else " or slot_cache_blocks"))
        if mode == "offload" and not host_ok:
            return f"offloaded it needs {host}; raise host_kv_tokens or lower max_new_tokens"
        if mode == "auto" and not (dense_ok or (gpu_ok and host_ok)):
            why = f"{peak} of {gpu_cap} GPU blocks" if not gpu_ok else host
            return (f"fits neither dense ({dense} of {gpu_cap} GPU blocks) nor offloaded ({why}); raise "
                    "gpu_kv_budget or host_kv_tokens, or lower max_new_tokens")
        return None

    def _slot_row(self) -> int:
        if self._slot_rows_free:
            return self._slot_rows_free.pop()
        self._slot_rows_next += 1
        return self._slot_rows_next - 1

    def setup(self, req: Request) -> None:
        rows = self.pool.allocate(blocks_for(req.need_tokens, self.block_size), owner=req.index)
        steady = self.plan.gpu_blocks(req.need_tokens)  # the rest of req.blocks: prefill blocks (prefill_blocks)
        req.sparse = SparseKV(self.plan, req.index, req.need_tokens, req.blocks[:steady], rows, self._slot_row())

    def prefill_blocks(self, req: Request) -> list[int]:
        """The blocks an offloaded request holds only while its prompt prefills (see `offload_blocks`)."""
        return req.blocks[self.plan.gpu_blocks(req.need_tokens):] if req.sparse is not None else []

    def release(self, req: Request) -> None:
        if req.index in self._parked:  # (preempted: its slot row went back then)
            self._parked.remove(req.index)
        else:
            self._slot_rows_free.append(req.sparse.slot_row)
        self.pool.free(req.sparse.host_rows, owner=req.index)

    def preempted(self, req: Request) -> None:
        """A running offloaded request swapped out: its slot-cache table row goes back; its host rows (and so its key
        bounds, kept by host row) stay."""
        if req.index in self._parked:
            raise RuntimeError(f"request {req.index} is preempted already")
        self._parked.add(req.index)
        self._slot_rows_free.append(req.sparse.slot_row)

    def resume(self, req: Request, old_blocks: list[int]) -> None:
        """A preempted offloaded request lands back, the KV of old_blocks[i] in req.blocks[i]: its SparseKV is made
        again over the new blocks, with every block role (resident, spare, the block leaving the window, slots,
        packs) at the block that took its KV, a new slot-cache table row (the engine writes the old row's contents
        there) and its decode state as it was."""
        s = req.sparse
        if req.index not in self._parked or len(old_blocks) != len(req.blocks):
            raise ValueError(f"request {req.index}: resumed with {len(req.blocks)} blocks for {len(old_blocks)} "
                             f"({'preempted' if req.index in self._parked else 'not preempted'}); give it back as "
                             "many blocks as it was preempted with")
        self._parked.remove(req.index)
        to = dict(zip(old_blocks, req.blocks, strict=True))
        to[-1] = -1  # (gpu_arr: not resident)
        moved = SparseKV(self.plan, req.index, req.need_tokens, req.blocks, s.host_rows, self._slot_row())
        moved.num_blocks, moved.tokens, moved.counters = s.num_blocks, s.tokens, s.counters
        moved.gpu_of = {j: to[g] for j, g in s.gpu_of.items()}
        moved.gpu_arr = np.asarray([to[int(g)] for g in s.gpu_arr], np.int32)
        moved.spare = [to[g] for g in s.spare]
        moved.leaving = None if s.leaving is None else (s.leaving[0], to[s.leaving[1]])
        moved.slot_fresh = s.slot_fresh
        # (slots, packs and a device-placed table follow req.blocks' order, as at admission: checked, not assumed)
        if (moved.slot_blocks, moved.packs, moved.table) != tuple([to[g] for g in x] for x in (s.slot_blocks,
                                                                                             s.packs, s.table)):
            raise RuntimeError(f"request {req.index}: its blocks were swapped out in another order than setup gave "
                               "them their roles; swap out and back req.blocks as they are (the scheduler does)")
        req.sparse = moved
