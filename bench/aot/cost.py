"""Static cost of a compiled GPU program: HBM bytes, kernel launches, CUDA graphs, host transfers and syncs.

Bytes come from the optimised HLO (`traffic.py`, per instruction, loops times their trip count), launches from
XLA's thunk sequence (`thunks.py`: what the GPU executable issues, command buffers and loops included). The
time model:

    t = bytes / bandwidth + launches * t_launch + host_syncs * t_sync

with the bandwidth an H200 reaches on streaming reads (not its 4.8 TB/s peak) and t_launch, t_sync calibrated on
measured H200 steps (`bench/predict.py --calibrate`, bench/RESULTS.md). Host-side work (a host gather run by
XLA:CPU, a PCIe copy) is reported separately: its time depends on the host and the link, not on HBM.
"""

from __future__ import annotations

import dataclasses

from bench.aot import hlo, thunks
from bench.aot.traffic import KernelTraffic, instruction_traffic

H200_STREAM_BW = 4.3e12  # bytes/s an H200 sustains on large streaming kernels (of 4.8 TB/s peak)


@dataclasses.dataclass(frozen=True)
class TimeModel:
    """predicted seconds = bytes / bandwidth + launches * t_launch + host_syncs * t_sync."""

    bandwidth: float = H200_STREAM_BW
    t_launch: float = 2.5e-6
    t_sync: float = 20e-6

    def seconds(self, cost: ProgramCost, calls: float = 1.0) -> float:
        return calls * (cost.bytes / self.bandwidth + cost.launches * self.t_launch + cost.host_syncs * self.t_sync)


@dataclasses.dataclass
class ProgramCost:
    bytes: int = 0  # HBM bytes read + written by the program's kernels
    launches: int = 0  # GPU kernel launches (memcpy kernels included), loops x trip count
    graphs: int = 0  # command buffers (CUDA graphs) executed
    host_to_device: int = 0  # bytes copied host -> device inside the program
    device_to_host: int = 0
    transfers: int = 0  # host <-> device copies issued inside the program
    host_compute: int = 0  # computations run on the host (XLA:CPU code inside a GPU program)
    host_syncs: int = 0  # points where the host waits on the device (while loops without a known trip count)
    kernels: list[dict] = dataclasses.field(default_factory=list)  # per kernel-producing instruction
    unknown_loops: int = 0

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["top_kernels"] = sorted(self.kernels, key=lambda k: -k["bytes"] * k["count"])[:8]
        del d["kernels"]
        return d


def _walk_hlo(comp: hlo.Computation, module: dict[str, hlo.Computation], times: int, out: ProgramCost,
              found: dict[str, dict], valid: dict[str, float] | None = None) -> int:
    """Adds `comp`'s instructions (each run `times` times) to `out`; returns the bytes added."""
    added = 0
    for inst in comp.instructions.values():
        if inst.opcode == "while":
            trips = inst.trip_count
            if trips is None:
                out.unknown_loops += 1
                trips = 1
                out.host_syncs += times  # the predicate goes back to the host every iteration (counted once)
            for body in inst.called("body"):
                added += _walk_hlo(module[body], module, times * trips, out, found, valid)
            continue
        if inst.opcode == "conditional":
            branches = inst.called("branch_computations") or inst.called("true_computation") + inst.called(
                "false_computation")
            best = None
            for br in branches:
                trial = ProgramCost()
                b = _walk_hlo(module[br], module, times, trial, {}, valid)
                if best is None or b > best[0]:
                    best = (b, br)
            if best is not None:
                added += _walk_hlo(module[best[1]], module, times, out, found, valid)
            continue
        if inst.opcode == "call" and inst.called("to_apply"):
            added += _walk_hlo(module[inst.called("to_apply")[0]], module, times, out, found, valid)
            continue
        t = instruction_traffic(inst, comp, module, valid)
        if t is None:
            continue
        _add(out, t, times, found)
        added += times * (0 if t.host_compute else t.bytes)
    return added


def _add(out: ProgramCost, t: KernelTraffic, times: int, found: dict[str, dict]) -> None:
    if t.host_compute:
        out.host_compute += times
    else:
        out.bytes += times * t.bytes
    if t.host_to_device or t.device_to_host:
        out.host_to_device += times * t.host_to_device
        out.device_to_host += times * t.device_to_host
        out.transfers += times
    entry = found.setdefault(t.name, {"name": t.name, "opcode": t.opcode, "kernel": t.kernel, "read": t.read,
                                      "write": t.write, "bytes": t.bytes, "count": 0, "host": t.host_compute})
    entry["count"] += times


def _walk_thunks(ts: list[thunks.Thunk], trips: dict[str, int], times: int, out: ProgramCost) -> None:
    for t in ts:
        if t.kind == "kWhile":
            n = trips.get(t.annotation)
            _walk_thunks(t.body, trips, times * (n if n is not None else 1), out)
            if n is None:
                _walk_thunks(t.condition, trips, times, out)
            continue
        if t.kind == "kCommandBuffer":
            out.graphs += times
        elif t.kind in thunks.LAUNCH_KINDS:
            out.launches += times
        _walk_thunks(t.children, trips, times, out)


def program_cost(hlo_text: str, thunk_tree: list[thunks.Thunk] | None, valid: dict[str, float] | None = None
                 ) -> ProgramCost:
    """The static cost of one compiled program (its optimised HLO text and, if dumped, its thunk tree; without
    the thunks, launches are counted from the HLO's kernel-producing instructions). `valid`: per Pallas kernel
    name prefix, the fraction of its listed entries that hold data (traffic.instruction_traffic)."""
    module = hlo.parse_module(hlo_text)
    out = ProgramCost()
    found: dict[str, dict] = {}
    _walk_hlo(hlo.entry(module), module, 1, out, found, valid)
    out.kernels = list(found.values())
    if thunk_tree is not None:
        trips = {i.name: i.trip_count for c in module.values() for i in c.instructions.values()
                 if i.opcode == "while" and i.trip_count is not None}
        _walk_thunks(thunk_tree, trips, 1, out)
    else:
        out.launches = sum(k["count"] for k in out.kernels if not k["host"])
    return out
