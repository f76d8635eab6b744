"""Seconds this process has spent tracing, lowering and compiling (from jax.monitoring's compile events), so step
timings can tell a compiling step from a steady one."""

from __future__ import annotations

import threading

import jax

COMPILE_EVENTS = frozenset({
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
})

_lock = threading.Lock()
_total = [0.0]
_registered = [False]


def _on_duration(event: str, duration: float, **_: object) -> None:
    if event in COMPILE_EVENTS:
        with _lock:
            _total[0] += duration


def compile_seconds() -> float:
    """Compile seconds so far in this process (a counter: take differences around the work)."""
    with _lock:
        if not _registered[0]:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _registered[0] = True
        return _total[0]
