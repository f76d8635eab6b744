"""The GPU gate without a GPU: compile every program of `suite.build` for the compile-only H200 and report.

    python -m bench.aot.check [--target FILE] [--out bench/results/h200_compile.json] [--quick]
                                       [--filter REGEX] [--workers N]

Per program: lowering and compile time, the kernels XLA made of it (thunk sequence: grid, threads, shared memory;
`ptxas -v`: registers, spills, stack), its static cost (cost.py: HBM bytes, launches, CUDA graphs, host
transfers), its fingerprint (bench/fingerprint.py) and any launch-limit violation (threads x registers over the
block's registers, shared memory over the opt-in maximum, a grid dimension too large). Exits 1 if a program fails to
compile, a planted program compiles, or a program the engine runs by default has a violation or a register spill;
other programs' violations are reported. Run it through `./run.sh compile-gpu`, which provides the environment
(jax's CUDA plugin, ptxas, JAX_PLATFORMS=cpu). It proves the programs compile and fit the target's limits; not their
speed, their results on a device, or launch-time faults.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time
import warnings

from bench.aot.cost import program_cost
from bench.aot.ptxas import PtxasRecorder
from bench.aot.target import CompileTarget, GpuLimits, use_cpu_backend
from bench.aot.thunks import LAUNCH_KINDS, Thunk, load
from bench.fingerprint import fingerprint, portable_locations

DEFAULT_OUT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results" / "h200_compile.json"


@dataclasses.dataclass
class KernelReport:
    name: str
    kind: str
    grid: tuple | None
    threads: int
    shared_memory: int
    registers: int | None
    spill_stores: int | None
    spill_loads: int | None
    stack_frame: int | None


def limit_violations(k: KernelReport, limits: GpuLimits) -> list[str]:
    """What keeps kernel `k` from launching on the target (empty: it fits)."""
    out = []
    if k.threads > limits.threads_per_block:
        out.append(f"{k.threads} threads per block > {limits.threads_per_block}")
    if k.registers is not None and k.registers * k.threads > limits.registers_per_block:
        out.append(f"{k.registers} registers x {k.threads} threads > {limits.registers_per_block} per block")
    if k.shared_memory > limits.shared_memory_per_block:
        out.append(f"{k.shared_memory} bytes of shared memory > {limits.shared_memory_per_block}")
    if k.grid is not None and (k.grid[1] > 65535 or k.grid[2] > 65535 or k.grid[0] > 2**31 - 1):
        out.append(f"grid {k.grid} over the launch limits")
    return out


def kernel_reports(tree: list[Thunk], ptxas: dict[str, object]) -> list[KernelReport]:
    out = []
    for top in tree:
        for t in top.walk():
            if t.kind not in LAUNCH_KINDS or t.threads is None:
                continue
            r = ptxas.get(t.name)
            out.append(KernelReport(t.name, t.kind, t.grid, t.threads_per_block, t.shared_memory,
                                    getattr(r, "registers", None), getattr(r, "spill_stores", None),
                                    getattr(r, "spill_loads", None), getattr(r, "stack_frame", None)))
    return out


def compile_one(target: CompileTarget, recorder: PtxasRecorder, prog, work: pathlib.Path) -> dict:
    """Compile `prog` and read what came out (see the module docstring); never raises."""
    return compile_group(target, recorder, [prog], work)[0]


def compile_group(target: CompileTarget, recorder: PtxasRecorder, progs: list, work: pathlib.Path) -> list[dict]:
    """Compile `progs`, programs of one `compile_key` (equal but for the valid fractions their cost counts), once:
    one row each, its cost with its own fractions; the rows after the first say `compiled_as` its key and count no
    compile time of their own. Never raises."""
    first = progs[0]
    assert all(p.compile_key == first.compile_key for p in progs), "compile_group takes programs of one compile_key"
    dump = pathlib.Path(tempfile.mkdtemp(dir=work))
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "the Pallas Triton backend is deprecated"
            lowered = first.lower(target)
            t1 = time.perf_counter()
            compiled = target.compile(lowered, {**recorder.options(), "xla_dump_to": str(dump)})
        t2 = time.perf_counter()
    except Exception as e:  # noqa: BLE001 - a rejected program is a result
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:400] if str(e) else ''}"
        recorder.collect()
        shutil.rmtree(dump, ignore_errors=True)
        return [{**_row_head(p), "status": "rejected", "error": error,
                 "seconds": round(time.perf_counter() - t0, 3) if p is first else 0.0,
                 **({} if p is first else {"compiled_as": first.key})} for p in progs]
    reports = {}
    for r in recorder.collect():  # a kernel compiled twice (several LLVM modules) reports once, the larger
        if r.kernel not in reports or r.registers > reports[r.kernel].registers:
            reports[r.kernel] = r
    tree = load(dump)
    hlo_text = compiled.as_text()
    kernels = kernel_reports(tree, reports)
    pallas = _pallas_names(hlo_text)
    found = {k.name for k in kernels if k.name in pallas}
    mem = compiled.memory_analysis()
    memory = {k: getattr(mem, f"{k}_size_in_bytes", 0) for k in ("argument", "output", "alias", "temp")}
    # what the one compile says, the same in every row: its kernels' launch-limit violations and spills, its sizes
    kernel_violations = []
    for k in kernels:
        kernel_violations += [f"{k.name}: {v}" for v in limit_violations(k, target.limits)]
        if k.spill_stores:
            kernel_violations.append(f"{k.name}: {k.spill_stores} bytes of register spill stores")
    shared = dict(memory=memory, fingerprint=fingerprint(hlo_text), pallas=sorted(found),
                  max_registers=max((k.registers or 0 for k in kernels), default=0),
                  max_shared_memory=max((k.shared_memory for k in kernels), default=0),
                  max_threads=max((k.threads for k in kernels), default=0))
    rows = []
    for prog in progs:
        missing = [f"{want}: no Triton kernel in the compiled program (Pallas interpret mode?)" for want in prog.pallas
                   if not any(name.startswith(want) for name in found)]
        row = _row_head(prog)
        row.update(status="compiled", lower_s=round(t1 - t0, 3) if prog is first else 0.0,
                   compile_s=round(t2 - t1, 3) if prog is first else 0.0,
                   cost=program_cost(hlo_text, tree, dict(prog.valid)).as_dict(),
                   violations=missing + kernel_violations, **shared)
        if prog is not first:
            row["compiled_as"] = first.key
        if prog.group in ("kernel", "planted", "probe"):
            row["kernels"] = [dataclasses.asdict(k) for k in kernels]
        rows.append(row)
    shutil.rmtree(dump, ignore_errors=True)
    return rows


def _row_head(prog) -> dict:
    return {"key": prog.key, "function": prog.function, "group": prog.group, "default": prog.default,
            "must_reject": prog.must_reject, "note": prog.note}


def _pallas_names(hlo_text: str) -> set[str]:
    """The Pallas kernels of a compiled module, named as the thunk sequence names kernels ('=' / '.' -> '_')."""
    names = re.findall(r'op_name="[^"]*?/([^/"]+)/pallas_call"', hlo_text)
    return {re.sub(r"[^A-Za-z0-9_]", "_", n) for n in names}


def verdict(row: dict) -> str | None:
    """Why `row` fails the gate, or None."""
    if row["must_reject"]:
        return None if row["status"] == "rejected" else "a planted program compiled (the check lost its teeth)"
    if row["status"] != "compiled":
        return f"rejected: {row.get('error')}"
    fatal = [v for v in row["violations"] if row["default"] or "interpret mode" in v]
    if fatal:
        return "; ".join(fatal[:4])
    return None


def _build(builder: str, target: CompileTarget, options: dict) -> dict:
    """The programs of `builder` ("module:function", called with the target and `options`; it returns a Suite or
    a {key: Program} dict)."""
    import importlib

    module, _, fn = builder.partition(":")
    out = getattr(importlib.import_module(module), fn)(target, **options)
    return out.programs if hasattr(out, "programs") else out


_WORKER: dict = {}  # a compile worker's own target, ptxas recorder and programs (_start_worker)


def _start_worker(target_path: str | None, builder: str, options: dict, work: str) -> None:
    """A worker process's start: its own target, ptxas recorder and programs (they hold jitted functions, which do
    not travel between processes)."""
    use_cpu_backend()
    portable_locations()  # (fingerprints as a checkout at any path, or the GPU bench, makes them)
    target = CompileTarget.load(target_path)
    recorder = PtxasRecorder(pathlib.Path(tempfile.mkdtemp(dir=work)))
    _WORKER.update(target=target, recorder=recorder, programs=_build(builder, target, options),
                   work=pathlib.Path(work))


def _compile_keys(keys: list[str]) -> list[dict]:
    """In a worker: compile programs `keys` (one compile_key) once, print a line."""
    w = _WORKER
    rows = compile_group(w["target"], w["recorder"], [w["programs"][k] for k in keys], w["work"])
    r = rows[0]
    more = f" (+{len(rows) - 1} sharing it)" if len(rows) > 1 else ""
    print(f"{r['status']:9s} {r.get('compile_s', r.get('seconds', 0)):6.2f}s {keys[0][:150]}{more}", flush=True)
    return rows


def compile_programs(target_path: str | None, builder: str, options: dict, keys: list[str],
                     workers: int, programs: dict | None = None) -> list[dict]:
    """Compile programs `keys` of `builder` (see _build) in `workers` processes, each program of a compile_key
    once, the largest first, each worker taking the next as it finishes one; rows in the order of `keys`.
    `programs`: the builder's programs where the caller has them (else built here, to order them)."""
    work = pathlib.Path(tempfile.mkdtemp(prefix="pulseinfer-aot-"))
    try:
        start = (target_path, builder, options, str(work))
        if workers <= 1:
            _start_worker(*start)
            rows = [r for group in _compile_order(_WORKER["programs"], keys) for r in _compile_keys(group)]
        else:
            if programs is None:
                programs = _build(builder, CompileTarget.load(target_path), options)
            groups = _compile_order(programs, keys)
            spawn = multiprocessing.get_context("spawn")  # (fork would copy jax's threads' state)
            with concurrent.futures.ProcessPoolExecutor(workers, mp_context=spawn, initializer=_start_worker,
                                                        initargs=start) as pool:
                rows = [r for part in pool.map(_compile_keys, groups) for r in part]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    order = {k: i for i, k in enumerate(keys)}
    return sorted(rows, key=lambda r: order[r["key"]])


def _compile_order(programs: dict, keys: list[str]) -> list[list[str]]:
    """`keys` grouped by compile_key, the groups in decreasing program size (Program.size): the longest compiles
    start first, so that no worker is left with one at the end while the others idle."""
    groups: dict[str, list[str]] = {}
    for k in keys:
        groups.setdefault(programs[k].compile_key or k, []).append(k)
    return sorted(groups.values(), key=lambda g: -programs[g[0]].size)


def suite_programs(target: CompileTarget, quick: bool = False):
    """The compile check's programs (suite.build) for `target`."""
    from bench.aot import suite as suite_mod

    return suite_mod.build(shardings=target.sharding, hbm=target.limits.device_memory, quick=quick)


def run(target_path: str | None, quick: bool, pattern: str | None, workers: int) -> dict:
    target = CompileTarget.load(target_path)
    suite = suite_programs(target, quick)
    keys = [k for k in suite.programs if pattern is None or re.search(pattern, k)]
    t0 = time.perf_counter()
    rows = compile_programs(target_path, "bench.aot.check:suite_programs", {"quick": quick}, keys, workers,
                            suite.programs)
    order = set(keys)
    steps = {name: [{"key": c.program.key, "count": c.count} for c in calls] for name, calls in suite.steps.items()
             if all(c.program.key in order for c in calls)}
    return {"target": {"source": str(target.source), "limits": dataclasses.asdict(target.limits)},
            "versions": _versions(), "quick": quick, "filter": pattern, "wall_s": round(time.perf_counter() - t0, 1),
            "programs": rows, "steps": steps}


def _versions() -> dict:
    import jax
    import jaxlib

    out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
    try:
        from importlib.metadata import version

        out["jax-cuda13-plugin"] = version("jax-cuda13-plugin")
        out["nvidia-cuda-nvcc"] = version("nvidia-cuda-nvcc")
    except Exception:  # noqa: BLE001 - versions are informative only
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="GpuTargetConfigProto text (default: the project's H200)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON report (through bench.common-style metadata)")
    ap.add_argument("--quick", action="store_true", help="a small subset (tests)")
    ap.add_argument("--filter", default=None, help="only programs whose key matches this regex")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    a = ap.parse_args(argv)
    use_cpu_backend()
    report = run(a.target, a.quick, a.filter, a.workers)
    failures = [(r["key"], v) for r in report["programs"] if (v := verdict(r)) is not None]
    report["failures"] = [{"key": k, "why": v} for k, v in failures]
    rows = report["programs"]
    summary = {"programs": len(rows), "compiled": sum(r["status"] == "compiled" for r in rows),
               "rejected": sum(r["status"] == "rejected" for r in rows),
               "planted_rejected": sum(r["must_reject"] and r["status"] == "rejected" for r in rows),
               "with_violations": sum(bool(r.get("violations")) for r in rows), "failures": len(failures)}
    report["summary"] = summary
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_meta(report, argv), indent=1))
    print(f"{summary} ({report['wall_s']} s) -> {out}")
    for k, v in failures:
        print(f"FAIL {k[:160]}\n     {v}", file=sys.stderr)
    return 1 if failures else 0


def _meta(report: dict, argv: list[str] | None) -> dict:
    import datetime
    import platform
    import subprocess

    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=pathlib.Path(__file__).resolve().parents[2]).stdout.strip()
    except OSError:
        git = ""
    cmd = "python -m bench.aot.check " + " ".join(argv if argv is not None else sys.argv[1:])
    import jax

    cpu = next((line.split(":", 1)[1].strip() for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "") if pathlib.Path("/proc/cpuinfo").is_file() else ""
    return {"date": datetime.date.today().isoformat(), "command": cmd.strip(), "git": git,
            "machine": {"platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
                        "jax_backend": "compile-only", "device": report["target"]["limits"]["name"],
                        "jax_version": jax.__version__, "python": platform.python_version(),
                        "note": "compiled for the target without one; nothing executed"},
            **report}


if __name__ == "__main__":
    sys.exit(main())
