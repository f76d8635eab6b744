"""The request: what every layer of the engine passes around (status, sampling parameters, token events).

A `Request` is made by `Engine.make_request`, queued by the scheduler (`sched/`), placed dense or offloaded by
admission, run by the runner (`runner/`) and finished by the engine's postprocess, which emits `TokenEvent`s.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        t, p, k, n = self.temperature, self.top_p, self.top_k, self.max_new_tokens
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={t!r} must be a finite number >= 0 (0 means greedy)")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p={p!r} must be in (0, 1]")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k={k!r} must be an integer >= 0 (0 disables top-k)")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_new_tokens={n!r} must be an integer >= 1")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r} must be a sequence of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0



class Status(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    RUNNING = "running"
    PREEMPTED = "preempted"  # its GPU blocks were taken back (its KV swapped out, or dropped); it waits at the head
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
    compile_s: float = 0.0  # tracing + compiling inside the steps this request took part in
    warmup_s: float = 0.0  # decode steps of this request that compiled something
    steady_s: float = 0.0  # decode steps of this request that compiled nothing
    steady_tokens: int = 0  # tokens those steady steps made
    admit_step: int = -1  # engine step at which the request was admitted (queueing, without clocks)
    placement: str = ""  # "dense" | "offload" once admitted
    sparse: Any = None  # host_offload.placement.SparseKV of a sparse request
    mode: str | None = None  # a placement this request asks for ("dense" | "offload"), else the engine's mode decides
    stream: int | None = None  # its sampling's random stream (None: its index; a server: the client's seed)
    preemptions: int = 0  # times it was preempted (its KV swapped to host memory, or dropped and recomputed)
    recompute: bool = False  # preempted without a host copy: its prompt and output so far prefill again

    @property
    def need_tokens(self) -> int:
        return len(self.prompt) + self.max_new_tokens

    @property
    def start_tokens(self) -> int:
        """Tokens a dense request's first GPU blocks hold: its context and the KV of the next token (it grows from there
        as it decodes)."""
        return min(self.need_tokens, len(self.context) + 1)

    @property
    def context(self) -> list[int]:
        """The tokens a prefill writes to the cache: the prompt, or after a preemption that dropped the request's KV the
        prompt and every generated token but the last (the one the next decode step writes)."""
        return self.prompt + self.output[:-1] if self.recompute else self.prompt

    @property
    def seq_len(self) -> int:
        """Tokens whose K/V are (or are being) in the cache, plus the pending last token."""
        return len(self.prompt) + len(self.output)



@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One generated token of request `index` (streaming); `finish_reason` is set on its last token."""

    index: int
    token_id: int
    finish_reason: str | None


