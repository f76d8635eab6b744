"""Markdown tables of benchmark result JSONs, for bench/RESULTS.md (what the GPU suite wrote, ready to paste).

    python bench/tables.py bench/results/gpu_h200_run4/*.json          # every JSON it knows, in turn
    python bench/tables.py decode_throughput_a.json --out tables.md

Known kinds (the JSON's "kind", else its file name's prefix):
  - decode_throughput: one table per (context, batch) point, a row per system: batch reached and placements,
    decode tokens/s and its ratio to `dense` and to `pulseinfer` (the ablations), TPOT p50 / p99, host-to-device
    MB and copies per step, recall wait per step, slot-cache hit rate, GPU KV, host I/O backend, compiles in the
    timed steps; skipped or failed systems say why.
  - kernels (bench/kernels.py): per section and shape, each implementation's time and GB/s; attention rows also
    as a share of the measured device copy bandwidth and against `jax paged_attention` on the same blocks (the
    Pallas issue's targets: >= 60% of copy bandwidth at batch >= 16, faster than paged_attention).
  - io_sweep: GB/s per mode for each volume moved (copies x copy size; best of the repeats).
  - dense_decode: per (context, batch), each attention x layer loop's median step, tokens/s and KV GB/s.
  - h200_compile (bench/aot/check.py): per Pallas kernel case, grid, threads, shared memory, registers and
    spills as compiled for the H200; compile time and launches per program group; violations.
  - h200_predict (bench/predict.py): per point and system, placements, predicted step and tokens/s, its terms.
Anything else is listed as not tabulated.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable

MB = 1e6
GIB = 2**30


def _f(v: float | None, fmt: str = ".1f", scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale, fmt)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |",
            *("| " + " | ".join(r) + " |" for r in rows)]


def decode_throughput(data: dict) -> list[str]:
    """One table per (context, batch requested); see the module docstring."""
    points: dict[tuple, list[dict]] = {}
    for p in data.get("points", []):
        points.setdefault((p.get("context"), p.get("batch_requested")), []).append(p)
    out = []
    for (ctx, batch), rows in points.items():
        tps = {r["system"]: r.get("decode_tokens_per_s") for r in rows}
        body = []
        for r in rows:
            if "skipped" in r or "error" in r:
                body.append([r["system"], f"{'skipped' if 'skipped' in r else 'failed'}: "
                             f"{r.get('skipped') or r.get('error')}", *["" for _ in range(11)]])
                continue
            t = r["decode_tokens_per_s"]
            ratio = [_f(t / tps[ref], ".2f") + "x" if tps.get(ref) else "-" for ref in ("dense", "pulseinfer")]
            place = r.get("placements") or {}
            body.append([
                r["system"], f"{r['batch_reached']:g} ({place.get('dense', 0)} dense, {place.get('offload', 0)} off)",
                _f(t), *ratio, f"{_f(r['tpot_s_p50'], '.1f', 1e3)} / {_f(r['tpot_s_p99'], '.1f', 1e3)}",
                _f(r.get("h2d_bytes_per_step"), ".1f", 1 / MB), _f(r.get("h2d_copies_per_step"), ".0f"),
                _f(r.get("recall_wait_s_per_step"), ".2f", 1e3), _f(r.get("slot_hit_rate"), ".3f"),
                _f(r.get("gpu_kv_bytes_allocated"), ".2f", 1 / GIB), str(r.get("host_io") or "-"),
                str(r.get("compiles_in_timed_steps", "-"))])
        out += [f"**{ctx} tokens x {batch} requests** ({data.get('model', '?')}, {data.get('dtype', '?')})", "",
                *_table(["system", "batch reached", "tok/s", "vs dense", "vs pulseinfer", "TPOT p50 / p99 ms",
                         "H2D MB/step", "copies/step", "wait ms/step", "hit rate", "GPU KV GiB", "host I/O",
                         "compiles"], body), ""]
    if data.get("mix"):
        out += [f"Mix rows: {len(data['mix'])} (not tabulated here; see the JSON)", ""]
    return out


def kernels(data: dict) -> list[str]:
    """Per section and grid point, each implementation's median ms and GB/s (see the module docstring)."""
    copy = (data.get("copy") or {}).get("gb_per_s")
    out = [f"Device copy: {_f(copy)} GB/s ({(data.get('copy') or {}).get('impl', '?')}); shapes {data.get('shapes')}",
           ""]
    for section in ("attention", "scoring", "gather"):
        sec = data.get(section) or {}
        if "error" in sec or "grid" not in sec:
            out += [f"{section}: {sec.get('error', 'not run')}", ""]
            continue
        body = []
        for g in sec["grid"]:
            where = ", ".join(f"{k} {v}" for k, v in g.items() if k != "impls")
            paged = next((i["median_ms"] for i in g["impls"] if i["impl"] == "jax paged_attention"
                          and "median_ms" in i), None)
            for i in g["impls"]:
                if "median_ms" not in i:
                    body.append([where, i["impl"], "failed: " + str(i.get("error", "?"))[:80], "",
                                 *(["", ""] if section == "attention" else [])])
                    continue
                gbps = i.get("gb_per_s")
                row = [where, i["impl"], _f(i["median_ms"], ".3f"), _f(gbps)]
                if section == "attention":
                    row += [_f(gbps / copy * 100, ".0f") + "%" if gbps and copy else "-",
                            _f(paged / i["median_ms"], ".2f") + "x" if paged else "-"]
                body.append(row)
        extra = ["of copy bw", "speed vs paged_attention"] if section == "attention" else []
        out += [f"**{section}**", "", *_table(["point", "implementation", "ms", "GB/s", *extra], body), ""]
    return out


def io_sweep(data: dict) -> list[str]:
    """GB/s per mode (columns) for each volume moved (rows: total bytes), as copies x copy size: the same bytes as
    many small copies or as one gathered copy is the comparison the I/O engine rests on."""
    modes = data.get("modes") or sorted({r["mode"] for r in data.get("rows", [])})
    by: dict[int, dict[str, dict]] = {}
    for r in data.get("rows", []):
        cell = by.setdefault(r["total_bytes"], {})
        if r["mode"] not in cell or (r.get("gb_per_s") or 0) > (cell[r["mode"]].get("gb_per_s") or 0):
            cell[r["mode"]] = r
    body = [[_size(n), *(f"{_f(c.get('gb_per_s'), '.2f')} ({c['copies']} x {_size(c['transfer_bytes'])})"
                         if (c := by[n].get(m)) else "-" for m in modes)] for n in sorted(by)]
    note = f" ({data['note']})" if data.get("note") else ""
    return [f"I/O sweep on {data.get('device', '?')}, host_io {data.get('host_io', '?')}: GB/s (copies x size), "
            f"best of repeats{note}", "", *_table(["volume", *modes], body), ""]


def dense_decode(data: dict) -> list[str]:
    """The dense decode grid: per (context, batch), each (attention, layer loop)'s median step and tokens/s."""
    body = []
    for g in sorted(data.get("grid", []), key=lambda g: (g.get("context", 0), g.get("batch", 0))):
        where = [str(g.get(k)) for k in ("context", "batch", "attention", "layer_loop")]
        if "step_s_median" in g:
            body.append([*where, _f(g["step_s_median"], ".2f", 1e3), _f(g.get("tokens_per_s")),
                         _f(g.get("kv_gb_per_s"))])
        else:
            body.append([*where, f"failed: {str(g.get('error', '?'))[:80]}", "", ""])
    return [f"Dense decode ({data.get('model', '?')}, {data.get('dtype', '?')})", "",
            *_table(["context", "batch", "attention", "layer loop", "step ms", "tok/s", "KV GB/s"], body), ""]


def h200_compile(data: dict) -> list[str]:
    rows, groups = [], {}
    for r in data["programs"]:
        g = groups.setdefault(r["group"], [0, 0.0, 0, 0])
        g[0] += 1
        g[1] += r.get("compile_s", 0) + r.get("lower_s", 0)
        g[2] += r["status"] != "compiled"
        g[3] += bool(r.get("violations"))
        if r["group"] != "kernel" or r["status"] != "compiled":
            continue
        for k in r.get("kernels", []):
            if k["name"] not in r.get("pallas", []):
                continue
            rows.append([r["note"] or r["function"], k["name"], "x".join(map(str, k["grid"] or ())), str(k["threads"]),
                         str(k["shared_memory"]), "-" if k["registers"] is None else str(k["registers"]),
                         "-" if k["spill_stores"] is None else str(k["spill_stores"]),
                         "yes" if r["default"] else ""])
    out = _table(["kernel case", "kernel", "grid", "threads", "shared B", "registers", "spill B", "default"], rows)
    out += ["", *_table(["group", "programs", "compile s", "rejected", "with violations"],
                        [[g, str(n), f"{t:.0f}", str(rej), str(v)] for g, (n, t, rej, v) in sorted(groups.items())])]
    for f in data.get("failures", []):
        out.append(f"- FAIL `{f['key'][:120]}`: {f['why']}")
    return out + [""]


def h200_predict(data: dict) -> list[str]:
    rows = []
    for p in data["predictions"]:
        pl = p["placements"]
        rows.append([p["point"], p["system"], f"{pl['dense']}/{pl['offload']}/{pl['wait']}",
                     _f(p["step_s"], ".2f", 1e3), _f(p["tokens_per_s"], ".0f"), _f(p.get("tokens_per_s_at_1us"), ".0f"),
                     _f(p.get("dense_s"), ".2f", 1e3), _f(p.get("sparse_s"), ".2f", 1e3),
                     _f(p.get("recall_bytes"), ".0f", 1 / MB), _f(p.get("misses_per_layer_mean"), ".0f")])
    out = _table(["point", "system", "dense/offload/wait", "step ms", "tok/s", "tok/s at 1 us launches",
                  "dense part ms", "offloaded part ms", "recall MB/step", "misses/layer/mb"], rows)
    for point, r in sorted(data.get("ratios", {}).items()):
        # {label: {ratio: value}} per launch cost, or (older files) {ratio: value}
        by_label = r if all(isinstance(v, dict) for v in r.values()) else {"": r}
        for label, ratios in by_label.items():
            out.append(f"- point {point}{f' ({label})' if label else ''}: "
                       + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    return out + [""]


def _size(n: float) -> str:
    for unit, div in (("MB", 2**20), ("KB", 2**10)):
        if n >= div:
            return f"{n / div:g} {unit}"
    return f"{n:g} B"


TABLERS: dict[str, Callable[[dict], list[str]]] = {
    "decode_throughput": decode_throughput, "kernels": kernels, "io_sweep": io_sweep, "dense_decode": dense_decode,
    "h200_compile": h200_compile, "h200_predict": h200_predict}


def kind_of(data: dict, path: pathlib.Path) -> str | None:
    if data.get("kind") in TABLERS:
        return data["kind"]
    return next((k for k in sorted(TABLERS, key=len, reverse=True) if path.name.startswith(k)), None)


def tables_for(path: pathlib.Path) -> list[str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return [f"## {path.name}: unreadable ({e})", ""]
    kind = kind_of(data, path)
    m = data.get("machine", "?")
    if isinstance(m, dict):  # bench.common.machine()
        m = (f"{m.get('device', '?')} ({m.get('jax_backend', '?')}, jax {m.get('jax_version', '?')}, "
             f"{m.get('cpu', '?')} x{m.get('cpu_count', '?')})")
    head = [f"## {path.name}", "", f"{data.get('date', '?')}, git {data.get('git', '?')}, {m}: "
            f"`{data.get('command', '?')}`", ""]
    if kind is None:
        return [f"## {path.name}: not tabulated (kinds: {', '.join(TABLERS)})", ""]
    return head + TABLERS[kind](data)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsons", nargs="+", type=pathlib.Path)
    ap.add_argument("--out", type=pathlib.Path, default=None, help="write the markdown here (default: stdout)")
    args = ap.parse_args(argv)
    text = "\n".join(line for p in args.jsons for line in tables_for(p))
    if args.out:
        args.out.write_text(text + "\n")
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
