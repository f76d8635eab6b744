"""Where a sparse layer's middle blocks come from: the engine's own scorer, or a strategy given to the engine.

The sparse pipeline (`sparse_decoder.SparseDecoder`) calls its `Selector` at fixed points of a decode step; the
default one
changes nothing (the scorer inside `sparse_layer.sparse_pre` selects). Benchmarks inject others through
`Engine(..., selector=...)`: `bench/traces.py` records every selection and replays a recorded trace.
"""

from __future__ import annotations

import jax
import numpy as np

from pulseinfer_jax.host_offload.placement import SparseKV, SparsePlan


class Selector:
    """The engine's own selection: no override, nothing recorded."""

    records_selection = False  # whether `observe` reads `sel` (the step then reads its selections back, once)

    def bind(self, plan: SparsePlan) -> None:
        """Called when a pipeline is built with `plan` (again when the engine rebuilds it); may refuse the plan."""
        self.plan = plan

    def begin_step(self, sparse: list[SparseKV], lengths: list[int]) -> None:
        """Before a decode step of the offloaded requests `sparse` (`lengths`: their tokens)."""

    def override(self, sparse: list[SparseKV], lengths: np.ndarray, bp: int) -> np.ndarray | None:
        """Middle blocks to select instead of the scorer's for a micro-batch padded to `bp` rows ([sparse layers, bp,
        lanes, middle blocks] int32, -1 padded; a lane holding `select_plan.SCORER` keeps the scorer's; the device
        keeps its own sinks and window), or None: the scorer's. Either way the step runs the same programs."""
        return None

    def observe(self, sparse_layer: int, sparse: list[SparseKV], lengths: list[int], sel: jax.Array | np.ndarray | None,
                hits: np.ndarray, misses: np.ndarray) -> None:
        """After a sparse layer's plan reached the host: its selection `sel` ([B, S, budget]; None unless
        `records_selection`) and each row's slot-cache hits and misses."""

    def end_step(self, sparse: list[SparseKV]) -> None:
        """After the decode step."""
