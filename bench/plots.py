"""Plots of benchmark result JSONs (PNG, matplotlib's Agg backend; needs `pip install -e .[bench]`).

    python bench/plots.py bench/results/io_sweep_gpu.json --out bench/results
    python bench/plots.py A.json B.json --out DIR      # one PNG per JSON: DIR/<json stem>.png
    python -m bench.plots bench/results/accuracy_cpu_grid.json bench/results/accuracy_cpu_f8.json \
        --combine accuracy_budget --labels "beta 1 per KV head" "defaults" --out bench/results
        # several JSONs of one kind overlaid in DIR/<NAME>.png, each JSON's lines suffixed with its --labels entry

Each JSON is dispatched on its "kind" field (or, for files without one, the file name's prefix) to a plotter
in PLOTTERS; adding a result kind = writing one `plot_<kind>(data, title, path)` and registering it.

  - io_sweep (bench/io_sweep.py): GB/s against transfer size, log2 x axis, one line per mode. Left panel: per
    copy size (per_block's raw curve, coalesced's one copy, the device copy ceiling); right panel: per batch
    volume for the fixed-unit paths (8 KB (block, head) units, 64 KB blocks, one copy per unit/block) next to
    coalesced, which is the comparison the engine's I/O design rests on.
  - decode_throughput (bench/decode_throughput.py): one row per context, stacked: decode tokens/s against the
    batch reached per system, and the step-time (TPOT) distribution per system at the largest batch.
  - accuracy (bench/accuracy.py): passkeys found and teacher-forced top-1 agreement with dense against the sparse
    budget, one line per selection variant (and per JSON with --combine), dense as a dotted reference.
  - h200_predict (bench/predict.py): PREDICTED decode tokens/s per system at each GPU-suite point (A, B, ...),
    horizontal bars, one panel per point in a grid two panels wide, with the placements (dense / offloaded /
    waiting) each system got.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Callable


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or a clear error."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("bench/plots.py needs matplotlib: pip install -e .[bench]") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def result_kind(data: dict, path: pathlib.Path) -> str:
    """The JSON's "kind", else the longest registered kind its file name starts with."""
    if "kind" in data:
        return data["kind"]
    matches = [k for k in PLOTTERS if path.stem.startswith(k)]
    if not matches:
        raise SystemExit(f"{path}: no 'kind' field and no known prefix ({', '.join(PLOTTERS)})")
    return max(matches, key=len)


def title_of(data: dict, what: str) -> str:
    m = data.get("machine", {})
    device = m.get("device") or data.get("device") or "?"
    return f"{what} - {device} ({m.get('jax_backend', '?')}), {data.get('date', '?')}"


# ---- layout ------------------------------------------------------------------------------------

def panel_grid(n: int, max_cols: int = 2) -> tuple[int, int]:
    """(rows, columns) for n panels at page width: at most max_cols side by side, the rest in further rows."""
    cols = max(1, min(n, max_cols))
    return -(-n // cols), cols


# ---- io_sweep ----------------------------------------------------------------------------------

def _by_mode(rows: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["mode"], []).append(r)
    return out


def io_sweep_panels(rows: list[dict]) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
    """(per-copy panel, per-batch panel): modes whose copy size varies are plotted against it; fixed-unit
    modes (one copy size, several batch sizes) against the batch's total bytes, with coalesced beside them."""
    per_copy, per_batch = {}, {}
    for mode, rs in _by_mode(rows).items():
        sizes = {r["transfer_bytes"] for r in rs}
        if len(sizes) > 1:
            per_copy[mode] = rs
        if (len(sizes) == 1 and len(rs) > 1) or mode == "coalesced":
            per_batch[mode] = rs
    return per_copy, per_batch


def _size_label(n: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g}{unit}"
    return f"{n:g}"


def plot_io_sweep(data: dict, title: str, path: pathlib.Path) -> None:
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter

    per_copy, per_batch = io_sweep_panels(data["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5), constrained_layout=True)
    panels = ((axes[0], per_copy, "transfer_bytes", "bytes per copy"),
              (axes[1], per_batch, "total_bytes", "bytes per batch (all copies of one call)"))
    for ax, modes, key, xlabel in panels:
        for mode, rs in sorted(modes.items()):
            rs = sorted(rs, key=lambda r: r[key])
            unit = f" ({_size_label(rs[0]['transfer_bytes'])}B units)" if key == "total_bytes" and len(
                {r["transfer_bytes"] for r in rs}) == 1 else ""
            ax.plot([r[key] for r in rs], [r["gb_per_s"] for r in rs], marker="o", ms=3, label=mode + unit)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _size_label(v)))
        ax.set_xlabel(xlabel)
        ax.set_yscale("log")  # H2D, per-copy overheads and the device copy span decades
        ax.set_ylabel("GB/s (best of repeats)")
        ax.grid(True, which="both", alpha=0.3)
        if modes:
            ax.legend(fontsize=8)
    note = "" if data.get("pcie_meaningful", True) else "  [CPU: same RAM, not PCIe]"
    fig.suptitle(title + note)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- decode_throughput -----------------------------------------------------------------------

def throughput_series(points: list[dict]) -> dict[int, dict[str, list[tuple[float, float]]]]:
    """context -> system -> [(batch reached, decode tokens/s)] sorted by batch, measured points only."""
    out: dict[int, dict[str, list[tuple[float, float]]]] = {}
    for p in points:
        if "decode_tokens_per_s" in p:
            out.setdefault(p["context"], {}).setdefault(p["system"], []).append(
                (p["batch_reached"], p["decode_tokens_per_s"]))
    return {c: {s: sorted(v) for s, v in d.items()} for c, d in sorted(out.items())}


def plot_decode_throughput(data: dict, title: str, path: pathlib.Path) -> None:
    """One row per context, stacked: on the left decode tokens/s against the batch each system reached, on the
    right the distribution of per-step times (TPOT) per system at the largest requested batch of that context."""
    plt = _pyplot()
    series = throughput_series(data["points"])
    if not series:
        raise SystemExit("no measured point in this decode_throughput JSON")
    fig, axes = plt.subplots(len(series), 2, figsize=(13, 1.2 + 4.6 * len(series)), squeeze=False,
                             constrained_layout=True)
    for row, (ctx, systems) in enumerate(series.items()):
        ax = axes[row, 0]
        for system, pts in systems.items():
            ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", ms=4, label=system)
        ax.set_title(f"context {ctx:,} tokens")
        ax.set_xlabel("batch reached (requests decoding together)")
        ax.set_ylabel("decode tokens/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[row, 1]
        top = max(p["batch_requested"] for p in data["points"] if p["context"] == ctx)
        rows = [p for p in data["points"] if p["context"] == ctx and p["batch_requested"] == top
                and "step_s_all" in p]
        if rows:
            ax.boxplot([[t * 1e3 for t in p["step_s_all"]] for p in rows], whis=(1, 99))
            ax.set_xticks(range(1, len(rows) + 1), [p["system"] for p in rows], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("TPOT = step time (ms)")
        ax.set_title(f"context {ctx:,}: step-time distribution, {top} requests requested")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{title}\n{data.get('model', '')} {data.get('dtype', '')}; {data.get('kv', '')}; "
                 f"selection: {data.get('selection_source', '')}", fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- accuracy -------------------------------------------------------------------------------------

VARIANT_LABELS = {"normalized_sum": "SoloHead (normalized_sum)", "retrieval_head": "SoloHead (retrieval_head)",
                  "headwise": "headwise (per KV head)"}


def accuracy_series(runs: list[tuple[str | None, dict]]) -> tuple[dict[str, list[tuple[int, int, float]]],
                                                                   tuple[int, float] | None, int]:
    """(label -> [(budget tokens, passkeys found, teacher-forced top-1 %)] sorted by budget, dense's (passkeys
    found, top-1 %) from the first run that has it, passkeys asked per row). A run is (its label, JSON); with
    several runs each line's label ends with its run's."""
    series: dict[str, list[tuple[int, int, float]]] = {}
    dense, asked = None, 0
    for run_label, data in runs:
        run = run_label if len(runs) > 1 else None
        for r in data["rows"]:
            found = sum(sum(v) for v in r.get("passkey", {}).values()) if r.get("passkey") else None
            asked = max(asked, sum(len(v) for v in r.get("passkey", {}).values()))
            top1 = 100.0 * r["tf_top1_agreement"] if r.get("tf_top1_agreement") is not None else None
            if r["budget_tokens"] is None:
                dense = dense or (found, top1)
                continue
            label = VARIANT_LABELS.get(r["variant"], r["variant"]) + (f"; {run}" if run else "")
            series.setdefault(label, []).append((r["budget_tokens"], found, top1))
    return {k: sorted(v) for k, v in series.items()}, dense, asked


def plot_accuracy(data: dict, title: str, path: pathlib.Path) -> None:
    plot_accuracy_runs([(None, data)], title, path)


def plot_accuracy_runs(runs: list[tuple[str | None, dict]], title: str, path: pathlib.Path) -> None:
    plt = _pyplot()
    series, dense, asked = accuracy_series(runs)
    if not series:
        raise SystemExit("no sparse row in these accuracy JSONs")
    fig, axes = plt.subplots(1, 2, figsize=(13, 6.5), constrained_layout=True)
    panels = ((axes[0], 1, f"passkeys found (of {asked})"),
              (axes[1], 2, "teacher-forced top-1 agreement with dense (%)"))
    budgets = sorted({b for pts in series.values() for b, *_ in pts})
    markers = "osD^vP*X"
    for ax, i, ylabel in panels:
        for k, (label, pts) in enumerate(series.items()):  # marker size falls so that equal points stay visible
            pts = [p for p in pts if p[i] is not None]
            ax.plot([p[0] for p in pts], [p[i] for p in pts], marker=markers[k % len(markers)], ms=9 - 1.5 * k,
                    ls="--" if "retrieval_head" in label else "-", label=label, alpha=0.85)
        if dense and dense[i - 1] is not None:
            ax.axhline(dense[i - 1], color="black", ls=":", label="dense (all tokens)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [f"{b:,}" for b in budgets])
        ax.set_xlabel("sparse budget (tokens attended per sparse layer)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    lowest = min((p[1] for pts in series.values() for p in pts if p[1] is not None), default=0)
    axes[0].set_ylim(max(0, lowest - 2), asked + 0.5)
    axes[1].set_ylim(top=101)
    fig.legend(*axes[1].get_legend_handles_labels(), loc="outside lower center", ncol=2, fontsize=8)
    d = runs[0][1]
    dates = ", ".join(sorted({r.get("date", "?") for _, r in runs}))
    backend = d.get("machine", {}).get("jax_backend", "?")
    fig.suptitle(f"{title.split(' - ')[0]} ({backend}, {dates})\n{d.get('model', '')}; passkeys"
                 f" at {d.get('lengths')} tokens x {len(d.get('depths', []))} depths; teacher-forced top-1 over"
                 f" {d.get('tf_tokens')} tokens after {d.get('tf_context')}", fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- h200_predict ----------------------------------------------------------------------------------

def predicted_points(data: dict) -> dict[str, list[dict]]:
    """point -> its predictions with tokens/s, in predict.py's system order."""
    out: dict[str, list[dict]] = {}
    for p in data["predictions"]:
        if p.get("tokens_per_s") is not None:
            out.setdefault(p["point"], []).append(p)
    return dict(sorted(out.items()))


def _system_colour(system: str) -> str:
    if system.startswith("dense"):
        return "tab:gray"
    if system.startswith("offload"):
        return "tab:red"
    if system == "pulseinfer":
        return "tab:blue"
    return "tab:orange" if system.startswith("sparse") else "lightsteelblue"


def plot_h200_predict(data: dict, title: str, path: pathlib.Path) -> None:
    plt = _pyplot()
    points = predicted_points(data)
    if not points:
        raise SystemExit("no prediction with tokens/s in this JSON")
    n = max(len(v) for v in points.values())
    rows, cols = panel_grid(len(points))
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 1.4 + (0.8 + 0.4 * n) * rows), squeeze=False,
                             constrained_layout=True)
    for ax in axes.flat[len(points):]:
        ax.set_visible(False)
    for ax, (name, preds) in zip(axes.flat, points.items(), strict=False):
        ys = list(range(len(preds)))[::-1]
        tps = [p["tokens_per_s"] for p in preds]
        ax.barh(ys, tps, color=[_system_colour(p["system"]) for p in preds])
        for y, p in zip(ys, preds, strict=True):
            pl = p.get("placements", {})
            ax.text(p["tokens_per_s"], y, f" {p['tokens_per_s']:.0f}  ({pl.get('dense', 0)}/{pl.get('offload', 0)}/"
                    f"{pl.get('wait', 0)}, {p['step_s'] * 1e3:.1f} ms)", va="center", fontsize=7)
        ax.set_yticks(ys, [p["system"] for p in preds], fontsize=8)
        ax.set_xlim(0, max(tps) * 1.45)
        ax.set_xlabel("predicted decode tokens/s")
        pt = data.get("points", {}).get(name, {})
        gib = pt.get("gpu_kv_budget", 0) / (1 << 30)
        ax.set_title(f"point {name}: {pt.get('batch', '?')} x {pt.get('prompt', 0):,}-token prompts, "
                     f"{gib:g} GiB GPU KV", fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
    m, device = data.get("model", {}), data.get("machine", {}).get("device", "?")
    fig.suptitle(f"{title.split(' - ')[0]}, {data.get('date', '?')}: PREDICTED, not measured\nH200 cost model "
                 f"({m.get('bandwidth', 0) / 1e12:.2f} TB/s, t_launch {m.get('t_launch', 0) * 1e6:.2f} us), programs "
                 f"compiled for the H200 on a {device} machine\nbar labels: tokens/s (requests dense / offloaded / "
                 f"waiting, step time)", fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


PLOTTERS: dict[str, Callable[[dict, str, pathlib.Path], None]] = {
    "io_sweep": plot_io_sweep, "decode_throughput": plot_decode_throughput, "accuracy": plot_accuracy,
    "h200_predict": plot_h200_predict}
COMBINERS: dict[str, Callable[[list[tuple[str, dict]], str, pathlib.Path], None]] = {
    "accuracy": plot_accuracy_runs}
TITLES = {"io_sweep": "Host-to-device bandwidth by transfer size",
          "decode_throughput": "Decode throughput: dense vs offloading vs PulseInfer",
          "accuracy": "Sparse decoding accuracy against the budget",
          "h200_predict": "Predicted decode throughput per system"}


def plot_file(path: pathlib.Path, out_dir: pathlib.Path | None) -> pathlib.Path:
    data = json.loads(path.read_text())
    kind = result_kind(data, path)
    if kind not in PLOTTERS:
        raise SystemExit(f"{path}: no plotter for kind {kind!r} (have {', '.join(PLOTTERS)})")
    out_dir = out_dir or path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"{path.stem}.png"
    PLOTTERS[kind](data, title_of(data, TITLES.get(kind, kind)), png)
    return png


def plot_combined(paths: list[pathlib.Path], name: str, out_dir: pathlib.Path | None,
                  labels: list[str] | None = None) -> pathlib.Path:
    """Several JSONs of one kind overlaid in one PNG, out_dir/<name>.png; labels (one per JSON) name their lines."""
    if labels and len(labels) != len(paths):
        raise SystemExit(f"--labels: {len(labels)} labels for {len(paths)} JSONs")
    loaded = [(lab, json.loads(p.read_text())) for lab, p in zip(labels or [p.stem for p in paths], paths,
                                                                  strict=True)]
    kinds = sorted({result_kind(d, p) for p, (_, d) in zip(paths, loaded, strict=True)})
    if len(kinds) != 1 or kinds[0] not in COMBINERS:
        raise SystemExit(f"--combine needs JSONs of one kind among {', '.join(COMBINERS)}; got {kinds}")
    kind = kinds[0]
    out_dir = out_dir or paths[0].parent
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"{name}.png"
    COMBINERS[kind](loaded, title_of(loaded[0][1], TITLES.get(kind, kind)), png)
    return png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=pathlib.Path, help="result JSON files")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="PNG directory (default: next to each JSON)")
    ap.add_argument("--combine", metavar="NAME", default=None,
                    help="overlay every JSON (one kind) in one PNG, NAME.png (kinds: accuracy)")
    ap.add_argument("--labels", nargs="+", default=None, help="with --combine: one label per JSON")
    args = ap.parse_args(argv)
    if args.combine:
        print(f"wrote {plot_combined(args.results, args.combine, args.out, args.labels)}")
        return 0
    for path in args.results:
        print(f"wrote {plot_file(path, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
