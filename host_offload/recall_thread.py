"""The recall thread: the host half of a recall (gather the missed blocks, start their host-to-device copy) run off
the driver's thread, one recall after another (one host gather, one link).

Where the pool's gather is host code (the "numpy" backend), a recall issued one step ahead goes here: the driver
hands over the rows and goes on dispatching, and the copy overlaps the GPU's step. (The "xla" backend's gather is an
XLA host computation inside a GPU program: XLA starts it only after all GPU work queued before it and launches none
of the device's later work until it ends, so it cannot overlap the step wherever it is called from.)
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable

from jaxtyping import Array


class Recall:
    """A recall's staging on the device: made already, or being made on the recall thread."""

    def __init__(self, made: Array | None = None, future: concurrent.futures.Future | None = None):
        if (made is None) == (future is None):
            raise ValueError("a Recall is either made (an array) or pending (a future)")
        self._made, self._future = made, future

    def gathered(self) -> bool:
        """Whether the host side is done (the array exists; its copy may still be in flight)."""
        return self._future is None or self._future.done()

    def ready(self) -> bool:
        """Whether the staging sits on the device (gathered and copied)."""
        return self.gathered() and self.result()[0].is_ready()

    def result(self) -> tuple[Array, float]:
        """(the staging array, seconds this call waited for the recall thread): re-raises the thread's error."""
        if self._future is None:
            return self._made, 0.0
        t = time.perf_counter()
        self._made, self._future = self._future.result(), None
        return self._made, time.perf_counter() - t


class RecallThread:
    """One worker thread running recall jobs in the order they were submitted."""

    def __init__(self, name: str = "pulseinfer-recall"):
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, job: Callable[[], Array]) -> Recall:
        return Recall(future=self._executor.submit(job))

    def drain(self) -> None:
        """Wait until every job submitted so far has finished (the pool's data is then the driver's alone)."""
        self._executor.submit(lambda: None).result()

    def close(self) -> None:
        self._executor.shutdown(wait=True)
