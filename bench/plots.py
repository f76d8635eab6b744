"""Plots of benchmark result JSONs (PNG, matplotlib's Agg backend; needs `pip install -e .[bench]`).

    python bench/plots.py bench/results/io_sweep_gpu.json --out bench/results
    python bench/plots.py A.json B.json --out DIR      # one PNG per JSON: DIR/<json stem>.png

Each JSON is dispatched on its "kind" field (or, for files without one, the file name's prefix) to a plotter
in PLOTTERS; adding a result kind = writing one `plot_<kind>(data, title, path)` and registering it.

  - io_sweep (bench/io_sweep.py): GB/s against transfer size, log2 x axis, one line per mode. Left panel: per
    copy size (per_block's raw curve, coalesced's one copy, the device copy ceiling); right panel: per batch
    volume for the fixed-unit paths (8 KB (block, head) units, 64 KB blocks, one copy per unit/block) next to
    coalesced, which is the comparison the engine's I/O design rests on.
  - decode_throughput (bench/decode_throughput.py): decode tokens/s against the batch reached per system (one
    panel per context) and the step-time (TPOT) distribution per system at the largest batch.
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
    """Top row: decode tokens/s against the batch each system reached, one panel per context. Bottom: the
    distribution of per-step times (TPOT) per system at the largest requested batch of each context."""
    plt = _pyplot()
    series = throughput_series(data["points"])
    if not series:
        raise SystemExit("no measured point in this decode_throughput JSON")
    fig, axes = plt.subplots(2, len(series), figsize=(max(9, 6 * len(series)), 9), squeeze=False,
                             constrained_layout=True)
    for col, (ctx, systems) in enumerate(series.items()):
        ax = axes[0, col]
        for system, pts in systems.items():
            ax.plot([b for b, _ in pts], [t for _, t in pts], marker="o", ms=4, label=system)
        ax.set_title(f"context {ctx:,} tokens")
        ax.set_xlabel("batch reached (requests decoding together)")
        ax.set_ylabel("decode tokens/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[1, col]
        top = max(p["batch_requested"] for p in data["points"] if p["context"] == ctx)
        rows = [p for p in data["points"] if p["context"] == ctx and p["batch_requested"] == top
                and "step_s_all" in p]
        if rows:
            ax.boxplot([[t * 1e3 for t in p["step_s_all"]] for p in rows], whis=(1, 99))
            ax.set_xticks(range(1, len(rows) + 1), [p["system"] for p in rows], rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("TPOT = step time (ms)")
        ax.set_title(f"step-time distribution, {top} requests requested")
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"{title}\n{data.get('model', '')} {data.get('dtype', '')}; {data.get('kv', '')}; "
                 f"selection: {data.get('selection_source', '')}", fontsize=10)
    fig.savefig(path, dpi=120)
    plt.close(fig)


PLOTTERS: dict[str, Callable[[dict, str, pathlib.Path], None]] = {
    "io_sweep": plot_io_sweep, "decode_throughput": plot_decode_throughput}
TITLES = {"io_sweep": "Host-to-device bandwidth by transfer size",
          "decode_throughput": "Decode throughput: dense vs offloading vs PulseInfer"}


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=pathlib.Path, help="result JSON files")
    ap.add_argument("--out", type=pathlib.Path, default=None, help="PNG directory (default: next to each JSON)")
    args = ap.parse_args(argv)
    for path in args.results:
        print(f"wrote {plot_file(path, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
