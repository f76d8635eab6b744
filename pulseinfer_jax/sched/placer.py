"""The scheduler's `Placer` for offloaded requests: footprints for admission, host rows and sparse state on
admission, their release when a request finishes."""

from __future__ import annotations

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

    def setup(self, req: Request) -> None:
        rows = self.pool.allocate(blocks_for(req.need_tokens, self.block_size), owner=req.index)
        if self._slot_rows_free:
            slot_row = self._slot_rows_free.pop()
        else:
            slot_row, self._slot_rows_next = self._slot_rows_next, self._slot_rows_next + 1
        steady = self.plan.gpu_blocks(req.need_tokens)  # the rest of req.blocks: prefill blocks (prefill_blocks)
        req.sparse = SparseKV(self.plan, req.index, req.need_tokens, req.blocks[:steady], rows, slot_row)

    def prefill_blocks(self, req: Request) -> list[int]:
        """The blocks an offloaded request holds only while its prompt prefills (see `offload_blocks`)."""
        return req.blocks[self.plan.gpu_blocks(req.need_tokens):] if req.sparse is not None else []

    def release(self, req: Request) -> None:
        self._slot_rows_free.append(req.sparse.slot_row)
        self.pool.free(req.sparse.host_rows, owner=req.index)
