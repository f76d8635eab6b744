"""Continuous batching over the paged KV pool (pure Python, testable without a model).

Admission reserves every GPU block a request can ever need up front, FIFO, while the batch has room: for a
dense request its whole KV (prompt + max_new_tokens), for an offloaded one its steady GPU footprint plus the few
blocks its layer-by-layer prefill needs beyond its own, given back when the prefill ends (see
host_offload/placement.py and pulseinfer_jax/runner/offloaded_prefill.py). A running request
therefore never runs out of KV blocks and never has to be preempted: no KV is lost or recomputed. A
finished request frees its blocks at once and the head of the queue joins the batch at the next step. A
request that could never fit is rejected when added, so the queue can never wait forever.

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


@dataclasses.dataclass(frozen=True)
class FixedStepTime:
    seconds: float

    def step_time_s(self, batch: int) -> float:
        return self.seconds


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch: int, *, mode: str = "dense",
                 placer: Placer | None = None, ioaa: IOAAConfig | None = None, cost: CostModel | None = None):
        if mode != "dense" and placer is None:
            raise ValueError(f"mode={mode!r} needs a placer (the engine's offload setup)")
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

    def blocks_needed(self, req: Request) -> int:
        return blocks_for(req.need_tokens, self.block_size)

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
                raise ValueError(
                    f"request {req.index} needs {req.need_tokens} tokens of KV ({need} blocks of {self.block_size}) "
                    f"but the KV cache holds {self.allocator.capacity} blocks; raise kv_cache_tokens/gpu_kv_budget "
                    f"or lower max_new_tokens"
                )

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def _candidate(self, req: Request) -> Candidate:
        if self.placer is not None:
            return self.placer.candidate(req)
        return Candidate(req.index, self.blocks_needed(req), self.allocator.capacity + 1, 0.0)

    def admit(self) -> list[Request]:
        """Move waiting requests (FIFO) into prefill while the batch and the pool have room (IOAA decides the
        placement of each)."""
        if not self.waiting:
            return []
        cands = {r.index: self._candidate(r) for r in self.waiting}
        decisions = admit_batch(list(cands.values()), mode=self.mode, free_blocks=self.allocator.num_free,
                                running=len(self.prefilling) + len(self.running),
                                offloaded_running=sum(r.placement == "offload" for r in (*self.prefilling,
                                                                                         *self.running)),
                                offloaded_recall_bytes=self.estimator.total(),
                                observed_step_time_s=self.estimator.step_time_s, cost=self.cost, config=self.ioaa,
                                max_batch=self.max_batch,
                                queued_dense_blocks=sum(c.dense_blocks for c in cands.values()
                                                        if c.dense_blocks <= self.allocator.capacity))
        admitted = []
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
            need = cand.dense_blocks if decision == "dense" else cand.offload_blocks
            req.blocks = self.allocator.allocate(need, owner=req.index)
            req.placement = decision
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
        elif req.status is Status.WAITING and req in self.waiting:  # cancelled before admission
            self.waiting.remove(req)
        self.allocator.free(req.blocks, owner=req.index)
        req.blocks = []
        if req.placement == "offload":
            self.placer.release(req)
            self.estimator.remove(req.index)
        req.status = Status.FINISHED
        req.finish_reason = reason
