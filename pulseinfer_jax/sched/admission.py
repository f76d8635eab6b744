"""IO-Adaptive Offloading Admission (IOAA): dense, offloaded or wait, per waiting request (pure Python, no jax).

A request runs either dense (all its KV blocks on the GPU) or offloaded (its KV lives in host memory; the GPU
keeps only a small resident part and every decode step recalls the selected blocks it is missing over PCIe).
Admission decides, for the head of the queue, which of the two it gets, or that it waits, so that PCIe never
becomes the bottleneck of a decode step:

* while GPU memory is not what limits the batch (every queued request fits dense in the free blocks): dense
  (dense costs no PCIe traffic and is exact);
* under memory pressure (the queue's dense demand exceeds the free blocks), or once the batch holds an offloaded
  request, offloading comes first: a request is offloaded if its resident blocks fit and the predicted recall of
  *all* offloaded requests, this one included, can be moved in ``slack`` of one decode step at the host-to-device
  bandwidth, since an offloaded request takes a fraction of a dense one's GPU blocks and leaves room for more
  requests in the batch; only when PCIe has no room left does it go dense (if that fits). Beside offloaded
  requests a dense one is not free even when it fits: it reads its whole KV every step where an offloaded one reads
  its selection (and under the same-layer schedules the engine runs dense requests in a step of their own, which
  reads every weight once more; with recall ahead they join the offloaded requests' layer calls);
* otherwise wait.
Greedy "dense whenever it fits" would fill the GPU with the first few requests and leave no room to offload
the rest: a batch no larger than dense serving's, which is what the bench (bench/decode_throughput.py) showed.

Recall is predicted per request by ``RecallEstimator``: a new request starts at ``prior_miss_fraction`` of its
per-step selection budget (what a real model's traces missed, bench/RESULTS.md "Recall volume"), then follows an EMA
of its observed misses. Everything here is a pure function of
explicit inputs (or a small explicit object), so the policy is unit-tested against a mock cost model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Literal, Protocol

Decision = Literal["dense", "offload", "wait"]
ADMISSION_MODES = ("dense", "offload", "auto")


def _check_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    return float(value)


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be a non-negative integer")
    return value


@dataclasses.dataclass(frozen=True)
class IOAAConfig:
    """Knobs of the admission policy; all validated on construction (ValueError names the bad field)."""

    h2d_bytes_per_s: float  # host-to-device bandwidth (measured once at start-up on the GPU, or configured); > 0
    slack: float = 0.8  # recall may use at most this fraction of the decode step time; in (0, 1]
    # before any observation, a new offloaded request is predicted to recall this fraction of its per-step
    # selection budget bytes; in [0, 1]. SmolLM2's selection traces on real text missed 1.4-3.4% of it per step
    # (2x slot cache, budgets 1,024 / 2,048), ~7% over the predictor's first steps at the GPU suite's point A
    # (bench/predict.py); 0.1 covers those, and the EMA of what each request recalls takes over
    prior_miss_fraction: float = 0.1
    ema: float = 0.3  # weight of the newest observation in the running estimates; in (0, 1]

    def __post_init__(self) -> None:
        bw = _check_number("h2d_bytes_per_s", self.h2d_bytes_per_s)
        if bw <= 0:
            raise ValueError(f"h2d_bytes_per_s={self.h2d_bytes_per_s!r} must be > 0; measure the host-to-device "
                             f"bandwidth or configure it (bytes per second)")
        if not 0 < _check_number("slack", self.slack) <= 1:
            raise ValueError(f"slack={self.slack!r} must be in (0, 1]: the fraction of a decode step recall may use")
        if not 0 <= _check_number("prior_miss_fraction", self.prior_miss_fraction) <= 1:
            raise ValueError(f"prior_miss_fraction={self.prior_miss_fraction!r} must be in [0, 1]")
        if not 0 < _check_number("ema", self.ema) <= 1:
            raise ValueError(f"ema={self.ema!r} must be in (0, 1] (1 = use only the newest observation)")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What admission knows about one waiting request."""

    key: int  # request id
    dense_blocks: int  # GPU blocks it needs if dense
    offload_blocks: int  # GPU blocks it needs (peak) if offloaded
    budget_bytes: float  # bytes of one decode step's full selection for this request (all sparse layers)

    def __post_init__(self) -> None:
        _check_count(f"candidate {self.key}: dense_blocks", self.dense_blocks)
        _check_count(f"candidate {self.key}: offload_blocks", self.offload_blocks)
        if _check_number(f"candidate {self.key}: budget_bytes", self.budget_bytes) < 0:
            raise ValueError(f"candidate {self.key}: budget_bytes={self.budget_bytes!r} must be >= 0")


class CostModel(Protocol):
    def step_time_s(self, batch: int) -> float:
        """Predicted decode step time in seconds at this batch size (> 0)."""
        ...


class RecallEstimator:
    """Running per-request estimate of recall bytes per decode step (EMA of observed miss volumes), plus an EMA
    of the observed decode step time.

    Track every offloaded request from admission (``add``) to finish (``remove``); feed ``observe`` with the bytes
    the request actually recalled in a step and ``observe_step_time`` with measured step times. ``total()`` and
    ``step_time_s`` are then what ``decide`` / ``admit_batch`` take as ``offloaded_recall_bytes`` and
    ``observed_step_time_s``.
    """

    def __init__(self, config: IOAAConfig):
        self.config = config
        self._predicted: dict[int, float] = {}
        self._step_time_s: float | None = None

    def add(self, key: int, budget_bytes: float) -> None:
        """Start tracking request `key`: predicted = prior_miss_fraction * budget_bytes."""
        if key in self._predicted:
            raise ValueError(f"request {key} is already tracked; remove() it before adding it again")
        if _check_number("budget_bytes", budget_bytes) < 0:
            raise ValueError(f"budget_bytes={budget_bytes!r} for request {key} must be >= 0")
        self._predicted[key] = prior_recall_bytes(budget_bytes, self.config)

    def observe(self, key: int, recall_bytes: float) -> None:
        """One step's observed recall of request `key`: predicted <- ema * recall + (1 - ema) * predicted."""
        if key not in self._predicted:
            raise KeyError(f"request {key} is not tracked; add() it when it is admitted offloaded")
        if _check_number("recall_bytes", recall_bytes) < 0:
            raise ValueError(f"recall_bytes={recall_bytes!r} for request {key} must be >= 0")
        a = self.config.ema
        self._predicted[key] = a * float(recall_bytes) + (1.0 - a) * self._predicted[key]

    def remove(self, key: int) -> None:
        """Stop tracking a finished request (KeyError if it was not tracked)."""
        if key not in self._predicted:
            raise KeyError(f"request {key} is not tracked; nothing to remove")
        del self._predicted[key]

    def predicted(self, key: int) -> float:
        """Predicted recall bytes per decode step of request `key` (KeyError if not tracked)."""
        if key not in self._predicted:
            raise KeyError(f"request {key} is not tracked")
        return self._predicted[key]

    def total(self) -> float:
        """Sum of the predictions over all tracked requests (0.0 when none)."""
        return math.fsum(self._predicted.values())

    def __len__(self) -> int:
        return len(self._predicted)

    def __contains__(self, key: object) -> bool:
        return key in self._predicted

    def observe_step_time(self, seconds: float) -> None:
        """A measured decode step time; the first one is taken as is, later ones enter the EMA."""
        if _check_number("seconds", seconds) <= 0:
            raise ValueError(f"step time {seconds!r} s must be > 0")
        s = float(seconds)
        prev = self._step_time_s
        self._step_time_s = s if prev is None else self.config.ema * s + (1.0 - self.config.ema) * prev

    @property
    def step_time_s(self) -> float | None:
        """EMA of the observed decode step time; None before any observation."""
        return self._step_time_s


def prior_recall_bytes(budget_bytes: float, config: IOAAConfig) -> float:
    """Predicted recall bytes per step of a request not yet observed: prior_miss_fraction * budget_bytes."""
    return config.prior_miss_fraction * float(budget_bytes)


def hideable_step_time_s(running: int, observed_step_time_s: float | None, cost: CostModel) -> float:
    """The decode step time recall can hide behind once one more request joins a batch of `running`.

    It is max(observed EMA step time, cost.step_time_s(running + 1)). The cost model predicts the step at the
    grown batch, which the observation (taken at the old batch size) cannot know; the observation captures what
    the model misses (a slower machine, long contexts). Taking the larger one trusts whichever says the step is
    longer: a step is at least as long as either says, and under-estimating it would only make admission wait
    more than needed. Too optimistic a choice is bounded by `slack` and corrected by the observed recall.
    """
    predicted = float(cost.step_time_s(running + 1))
    if not math.isfinite(predicted) or predicted <= 0:
        raise ValueError(f"cost model returned step_time_s({running + 1})={predicted!r}; it must be a positive "
                         f"finite number of seconds")
    if observed_step_time_s is None:
        return predicted
    return max(float(observed_step_time_s), predicted)


def decide(
    candidate: Candidate,
    *,
    mode: str,
    free_blocks: int,
    running: int,
    offloaded_recall_bytes: float,
    observed_step_time_s: float | None,
    cost: CostModel,
    config: IOAAConfig,
    memory_bound: bool = False,
    offloaded_running: int = 0,
) -> Decision:
    """Decide how one waiting request is admitted now: "dense", "offload" or "wait".

    mode "dense" / "offload" force that placement: admitted iff its blocks of that kind fit in `free_blocks`
    (no bandwidth check). mode "auto" (IOAA), with ``pcie_ok`` meaning
    ``(offloaded_recall_bytes + prior) / h2d_bytes_per_s <= slack * step_time``
    (``prior = prior_miss_fraction * budget_bytes``, ``step_time = hideable_step_time_s(running, ...)``):

    1. not `memory_bound` and no offloaded request in the batch (``offloaded_running == 0``): "dense" if
       ``dense_blocks <= free_blocks``;
       `memory_bound` (the queue's dense demand exceeds the free blocks) or offloaded requests running (a dense
       request beside them reads its whole KV every step): "offload" if ``offload_blocks <= free_blocks``
       and ``pcie_ok``, else "dense" if it fits;
    2. else "offload" if ``offload_blocks <= free_blocks`` and ``pcie_ok``;
    3. else "offload" anyway if ``offload_blocks <= free_blocks`` and nothing is running (``running == 0``):
       with an empty batch nothing can change the bandwidth picture, so waiting would stall the queue forever;
       the request then runs PCIe-bound, which is still progress;
    4. else "wait".

    `running` is the number of requests in the batch (dense and offloaded), `offloaded_running` how many of them
    are offloaded, `offloaded_recall_bytes` the
    predicted per-step recall of the offloaded ones (``RecallEstimator.total()``), `observed_step_time_s` the
    measured step-time EMA (``RecallEstimator.step_time_s``; None before any step). A request whose
    offload_blocks exceed the whole pool waits forever: reject such requests when they are submitted.
    """
    if mode not in ADMISSION_MODES:
        raise ValueError(f"mode={mode!r} is not an admission mode; use one of {', '.join(ADMISSION_MODES)}")
    _check_count("free_blocks", free_blocks)
    _check_count("running", running)
    if _check_count("offloaded_running", offloaded_running) > running:
        raise ValueError(f"offloaded_running={offloaded_running} exceeds running={running}")
    if _check_number("offloaded_recall_bytes", offloaded_recall_bytes) < 0:
        raise ValueError(f"offloaded_recall_bytes={offloaded_recall_bytes!r} must be >= 0")
    if observed_step_time_s is not None and _check_number("observed_step_time_s", observed_step_time_s) <= 0:
        raise ValueError(f"observed_step_time_s={observed_step_time_s!r} must be > 0 or None")

    fits_dense = candidate.dense_blocks <= free_blocks
    fits_offload = candidate.offload_blocks <= free_blocks
    if mode == "dense":
        return "dense" if fits_dense else "wait"
    if mode == "offload":
        return "offload" if fits_offload else "wait"
    if fits_dense and not memory_bound and offloaded_running == 0:
        return "dense"
    if fits_offload:
        step_time = hideable_step_time_s(running, observed_step_time_s, cost)
        recall = offloaded_recall_bytes + prior_recall_bytes(candidate.budget_bytes, config)
        # compare in bytes: recall / bw <= slack * step  <=>  recall <= slack * step * bw (bw > 0)
        if recall <= config.slack * step_time * config.h2d_bytes_per_s:
            return "offload"
    if fits_dense:
        return "dense"
    return "offload" if fits_offload and running == 0 else "wait"


def admit_batch(
    candidates: Iterable[Candidate],
    *,
    mode: str,
    free_blocks: int,
    running: int,
    offloaded_recall_bytes: float,
    observed_step_time_s: float | None,
    cost: CostModel,
    config: IOAAConfig,
    max_batch: int | None = None,
    queued_dense_blocks: int | None = None,
    offloaded_running: int = 0,
) -> list[tuple[int, Decision]]:
    """Admit from the FIFO queue `candidates` (head first) as many requests as fit now.

    Each candidate is judged by ``decide`` in queue order; after an admission the free blocks drop by the blocks
    it takes, `running` grows by one and, if offloaded, `offloaded_running` too and its prior recall prediction is
    added to the offloaded total, so later candidates see the state it leaves. Evaluation stops at the first "wait"
    (or when the batch reaches `max_batch`, which counts as a wait): nothing behind a waiting request is admitted
    even if it would fit, so a large request is never overtaken forever by a stream of small ones.

    `queued_dense_blocks` is the dense demand of the whole queue (the sum of its candidates' dense_blocks; the
    scheduler knows it, a generator of candidates could not give it without being consumed): while the demand
    not yet admitted exceeds the free blocks, the scan is `memory_bound` (see ``decide``). None = never.

    Returns ``(key, decision)`` for every admitted request in order, followed by ``(head_key, "wait")`` for the
    request that stopped the scan, if any; an empty queue gives []. Nothing is mutated: the caller allocates the
    blocks, ``RecallEstimator.add``-s the offloaded ones (with the same budget_bytes, so its prior matches) and
    re-runs this every engine step.
    """
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
        raise ValueError(f"max_batch={max_batch!r} must be a positive integer or None")
    out: list[tuple[int, Decision]] = []
    for cand in candidates:
        if max_batch is not None and running >= max_batch:
            out.append((cand.key, "wait"))
            break
        bound = queued_dense_blocks is not None and queued_dense_blocks > free_blocks
        d = decide(cand, mode=mode, free_blocks=free_blocks, running=running,
                   offloaded_recall_bytes=offloaded_recall_bytes, observed_step_time_s=observed_step_time_s,
                   cost=cost, config=config, memory_bound=bound, offloaded_running=offloaded_running)
        out.append((cand.key, d))
        if d == "wait":
            break
        running += 1
        if queued_dense_blocks is not None:
            queued_dense_blocks -= cand.dense_blocks
        if d == "dense":
            free_blocks -= cand.dense_blocks
        else:
            free_blocks -= cand.offload_blocks
            offloaded_running += 1
            offloaded_recall_bytes += prior_recall_bytes(cand.budget_bytes, config)
    return out
