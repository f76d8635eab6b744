"""Continuous batching over the paged KV pool (pure Python, testable without a model).

Admission reserves every block a request can ever need (prompt + max_new_tokens) up front, FIFO, while
the batch has room. A running request therefore never runs out of KV blocks and never has to be
preempted: no KV is lost or recomputed. A finished request frees its blocks at once and the head of the
queue joins the batch at the next step. A request larger than the whole pool is rejected when added,
so the queue can never wait forever.
"""

from __future__ import annotations

import collections
import dataclasses
import enum

from pulseinfer_jax.kv_cache import BlockAllocator, blocks_for
from pulseinfer_jax.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    index: int  # position in the caller's list; also seeds the request's PRNG stream
    prompt: list[int]
    sampling: SamplingParams
    max_new_tokens: int  # effective: capped by the model's maximum positions
    status: Status = Status.WAITING
    blocks: list[int] = dataclasses.field(default_factory=list)
    prefilled: int = 0
    output: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    # wall-clock marks (time.perf_counter) and accumulated seconds
    t_submit: float = 0.0
    t_admit: float = 0.0
    t_first: float = 0.0
    t_done: float = 0.0
    prefill_s: float = 0.0
    admit_step: int = -1  # engine step at which the request was admitted (queueing, without clocks)

    @property
    def need_tokens(self) -> int:
        return len(self.prompt) + self.max_new_tokens

    @property
    def seq_len(self) -> int:
        """Tokens whose K/V are (or are being) in the cache, plus the pending last token."""
        return len(self.prompt) + len(self.output)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, block_size: int, max_batch: int):
        self.allocator = allocator
        self.block_size = block_size
        self.max_batch = max_batch
        self.waiting: collections.deque[Request] = collections.deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []

    def blocks_needed(self, req: Request) -> int:
        return blocks_for(req.need_tokens, self.block_size)

    def add(self, req: Request) -> None:
        need = self.blocks_needed(req)
        if need > self.allocator.capacity:
            raise ValueError(
                f"request {req.index} needs {req.need_tokens} tokens of KV ({need} blocks of {self.block_size}) "
                f"but the KV cache holds {self.allocator.capacity} blocks; raise kv_cache_tokens/kv_cache_bytes "
                f"or lower max_new_tokens"
            )
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def admit(self) -> list[Request]:
        """Move waiting requests (FIFO) into prefill while the batch and the pool have room."""
        admitted = []
        while self.waiting and len(self.prefilling) + len(self.running) < self.max_batch:
            req = self.waiting[0]
            need = self.blocks_needed(req)
            if not self.allocator.can_allocate(need):
                break
            self.waiting.popleft()
            req.blocks = self.allocator.allocate(need, owner=req.index)
            req.status = Status.PREFILLING
            self.prefilling.append(req)
            admitted.append(req)
        return admitted

    def next_prefill(self) -> Request | None:
        return self.prefilling[0] if self.prefilling else None

    def prefill_done(self, req: Request) -> None:
        self.prefilling.remove(req)
        req.status = Status.RUNNING
        self.running.append(req)

    def finish(self, req: Request, reason: str) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.PREFILLING:
            self.prefilling.remove(req)
        self.allocator.free(req.blocks, owner=req.index)
        req.blocks = []
        req.status = Status.FINISHED
        req.finish_reason = reason
