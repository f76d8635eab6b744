"""Continuous batching over the paged KV pool (pure Python, testable without a model).

A dense request's KV is allocated as it grows: admission gives it the blocks its prompt and first generated token
need, and before each decode step every running dense request gets the block its next token's KV goes to
(`reserve_decode`). When the GPU pool runs out, the youngest running request (highest index) is preempted: its
blocks' KV is copied to host memory whole (`KVMover.swap_out`, host_offload/swap.py) and the blocks are freed; it
waits at the head of the queue and, once its blocks fit again, lands back bit for bit and resumes. Only when the
host has no room for a dense request is its KV dropped and recomputed on resumption (its prompt and output so far
prefilled again): the last resort, never lost or half-copied KV. An offloaded request is preempted only through
host memory (without room there the next youngest is taken instead): its steady GPU blocks go whole, its host rows
and key bounds stay where they are, and on resumption the placer points its sparse state at the blocks its KV landed
in (`Placer.resume`), so it decodes on exactly as it would have. Preempted requests resume in index order before
anything new is admitted. In mode "dense" admission leaves `watermark` blocks free for the running requests' growth;
in modes "offload" and "auto" IOAA weighs a dense request at what it grows to and counts that growth as taken. A dense
request's output is capped at what the whole pool holds (`max_new_tokens`, finish reason "length"), so a request
never fails for KV it might need later. An offloaded request reserves its steady GPU footprint (its slot caches and
window: it does not grow) plus the few blocks its layer-by-layer prefill needs beyond its own, given back when the
prefill ends (see host_offload/placement.py and pulseinfer_jax/runner/offloaded_prefill.py). A finished request
frees its blocks at once and the head of the queue joins the batch at the next step. A request that could never fit
is rejected when added, so the queue can never wait forever.

Which placement a request gets is IOAA's decision (`pulseinfer_jax.sched.admission.admit_batch`), re-evaluated every
step: mode "dense" / "offload" force it, "auto" runs dense while the queue fits in memory and, under
memory pressure, offloads first while the predicted recall hides behind the decode step. The engine
supplies a `Placer` that knows footprints and sets up / tears down the offloaded state; without one every
request is dense.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Protocol

from pulseinfer_jax.kv.blocks import BlockAllocator, blocks_for
from pulseinfer_jax.request import Request, Status
from pulseinfer_jax.sched.admission import Candidate, CostModel, IOAAConfig, RecallEstimator, admit_batch


class KVMover(Protocol):
    """How preemption moves a running request's GPU KV (supplied by the engine, which owns the cache)."""

    def swap_out(self, req: Request) -> bool:
        """Copy the KV of `req.blocks` (an offloaded request: and its slot caches' state) to host memory; False
        (nothing copied) when the host has no room for it."""
        ...

    def swap_in(self, req: Request, blocks: list[int]) -> None:
        """Write `req`'s host copy into `blocks` (as many as it swapped out, in table order; an offloaded request's
        sparse state already names them) and forget the copy."""
        ...

    def drop(self, req: Request) -> None:
        """Forget `req`'s host copy, if any (it ended while preempted)."""
        ...


class Placer(Protocol):
    """What the scheduler needs to know about offloading (supplied by the engine)."""

    def candidate(self, req: Request) -> Candidate:
        """Footprints of `req`: dense blocks, peak offloaded blocks (more than the pool when it cannot be
        offloaded now, e.g. the host pool is full), per-step selection bytes."""
        ...

    def fits_ever(self, req: Request, mode: str) -> str | None:
        """None if `req` can run in an empty engine under `mode`, else why not (a message)."""
        ...

    def setup(self, req: Request) -> None:
        """Admitted offloaded: req.blocks holds its GPU blocks; allocate host rows, build req.sparse."""
        ...

    def prefill_blocks(self, req: Request) -> list[int]:
        """Of an admitted offloaded request's req.blocks, those it holds only while its prompt prefills."""
        ...

    def release(self, req: Request) -> None:
        """Finished offloaded request: free its host rows (GPU blocks are freed by the scheduler)."""
        ...

    def preempted(self, req: Request) -> None:
        """A running offloaded request swapped out (its GPU blocks about to be freed): give back what only a
        decoding request holds (its row of the slot-cache table); its host rows stay."""
        ...

    def resume(self, req: Request, old_blocks: list[int]) -> None:
        """A preempted offloaded request lands back: req.blocks[i] takes the KV of old_blocks[i]; its sparse state
        is made to name the new blocks (and a slot-cache table row)."""
        ...


@dataclasses.dataclass(frozen=True)
class FixedStepTime:
    seconds: float

    def step_time_s(self, batch: int) -> float:
        return self.seconds


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch: int, *, mode: str = "dense",
                 placer: Placer | None = None, ioaa: IOAAConfig | None = None, cost: CostModel | None = None,
                 mover: KVMover | None = None, watermark: int | None = None):
        if mode != "dense" and placer is None:
            raise ValueError(f"mode={mode!r} needs a placer (the engine's offload setup)")
        self.mover = mover  # None: a preempted request's KV is recomputed
        # blocks admission leaves free for the running requests' growth (1% of the pool, at least one)
        self.watermark = max(1, allocator.capacity // 100) if watermark is None else watermark
        self.allocator = allocator
        self.block_size = block_size
        self.max_batch = max_batch
        self.mode = mode
        self.placer = placer
        self.ioaa = ioaa or IOAAConfig(h2d_bytes_per_s=16e9)
        self.cost = cost or FixedStepTime(0.02)
        self.estimator = RecallEstimator(self.ioaa)
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.preempted_swap = 0  # preemptions whose KV went to host memory
        self.preempted_recompute = 0  # preemptions whose KV was dropped (recomputed on resumption)
        self._swapped: dict[int, list[int]] = {}  # request index -> the blocks its host copy came from, in order
        self._footprint: dict[int, int] = {}  # dense request index -> the blocks IOAA weighed it at (what it grows to)

    def blocks_needed(self, req: Request) -> int:
        """GPU blocks a dense request is given when admitted: its context (prompt, or prompt and output when it is
        recomputed) and the next token's KV."""
        return blocks_for(req.start_tokens, self.block_size)

    @property
    def preemptions(self) -> int:
        return self.preempted_swap + self.preempted_recompute

    def add(self, req: Request) -> None:
        """Queue `req` (FIFO); ValueError if it could never run (`check`)."""
        self.check(req)
        self.waiting.append(req)

    def check(self, req: Request) -> None:
        """ValueError if `req` could never run in this engine, even alone (reads only the pools' sizes)."""
        if req.mode is not None and req.mode != self.mode and self.mode != "auto":
            raise ValueError(f"request {req.index} asks for mode={req.mode!r}, but this engine runs "
                             f"mode={self.mode!r}; per-request placement needs an engine in mode 'auto'")
        if self.placer is not None:
            why = self.placer.fits_ever(req, req.mode or self.mode)
            if why is not None:
                raise ValueError(f"request {req.index}: {why}")
        else:
            need = self.blocks_needed(req)
            if need > self.allocator.capacity:
                cap = self.allocator.capacity
                raise ValueError(
                    f"request {req.index}: its prompt of {len(req.prompt)} tokens and first generated token need "
                    f"{need} KV blocks of {self.block_size} but the GPU KV pool holds {cap} "
                    f"({cap * self.block_size} tokens); shorten the prompt or raise kv_cache_tokens/gpu_kv_budget"
                )

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def _candidate(self, req: Request) -> Candidate:
        """What admission weighs (a dense request is given only its first blocks: `blocks_needed`)."""
        if self.placer is not None:
            return self.placer.candidate(req)
        return Candidate(req.index, self.blocks_needed(req), self.allocator.capacity + 1, 0.0)

    # ---- growth and preemption -------------------------------------------------------------------
    def reserve_decode(self) -> None:
        """Before a decode step: each running dense request (oldest first) gets the block its next token's KV goes to;
        when the pool is out, the youngest running request that can go is preempted (possibly the one that asked)."""
        for r in sorted(self._dense_running(), key=lambda r: r.index):
            while r.status is Status.RUNNING:
                need = blocks_for(r.seq_len, self.block_size) - len(r.blocks)
                if need <= 0:
                    break
                if self.allocator.num_free >= need:
                    r.blocks += self.allocator.allocate(need, owner=r.index)
                    break
                self._preempt_youngest()

    def _dense_running(self) -> list[Request]:
        return [r for r in self.running if r.placement != "offload"]

    def _preempt_youngest(self) -> None:
        """Preempt the youngest running request that can go (an offloaded one only with room in host memory; a dense
        one always can, so the dense request asking for a block goes at the latest)."""
        for victim in sorted(self.running, key=lambda x: x.index, reverse=True):
            if self.preempt(victim):
                return

    def preempt(self, req: Request) -> bool:
        """Take a running request's blocks back: its KV to host memory (a dense one without room there: dropped to be
        recomputed); it waits at the head of the queue, behind older preempted requests. An offloaded request goes
        only to host memory (recomputing it would prefill its whole context again, layer by layer): without room
        there it keeps running and this returns False."""
        if req.status is not Status.RUNNING:
            raise ValueError(f"request {req.index} is {req.status.value}; only running requests are preempted")
        swapped = self.mover is not None and self.mover.swap_out(req)
        if not swapped and req.placement == "offload":
            return False
        if swapped:
            self.preempted_swap += 1
            self._swapped[req.index] = list(req.blocks)
            if req.placement == "offload":
                self.placer.preempted(req)
        else:
            self.preempted_recompute += 1
            req.recompute, req.prefilled = True, 0
        self.allocator.free(req.blocks, owner=req.index)
        req.blocks = []
        self.running.remove(req)
        req.status = Status.PREEMPTED
        req.preemptions += 1
        head = [r for r in self.waiting if r.status is Status.PREEMPTED]
        for _ in head:
            self.waiting.popleft()
        for r in sorted([*head, req], key=lambda r: r.index, reverse=True):
            self.waiting.appendleft(r)
        return True

    def _resume(self) -> list[Request]:
        """Preempted requests at the head of the queue, oldest first, back into the batch while their blocks fit: a
        swapped one lands back and decodes on (an offloaded one in as many blocks as it left: it does not grow), a
        recomputed one prefills its context again."""
        back = []
        while self.waiting and self.waiting[0].status is Status.PREEMPTED:
            req = self.waiting[0]
            if len(self.prefilling) + len(self.running) >= self.max_batch:
                break
            held = 0 if req.recompute else len(self._swapped[req.index])
            if req.recompute:
                need = self.blocks_needed(req)
            elif req.placement == "offload":
                need = held
            else:
                need = max(blocks_for(req.seq_len, self.block_size), held)
            if need > self.allocator.num_free:
                break
            self.waiting.popleft()
            if req.recompute:
                req.blocks = self.allocator.allocate(need, owner=req.index)
                req.status = Status.PREFILLING
                self.prefilling.append(req)
            else:
                old = self._swapped.pop(req.index)
                req.blocks = self.allocator.allocate(held, owner=req.index)
                if req.placement == "offload":
                    self.placer.resume(req, old)
                self.mover.swap_in(req, req.blocks)
                req.blocks += self.allocator.allocate(need - held, owner=req.index)
                req.status = Status.RUNNING
                self.running.append(req)
            back.append(req)
        return back

    def admit(self) -> list[Request]:
        """Preempted requests back first; then waiting requests (FIFO) into prefill while the batch and the pool have
        room (IOAA decides the placement of each), leaving `watermark` blocks for the running requests' growth."""
        admitted = self._resume()
        if not self.waiting or self.waiting[0].status is Status.PREEMPTED:
            return admitted
        cands = {r.index: self._candidate(r) for r in self.waiting}
        if self.placer is not None:  # IOAA weighs dense requests by what they grow to: it sees that growth as taken
            reserve = sum(max(0, self._footprint.get(r.index, 0) - len(r.blocks))
                          for r in (*self.prefilling, *self.running) if r.placement == "dense")
        else:  # dense only: admission leaves the watermark for growth (an idle engine takes what fits)
            reserve = self.watermark if (self.running or self.prefilling) else 0
        decisions = admit_batch(list(cands.values()), mode=self.mode,
                                free_blocks=max(0, self.allocator.num_free - reserve),
                                running=len(self.prefilling) + len(self.running),
                                offloaded_running=sum(r.placement == "offload" for r in (*self.prefilling,
                                                                                         *self.running)),
                                offloaded_recall_bytes=self.estimator.total(),
                                observed_step_time_s=self.estimator.step_time_s, cost=self.cost, config=self.ioaa,
                                max_batch=self.max_batch,
                                queued_dense_blocks=sum(c.dense_blocks for c in cands.values()
                                                        if c.dense_blocks <= self.allocator.capacity))
        for key, decision in decisions:
            if decision == "wait":
                break
            req = self.waiting[0]
            assert req.index == key, "admission must follow the queue order"
            cand = cands[key]
            if decision == "offload":  # the host pool may have filled with the requests admitted just before
                cand = self.placer.candidate(req)
                if cand.offload_blocks > self.allocator.num_free:
                    break
            self.waiting.popleft()
            need = self.blocks_needed(req) if decision == "dense" else cand.offload_blocks
            if decision == "dense":
                self._footprint[req.index] = cand.dense_blocks
            req.blocks = self.allocator.allocate(need, owner=req.index)
            req.placement = decision
            if decision == "dense":  # it grows as it decodes, up to what the whole pool holds
                req.max_new_tokens = min(req.max_new_tokens,
                                         self.allocator.capacity * self.block_size - len(req.prompt))
            if decision == "offload":
                self.placer.setup(req)
                self.estimator.add(req.index, cand.budget_bytes)
            req.status = Status.PREFILLING
            self.prefilling.append(req)
            admitted.append(req)
        return admitted

    def next_prefill(self) -> Request | None:
        return self.prefilling[0] if self.prefilling else None

    def prefill_done(self, req: Request) -> None:
        """The prompt is in the cache: the request joins the running batch (the engine decodes it in the same step);
        blocks it held only for its prefill go back to the pool."""
        if req.placement == "offload":
            extra = self.placer.prefill_blocks(req)
            if extra:
                self.allocator.free(extra, owner=req.index)
                req.blocks = req.blocks[: len(req.blocks) - len(extra)]
        self.prefilling.remove(req)
        req.status = Status.RUNNING
        self.running.append(req)

    def finish(self, req: Request, reason: str) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.PREFILLING:
            self.prefilling.remove(req)
        elif req.status in (Status.WAITING, Status.PREEMPTED) and req in self.waiting:  # cancelled while waiting
            self.waiting.remove(req)
            if self._swapped.pop(req.index, None) is not None:
                self.mover.drop(req)
        self.allocator.free(req.blocks, owner=req.index)
        req.blocks = []
        self._footprint.pop(req.index, None)
        if req.placement == "offload":
            self.placer.release(req)
            self.estimator.remove(req.index)
        req.status = Status.FINISHED
        req.finish_reason = reason
