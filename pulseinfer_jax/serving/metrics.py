"""Prometheus metrics of the server (`GET /metrics`), in a registry of its own.

Requests: running (by mode: dense / offload) and waiting, finished / cancelled / rejected counts; latency: time to
first token and time per output token, by mode; tokens: prompt and generated, by mode; memory: GPU KV blocks and
host pool rows in use and in all, swap space blocks in use; preemptions (by where the KV went); recall (offloaded
requests), per engine step: bytes and copies host-to-device, slot-cache hits, blocks recalled, recall wait. Updated
from the engine's thread after each step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
BYTES_BUCKETS = tuple(float(2**k) for k in range(10, 36, 2))  # 1 KiB .. 32 GiB per step


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "pulseinfer_"
        self.running = Gauge(p + "requests_running", "requests prefilling or decoding", ["mode"], registry=r)
        self.waiting = Gauge(p + "requests_waiting", "requests queued for admission", registry=r)
        self.requests = Counter(p + "requests", "requests that ended, by outcome", ["outcome"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "from submission to the first token", ["mode"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "mean time per generated token after the first",
                              ["mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "prompt tokens of finished requests", ["mode"], registry=r)
        self.generated = Counter(p + "generated_tokens", "tokens generated", ["mode"], registry=r)
        self.gpu_used = Gauge(p + "gpu_kv_blocks_used", "GPU KV blocks held by requests", registry=r)
        self.gpu_total = Gauge(p + "gpu_kv_blocks_total", "GPU KV blocks of the pool", registry=r)
        self.host_used = Gauge(p + "host_kv_rows_used", "pinned host pool rows (blocks) held by requests", registry=r)
        self.host_total = Gauge(p + "host_kv_rows_total", "pinned host pool rows", registry=r)
        self.steps = Counter(p + "engine_steps", "engine steps run", registry=r)
        self.preempted = Counter(p + "preemptions", "requests preempted when the GPU KV pool ran out, by where their "
                                 "KV went (swap: host memory; recompute: dropped)", ["kind"], registry=r)
        self.swap_used = Gauge(p + "swap_kv_blocks_used", "host swap space held by preempted requests (GPU blocks)",
                               registry=r)
        self.swap_total = Gauge(p + "swap_kv_blocks_total", "host swap space (GPU blocks)", registry=r)
        self.fallback = Gauge(p + "fast_path_fallback", "1 where an \"auto\" fast path failed its start-up check and "
                              "the safe path runs instead, by option", ["option"], registry=r)
        self._preempt_seen: tuple[int, int] = (0, 0)  # the scheduler's (swap, recompute) counts already counted
        labels = ["mode"]  # (recall exists for offloaded requests only: mode="offload")
        self.recall_bytes = Counter(p + "recall_bytes", "bytes recalled host-to-device", labels, registry=r)
        self.recall_copies = Counter(p + "recall_copies", "host-to-device copies of recalls", labels, registry=r)
        self.recalled = Counter(p + "recalled_blocks", "selected blocks the slot caches lacked", labels, registry=r)
        self.hits = Counter(p + "slot_cache_hits", "selected blocks found in the slot caches", labels, registry=r)
        self.recall_wait = Counter(p + "recall_wait_seconds", "time the GPU waited on recalls", labels, registry=r)
        self.step_bytes = Histogram(p + "recall_bytes_per_step", "bytes recalled per engine step with offloaded "
                                    "requests", labels, buckets=BYTES_BUCKETS, registry=r)
        self._log_seen = 0
        self._counters: dict[int, tuple[int, int]] = {}  # request index -> (recalled, reused) already counted

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def pools(self, engine: Any) -> None:
        self.gpu_total.set(engine.allocator.capacity)
        self.host_total.set(engine.host_pool.allocator.capacity if engine.host_pool is not None else 0)
        self.swap_total.set(engine.swap.capacity_blocks if engine.swap is not None else 0)
        for option, _ in engine.backends.fallbacks:
            self.fallback.labels(option).set(1)
        self._preempt_seen = (0, 0)  # (a new scheduler counts from zero)

    def step(self, engine: Any, handles: Iterable[Any]) -> None:
        """After an engine step: requests, pools, and the recall this step made."""
        self.steps.inc()
        self.state(engine)
        if engine.sparse is not None:
            dec = engine.sparse
            if dec.steps_logged < self._log_seen:  # a new decoder (the pools were reopened)
                self._log_seen = 0
            fresh = min(dec.steps_logged - self._log_seen, len(dec.step_log))
            self._log_seen = dec.steps_logged
            for e in list(dec.step_log)[len(dec.step_log) - fresh:]:
                self.recall_bytes.labels("offload").inc(e["h2d_bytes"])
                self.recall_copies.labels("offload").inc(e["h2d_copies"])
                self.recall_wait.labels("offload").inc(e["recall_wait_s"])
                self.step_bytes.labels("offload").observe(e["h2d_bytes"])
        for h in handles:
            self._count_blocks(h.req)

    def state(self, engine: Any) -> None:
        """Requests running and waiting, blocks and rows in use (after a step, or requests leaving between steps)."""
        sched = engine.scheduler
        active = [*sched.prefilling, *sched.running]
        for mode in ("dense", "offload"):
            self.running.labels(mode).set(sum(1 for r in active if (r.placement or "dense") == mode))
        self.waiting.set(len(sched.waiting))
        self.gpu_used.set(engine.allocator.num_used)
        if engine.swap is not None:
            self.swap_used.set(engine.swap.used_blocks)
        now = (sched.preempted_swap, sched.preempted_recompute)
        for kind, n, seen in zip(("swap", "recompute"), now, self._preempt_seen, strict=True):
            self.preempted.labels(kind).inc(max(0, n - seen))
        self._preempt_seen = now
        if engine.host_pool is not None:
            a = engine.host_pool.allocator
            self.host_used.set(a.capacity - a.num_free)

    def _count_blocks(self, req: Any) -> None:
        if req.sparse is None:
            return
        c = req.sparse.counters
        recalled, reused = self._counters.get(req.index, (0, 0))
        self.recalled.labels("offload").inc(c.recalled_blocks - recalled)
        self.hits.labels("offload").inc(c.reused_blocks - reused)
        self._counters[req.index] = (c.recalled_blocks, c.reused_blocks)

    def finished(self, handle: Any, *, cancelled: bool) -> None:
        req = handle.req
        mode = req.placement or "dense"
        self._count_blocks(req)
        self._counters.pop(req.index, None)
        self.requests.labels("cancelled" if cancelled else "finished").inc()
        n = len(req.output)
        self.generated.labels(mode).inc(n)
        self.prompt_tokens.labels(mode).inc(len(req.prompt))
        if handle.t_first is not None:
            self.ttft.labels(mode).observe(handle.t_first - handle.t_submit)
            if n > 1 and req.t_done > req.t_first:
                self.tpot.labels(mode).observe((req.t_done - req.t_first) / (n - 1))

    def rejected(self, why: str) -> None:
        self.requests.labels(f"rejected_{why}").inc()
