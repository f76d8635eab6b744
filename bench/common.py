"""Shared bits of the benchmark scripts: machine description and result writing."""

from __future__ import annotations

import datetime
import functools
import json
import os
import pathlib
import platform
import subprocess
import sys

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def machine() -> dict:
    import jax

    cpu = ""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dev = jax.devices()[0]
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "jax_backend": dev.platform,
        "device": getattr(dev, "device_kind", str(dev)),
        "jax_version": jax.__version__,
        "python": sys.version.split()[0],
    }


@functools.cache
def git_rev() -> str:
    """The commit the bench runs: read once, at the first call (bench.common's import), so a result written after a
    long run still names the code it ran, not a commit made meanwhile."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=pathlib.Path(__file__).parent).stdout.strip()
    except OSError:
        return ""


git_rev()


def add_block_layout_args(ap) -> None:
    """The sparse layout options the accuracy benches share (defaults: the engine's): block size, always-kept sink
    blocks and recent-window tokens, leading dense layers."""
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--sink-blocks", type=int, default=1)
    ap.add_argument("--window-tokens", type=int, default=64)
    ap.add_argument("--dense-layers", type=int, default=2)


def write_result(name: str, payload: dict, out_dir: pathlib.Path | None = None) -> pathlib.Path:
    out_dir = pathlib.Path(out_dir or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), "git": git_rev(),
               "machine": machine(), **payload}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def sparse_io_stats(eng, log0: int, reqs) -> dict:
    """What an engine's sparse decoder moved since its step-log entry `log0` (means per decode step: host-to-device
    bytes and copies, recall wait), the slot-cache hit rate of `reqs` (their counters: every decode step so far)
    and the GPU KV bytes in use (allocated blocks + key bounds)."""
    import statistics

    sparse = eng.sparse
    log = list(sparse.step_log)[log0:] if sparse is not None else []

    def per_step(key: str) -> float:
        return statistics.mean(e[key] for e in log) if log else 0.0

    counters = [r.sparse.counters for r in reqs if r.sparse is not None]
    hits = sum(c.reused_blocks for c in counters)
    misses = sum(c.recalled_blocks for c in counters)
    used = eng.allocator.capacity - eng.allocator.num_free
    return {"h2d_bytes_per_step": per_step("h2d_bytes"), "h2d_copies_per_step": per_step("h2d_copies"),
            "recall_wait_s_per_step": per_step("recall_wait_s"),
            "slot_hit_rate": hits / (hits + misses) if hits + misses else None,
            "gpu_kv_bytes_in_use": used * eng.spec.bytes_per_block + (sparse.metadata_bytes if sparse else 0)}
