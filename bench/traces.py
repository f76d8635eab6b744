"""Selection traces: record which KV blocks sparse decode selects, and replay them in another engine.

A trace is what `bench/selection_trace.py` records from a real model (SmolLM2 on real text): for every request,
decode step and sparse layer, the *middle* blocks each selection lane chose (logical block indices; sinks and
the recent window are always selected and not stored), plus the slot-cache hits and misses of that run.
The throughput bench (`bench/decode_throughput.py`) runs random-weight models on synthetic KV, whose
selections say nothing about real attention; with `--replay TRACE` its sparse requests attend and recall the
blocks the trace selected instead (mapped onto their longer contexts, see `map_blocks`), so the miss pattern
(how many blocks each layer recalls each step, how often a block comes back) is a real model's.

File format (`.npz`, loaded with `load_trace`):
    sel        int16 [R, T, Ls, S, M]  middle blocks selected per request, step, sparse layer, lane; -1 padded
    num_blocks int32 [R, T]            logical blocks of the request at that step (the one being written included)
    hits       int32 [R, T, Ls]        slot-cache hits of the recorded run (selected middle entries reused)
    misses     int32 [R, T, Ls]        ... and misses (entries recalled over PCIe)
    meta       str (JSON)              block_size, budget_blocks, sink_blocks, window_blocks, num_layers,
                                       dense_layers, num_kv_heads, selection, model, prompts
S = 1 for SoloHead, num_kv_heads for headwise; M = budget - sinks - window (the most a lane can select).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

from pulseinfer_jax.kv.blocks import blocks_for
from pulseinfer_jax.selection.hooks import Selector


@dataclasses.dataclass(frozen=True)
class Trace:
    sel: np.ndarray  # int16 [R, T, Ls, S, M]
    num_blocks: np.ndarray  # int32 [R, T]
    hits: np.ndarray  # int32 [R, T, Ls]
    misses: np.ndarray  # int32 [R, T, Ls]
    meta: dict

    @property
    def middle_blocks(self) -> int:
        m = self.meta
        return m["budget_blocks"] - m["sink_blocks"] - m["window_blocks"]

    def save(self, path: str | pathlib.Path) -> pathlib.Path:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, sel=self.sel, num_blocks=self.num_blocks, hits=self.hits, misses=self.misses,
                            meta=np.array(json.dumps(self.meta)))
        return path


def load_trace(path: str | pathlib.Path) -> Trace:
    with np.load(path) as z:
        return Trace(z["sel"], z["num_blocks"], z["hits"], z["misses"], json.loads(str(z["meta"])))



# ---- recording -------------------------------------------------------------------------------------------
class RecordingSelector(Selector):
    """Records every selection the engine plans (middle blocks per lane) and the slot-cache hits and misses per
    layer; `trace(requests)` assembles them. Selects nothing itself: the engine decodes as it would."""

    records_selection = True

    def __init__(self):
        self.recorded_steps: dict[int, int] = {}  # request owner -> decode steps done
        self.records: dict[tuple[int, int, int], tuple[list[list[int]], int, int]] = {}
        self.blocks_at: dict[tuple[int, int], int] = {}

    def begin_step(self, sparse, lengths):
        for s, length in zip(sparse, lengths, strict=True):
            self.blocks_at[(s.owner, self.recorded_steps.get(s.owner, 0))] = blocks_for(length, self.plan.block_size)

    def end_step(self, sparse):
        for s in sparse:
            self.recorded_steps[s.owner] = self.recorded_steps.get(s.owner, 0) + 1

    def observe(self, sparse_layer, sparse, lengths, sel, hits, misses):
        p = self.plan
        sel = np.asarray(sel)
        for b, s in enumerate(sparse):
            n = blocks_for(lengths[b], p.block_size)
            lanes = [[int(j) for j in sel[b, lane] if p.sink_blocks <= j < n - p.window_blocks]
                     for lane in range(p.lanes)]
            self.records[(s.owner, self.recorded_steps.get(s.owner, 0), sparse_layer)] = (
                lanes, int(hits[b]), int(misses[b]))

    def trace(self, owners: list[int], steps: int, meta: dict) -> Trace:
        """The first `steps` decode steps of the requests `owners` (in that order) as a Trace."""
        p = self.plan
        m = p.middle_blocks
        sel = np.full((len(owners), steps, p.sparse_layers, p.lanes, m), -1, np.int16)
        hits = np.zeros((len(owners), steps, p.sparse_layers), np.int32)
        misses = np.zeros_like(hits)
        nblk = np.zeros((len(owners), steps), np.int32)
        for r, owner in enumerate(owners):
            for t in range(steps):
                if (owner, t) not in self.blocks_at:
                    raise ValueError(f"request {owner} decoded fewer than {steps} steps; record more tokens")
                nblk[r, t] = self.blocks_at[(owner, t)]
                for sl in range(p.sparse_layers):
                    lanes, hits[r, t, sl], misses[r, t, sl] = self.records[(owner, t, sl)]
                    for lane, js in enumerate(lanes):
                        sel[r, t, sl, lane, : len(js)] = js
        full = dict(meta, block_size=p.block_size, budget_blocks=p.budget_blocks, sink_blocks=p.sink_blocks,
                    window_blocks=p.window_blocks, num_layers=p.num_layers, dense_layers=p.dense_layers,
                    num_kv_heads=p.num_kv_heads, selection=p.selection)
        return Trace(sel, nblk, hits, misses, full)


# ---- replay ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BlockMap:
    """Where a trace's logical blocks land in a longer replayed context. The trace's middle range at its first
    step ([sink, sink + mid_t0)) is stretched over the replay's ([sink, sink + mid_r0)); blocks that joined the
    middle later (left the window during decode) map one to one onto the replay's later blocks, which join at
    the same rate. Fixed per request, so a block the trace re-selects is the same replayed block (its slot-cache
    hit is preserved) and distinct trace blocks stay distinct (mid_r0 >= mid_t0)."""

    sink: int
    mid_t0: int
    mid_r0: int

    def __post_init__(self) -> None:
        if self.mid_r0 < self.mid_t0 or self.mid_t0 < 1:
            raise ValueError(f"a replayed context needs at least the trace's {self.mid_t0} middle blocks at its first "
                             f"step (has {self.mid_r0}); use longer prompts or a trace of shorter ones")

    def __call__(self, j: np.ndarray) -> np.ndarray:
        o = np.asarray(j, np.int64) - self.sink
        stretched = self.sink + (o * self.mid_r0) // self.mid_t0
        later = self.sink + self.mid_r0 + (o - self.mid_t0)
        return np.where(o < self.mid_t0, stretched, later)


class ReplaySelector(Selector):
    """Selections from a recorded trace (see the module docstring): request with owner i replays trace request i % R
    from its first decode step (wrapping after T steps), sparse layer l replays the trace layer at the same relative
    depth, lane h replays lane h % S. Sinks and window stay the engine's own. `record`: also record what ran."""

    def __init__(self, trace: Trace, record: RecordingSelector | None = None):
        self.trace_in, self.record = trace, record
        self.records_selection = record is not None
        self.replayed_steps: dict[int, int] = {}
        self.maps: dict[int, BlockMap] = {}

    def bind(self, plan):
        super().bind(plan)
        trace, m = self.trace_in, self.trace_in.meta
        if plan.middle_blocks != trace.middle_blocks or plan.block_size != m["block_size"]:
            raise ValueError(f"the trace selects {trace.middle_blocks} middle blocks of {m['block_size']} tokens; "
                             f"this engine {plan.middle_blocks} of {plan.block_size}: record the trace at the same "
                             "budget_tokens, block_size, sink_blocks and window_tokens")
        if self.record is not None:
            self.record.bind(plan)

    def begin_step(self, sparse, lengths):
        p, trace = self.plan, self.trace_in
        for s, length in zip(sparse, lengths, strict=True):
            if s.owner not in self.maps:
                t0 = int(trace.num_blocks[s.owner % trace.sel.shape[0], 0])
                n = blocks_for(length, p.block_size)
                self.maps[s.owner] = BlockMap(p.sink_blocks, t0 - p.sink_blocks - p.window_blocks,
                                              n - p.sink_blocks - p.window_blocks)
        if self.record is not None:
            self.record.begin_step(sparse, lengths)

    def end_step(self, sparse):
        for s in sparse:
            self.replayed_steps[s.owner] = self.replayed_steps.get(s.owner, 0) + 1
        if self.record is not None:
            self.record.end_step(sparse)

    def observe(self, sparse_layer, sparse, lengths, sel, hits, misses):
        if self.record is not None:
            self.record.observe(sparse_layer, sparse, lengths, sel, hits, misses)

    def override(self, sparse, lengths, bp):
        """This step's middle blocks of every sparse layer from the trace, mapped onto each request's context:
        [sparse layers, bp, lanes, M] (-1 padded); the device merges them with its own sinks and window."""
        p, trace = self.plan, self.trace_in
        r_count, t_count, ls_t, s_t, m = trace.sel.shape
        tl = np.round(np.arange(p.sparse_layers) * (ls_t - 1) / max(1, p.sparse_layers - 1)).astype(int)
        lanes = np.arange(p.lanes) % s_t
        out = np.full((p.sparse_layers, bp, p.lanes, m), -1, np.int32)
        for b, s in enumerate(sparse):
            src = trace.sel[s.owner % r_count, self.replayed_steps.get(s.owner, 0) % t_count]  # [Ls_t, S_t, M]
            src = src[tl][:, lanes].astype(np.int64)  # [SL, S, M]
            mapped = self.maps[s.owner](src)
            n = blocks_for(int(lengths[b]), p.block_size)
            ok = (src >= 0) & (mapped >= p.sink_blocks) & (mapped < n - p.window_blocks)
            out[:, b] = np.where(ok, mapped, -1)
        return out
