"""Shared bits of the benchmark scripts: machine description and result writing."""

from __future__ import annotations

import datetime
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


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=pathlib.Path(__file__).parent).stdout.strip()
    except OSError:
        return ""


def write_result(name: str, payload: dict, out_dir: pathlib.Path | None = None) -> pathlib.Path:
    out_dir = pathlib.Path(out_dir or RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), "git": git_rev(),
               "machine": machine(), **payload}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
