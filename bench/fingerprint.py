"""Fingerprints of compiled XLA programs: which programs a measured decode step ran, matched to the ones predicted.

`fingerprint(hlo_text)` hashes a program's optimized HLO (what XLA compiled: every fusion and kernel, the Pallas
kernels' Triton IR and launch configuration, layouts, buffer aliasing), normalised to what two compiles of the same
program share: metadata (op names, source lines), the debug sections, sharding annotations, the module's name and
the names of computations, instructions and parameters (renumbered in order of appearance) are dropped. Two hashes:
`hlo` (all the rest) and `structure` (without backend configs other than the Pallas kernels': what XLA tunes on a
device, e.g. a GEMM's cuBLAS algorithm or a fusion's tiling, which a compile-only target cannot measure).
`portable_locations()` makes jax write source locations (which Pallas kernels carry in their IR) without directories,
so that checkouts at different paths compile the same bytes: call it before anything is traced.

The measured side (bench/decode_throughput.py) records what runs in a few decode steps after the timed ones
(`ExecutedPrograms`); the predicted side (bench/predict.py, through bench/aot/check.py) fingerprints what it compiles
for the compile-only H200; `match` pairs them. docs/gpu_gate.md says what a fingerprint covers and where it stops.
"""

from __future__ import annotations

import hashlib
import re

_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_TRITON = 'custom_call_target="__gpu$xla.gpu.triton"'  # a Pallas kernel: its backend config is the kernel
_NAME = re.compile(r"%[A-Za-z0-9_.\-]+")


def portable_locations() -> None:
    """Source file names without their directories in every location jax writes from now on (the Pallas kernels'
    Triton IR embeds them; part of jax's trace context, so it must be set before the first trace)."""
    import jax

    jax.config.update("jax_hlo_source_file_canonicalization_regex", r".*/")


def _attr_end(line: str, start: int) -> int:
    """The end of the attribute value starting at `start` ({...} with nesting, "..." with escapes, or a bare word)."""
    if line[start] == '"':
        i = start + 1
        while line[i] != '"':
            i += 2 if line[i] == "\\" else 1
        return i + 1
    if line[start] != "{":
        m = re.compile(r"[^,\s]*").match(line, start)
        return m.end()
    depth, i = 0, start
    while True:
        c = line[i]
        if c == '"':
            i = _attr_end(line, i)
            continue
        depth += (c == "{") - (c == "}")
        i += 1
        if depth == 0:
            return i


def _drop(line: str, name: str) -> str:
    """`line` without its attribute `name=...` (and the comma before it)."""
    key = f", {name}="
    at = line.find(key)
    while at >= 0:
        line = line[:at] + line[_attr_end(line, at + len(key)):]
        at = line.find(key)
    return line


def _header_attr(header: str, name: str) -> str:
    at = header.find(f"{name}=")
    if at < 0:
        return ""
    start = at + len(name) + 1
    return header[start:_attr_end(header, start)]


def normalise(text: str, *, structure: bool = False) -> str:
    """The parts of an optimized HLO module's text that two compiles of one program share (module docstring);
    `structure`: also without the backend configs of everything but the Pallas kernels."""
    out, skip, names = [], False, {}
    for line in text.splitlines():
        if line in _SECTIONS:
            skip = True
            continue
        if skip:
            skip = bool(line.strip())
            continue
        if line.startswith("HloModule "):
            out.append(f"HloModule layout={_header_attr(line, 'entry_computation_layout')} "
                       f"alias={_header_attr(line, 'input_output_alias')}")
            continue
        if not line.strip():
            continue
        line = _drop(_drop(line, "metadata"), "sharding")
        if structure and _TRITON not in line:
            line = _drop(line, "backend_config")
        if line.rstrip().endswith("{") and (line.startswith("%") or line.startswith("ENTRY")):
            line = re.sub(r"[A-Za-z0-9_.\-]+: ", "", line)  # a computation's parameter names
        out.append(_NAME.sub(lambda m: names.setdefault(m.group(), f"%{len(names)}"), line))
    return "\n".join(out)


def module_name(text: str) -> str:
    m = re.match(r"HloModule ([^\s,]+)", text)
    return m.group(1) if m else ""


def fingerprint(text: str) -> dict:
    """name (the HLO module's), layout (its entry computation's), hlo and structure hashes (module docstring)."""
    digest = lambda s: hashlib.sha256(s.encode()).hexdigest()[:16]  # noqa: E731
    header = next((line for line in text.splitlines() if line.startswith("HloModule ")), "")
    return {"name": module_name(text), "layout": _header_attr(header, "entry_computation_layout"),
            "hlo": digest(normalise(text)), "structure": digest(normalise(text, structure=True))}


def executable_text(executable) -> str:
    """The optimized HLO text of a compiled program (a jaxlib LoadedExecutable or a jax `Compiled`)."""
    if hasattr(executable, "as_text"):
        return executable.as_text()
    return "\n\n".join(m.to_string() for m in executable.hlo_modules())


class ExecutedPrograms:
    """Records the compiled programs run while active (a context manager): `runs` maps each executable to [its
    name, its runs, the executable]. A program that has run once is dispatched by jax's C++ fast path, which Python
    never sees; while active, every call takes jax's Python path instead, where the executable is at hand (jax
    internals: `pjit._get_fastpath_data`, the C++ dispatch caches, `pxla.ExecuteReplicated`: `unavailable` says
    if they moved). Nothing is compiled again; each call costs more host time, so record only untimed steps."""

    def __init__(self):
        self.runs: dict[int, list] = {}

    @staticmethod
    def unavailable() -> str | None:
        """Why the recording cannot work on this jax (None: it can)."""
        try:
            from jax._src import pjit
            from jax._src.interpreters import pxla

            missing = [n for obj, names in ((pjit, ("_get_fastpath_data", "_cpp_pjit_cache_fun_only",
                                                      "_cpp_pjit_cache_explicit_attributes")),
                                            (pxla, ("ExecuteReplicated",))) for n in names if not hasattr(obj, n)]
            if missing:
                raise AttributeError(", ".join(missing))
        except (ImportError, AttributeError) as e:
            return f"cannot see jax's dispatch on this version ({e}): bench/fingerprint.py needs updating"
        return None

    def __enter__(self) -> ExecutedPrograms:
        why = self.unavailable()
        if why is not None:
            raise RuntimeError(why)
        from jax._src import pjit
        from jax._src.interpreters import pxla

        self._pjit, self._pxla = pjit, pxla
        self._fast, self._call = pjit._get_fastpath_data, pxla.ExecuteReplicated.__call__
        self._caches = (pjit._cpp_pjit_cache_fun_only, pjit._cpp_pjit_cache_explicit_attributes)
        runs, call = self.runs, self._call

        def record(ex, *args):
            entry = runs.setdefault(id(ex.xla_executable), [ex.name, 0, ex.xla_executable])
            entry[1] += 1
            return call(ex, *args)

        pjit._get_fastpath_data = lambda *a, **k: None
        pxla.ExecuteReplicated.__call__ = record
        for c in self._caches:  # (programs already dispatched from C++ come back through Python once)
            c.clear()
        return self

    def __exit__(self, *exc) -> None:
        self._pjit._get_fastpath_data = self._fast
        self._pxla.ExecuteReplicated.__call__ = self._call
        for c in self._caches:  # (the fast path is rebuilt at each program's next call)
            c.clear()

    def programs(self, steps: int = 1) -> list[dict]:
        """Each program run: its name, runs per step over `steps` steps and fingerprint, largest count first."""
        out = [{"name": name, "runs_per_step": runs / steps, **fingerprint(executable_text(ex))}
               for name, runs, ex in self.runs.values()]
        return sorted(out, key=lambda p: (-p["runs_per_step"], p["name"], p["hlo"]))


def match(measured: list[dict], predicted: list[dict]) -> dict:
    """Pairs a measured row's programs with its predicted row's (each a list of fingerprints with `name`): the ones
    with the same `hlo`, those only the `structure` matches (the device tuned them otherwise), and those on one
    side only."""
    def by(key, rows):
        return {r[key]: r for r in rows}

    same = sorted(set(by("hlo", measured)) & set(by("hlo", predicted)))
    rest_m = [r for r in measured if r["hlo"] not in same]
    rest_p = [r for r in predicted if r["hlo"] not in same]
    tuned = sorted(set(by("structure", rest_m)) & set(by("structure", rest_p)))
    return {"same": [by("hlo", measured)[h]["name"] for h in same],
            "same_structure": [by("structure", rest_m)[s]["name"] for s in tuned],
            "measured_only": [r["name"] for r in rest_m if r["structure"] not in tuned],
            "predicted_only": [r["name"] for r in rest_p if r["structure"] not in tuned]}


def pair_rows(measured: dict, predicted: dict) -> list[tuple[dict, dict, dict]]:
    """(measured row, predicted row, `match`) for each fixed-batch row of a bench/decode_throughput.py result that
    bench/predict.py's result predicts (the same system, prompt tokens and batch)."""
    pts = predicted.get("points", {})
    preds = {(p["system"], pts[p["point"]]["prompt"], pts[p["point"]]["batch"]): p
             for p in predicted.get("predictions", []) if p["point"] in pts}
    out = []
    for row in measured.get("points", []):
        pred = preds.get((row.get("system"), row.get("context"), row.get("batch_requested")))
        if pred is not None and "programs" in row and "programs" in pred:
            out.append((row, pred, match(row["programs"], pred["programs"])))
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import pathlib

    ap = argparse.ArgumentParser(description="match measured decode steps' programs to their predictions")
    ap.add_argument("measured", nargs="+", help="bench/decode_throughput.py result JSONs")
    ap.add_argument("--predicted", required=True, help="bench/predict.py's h200_predict.json")
    a = ap.parse_args(argv)
    predicted = json.loads(pathlib.Path(a.predicted).read_text())
    for path in a.measured:
        for row, pred, m in pair_rows(json.loads(pathlib.Path(path).read_text()), predicted):
            print(f"{pred['point']} {row['system']:26s} same {len(m['same'])}, same structure "
                  f"{len(m['same_structure'])}, measured only {m['measured_only']}, predicted only "
                  f"{m['predicted_only']}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
