"""What ptxas says about each kernel: registers, spills, stack, as `ptxas -v` reports them.

XLA runs ptxas itself (once per kernel, in parallel) and keeps its report to itself. `PtxasRecorder` makes a
CUDA data directory that mirrors the real one except for `bin/ptxas`, a wrapper that runs the real ptxas with
`-v`, saves the report in its log directory and hands XLA exactly what it would have seen without `-v`; a compile
points XLA there with the debug option `xla_gpu_cuda_data_dir` (`PtxasRecorder.options`).

A report line set per kernel (ptxas 13):
    ptxas info    : Compiling entry function 'NAME' for 'sm_90a'
    ptxas info    : Function properties for NAME
        S bytes stack frame, A bytes spill stores, B bytes spill loads
    ptxas info    : Used R registers, used N barriers, M bytes smem, ... bytes cmem[0]
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import shlex
import stat

_WRAPPER = """#!/bin/sh
# ptxas with -v for the report in {log}; XLA sees what it would have seen without -v
case " $* " in *" --version "*) exec {real} "$@";; esac
out=$(mktemp {log}/ptxas.XXXXXXXX)
{real} "$@" -v 2>"$out"
rc=$?
grep -v -E '^ptxas info[[:space:]]*:|^[[:space:]]+[0-9]+ bytes stack frame' "$out" >&2
exit $rc
"""


@dataclasses.dataclass(frozen=True)
class PtxasReport:
    """One kernel's ptxas -v report."""

    kernel: str
    registers: int
    stack_frame: int  # bytes of local memory per thread
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    shared_static: int  # bytes of static shared memory ptxas allocated


def parse_report(text: str) -> list[PtxasReport]:
    """Every kernel's report in one ptxas -v output."""
    out = []
    for block in re.split(r"(?=ptxas info\s*: Compiling entry function)", text):
        name = re.search(r"Compiling entry function '([^']+)'", block)
        if name is None:
            continue
        props = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", block)
        used = re.search(r"Used (\d+) registers", block)
        smem = re.search(r"(\d+) bytes smem", block)
        out.append(PtxasReport(
            kernel=name.group(1), registers=int(used.group(1)) if used else 0,
            stack_frame=int(props.group(1)) if props else 0, spill_stores=int(props.group(2)) if props else 0,
            spill_loads=int(props.group(3)) if props else 0, shared_static=int(smem.group(1)) if smem else 0))
    return out


def cuda_data_dir() -> pathlib.Path:
    """The CUDA directory XLA uses (the nvidia-cuda-nvcc wheel's, as jax finds it), with bin/ptxas in it."""
    from jax._src import lib

    path = lib.cuda_path
    if path is None or not (pathlib.Path(path) / "bin" / "ptxas").is_file():
        raise RuntimeError(f"no ptxas under jax's CUDA path {path!r}: install nvidia-cuda-nvcc (./run.sh compile-gpu "
                           "does)")
    return pathlib.Path(path)


class PtxasRecorder:
    """A mirror of the CUDA data directory whose ptxas logs its -v report (see the module docstring)."""

    def __init__(self, work_dir: pathlib.Path, real: pathlib.Path | None = None):
        real = real or cuda_data_dir()
        self.root = pathlib.Path(work_dir) / "cuda"
        self.log = pathlib.Path(work_dir) / "ptxas_logs"
        self.log.mkdir(parents=True, exist_ok=True)
        (self.root / "bin").mkdir(parents=True, exist_ok=True)
        for entry in real.iterdir():
            if entry.name != "bin" and not (self.root / entry.name).exists():
                (self.root / entry.name).symlink_to(entry)
        for tool in (real / "bin").iterdir():
            if tool.name != "ptxas" and not (self.root / "bin" / tool.name).exists():
                (self.root / "bin" / tool.name).symlink_to(tool)
        wrapper = self.root / "bin" / "ptxas"
        wrapper.write_text(_WRAPPER.format(real=shlex.quote(str(real / "bin" / "ptxas")),
                                           log=shlex.quote(str(self.log))))
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        self._seen: set[str] = set()

    def options(self) -> dict:
        """XLA debug options that make a compile use this ptxas."""
        return {"xla_gpu_cuda_data_dir": str(self.root)}

    def collect(self) -> list[PtxasReport]:
        """The reports written since the last call (each log file is read once)."""
        out = []
        for f in sorted(self.log.iterdir(), key=os.path.getmtime):
            if f.name in self._seen:
                continue
            self._seen.add(f.name)
            out += parse_report(f.read_text(errors="replace"))
        return out
