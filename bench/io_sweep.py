"""Host-to-device I/O sweep: bandwidth by transfer size for each way KV blocks can cross PCIe.

    python bench/io_sweep.py                                # 4 KB .. 64 MB copies, 256 MB per size on GPU
    python bench/io_sweep.py --max-bytes 16777216 --repeats 3 --modes per_block,coalesced --out DIR
    python bench/io_sweep.py --smoke --out /tmp/io_smoke    # tiny sizes: a CPU check of the script (< 30 s)
    python bench/io_sweep.py --host-io numpy                # the pageable-RAM fallback backend instead
    python bench/plots.py DIR/io_sweep_gpu.json --out DIR   # the curves as a PNG

Runs on `jax.devices()[0]`, through one host I/O backend of the pool (`--host-io`, host_offload/host_pool.py):
"xla" (the default; `auto` = "xla" unless its probe fails on a GPU): "host" is pinned (page-locked) DRAM and
host gathers are XLA host computations; "numpy": "host" is pageable RAM, gathers are numpy. On a GPU the
copies cross PCIe; on the CPU backend host and device are the same RAM, so the numbers are memcpy and say
nothing about PCIe (the JSON says so in `pcie_meaningful` / `note`). Every measurement is warmed up once
(compiles, first-touch allocations), then timed `--repeats` times with `time.perf_counter` from issuing the
first copy until every result is `jax.block_until_ready`; rows keep the best and the median, and GB/s is
traffic / best time.

Modes (KV shapes are Llama-3.1-8B's: head_dim 128, 8 KV heads, block size 16, bf16, so one (block, head)
unit of one layer is 2*16*128*2 = 8 KB and one whole block of one layer is 64 KB):
  - per_block: a volume V (`--volume`, shrunk so no size issues more than `--max-copies` copies) moved as
    V/S separate Python `jax.device_put(host slice -> device)` calls of S bytes each, S = 4 KB .. 64 MB in
    powers of two. The S-byte source arrays are created in host memory (pinned_host, or numpy) before
    timing; only the copies are timed. The raw bandwidth-vs-transfer-size curve.
  - per_block_head: n (block, head) units (8 KB) through `HostKVPool.fragment_units`: one H2D copy per unit,
    issued by XLA from a loop of dynamic slices of the host pool (the per-head offloading baseline).
  - per_block_head_python: the same n units pre-sliced into separate host arrays, then one Python
    `jax.device_put` per unit (what per_block measures at 8 KB, with units cut from the pool).
  - per_block_gather: n whole blocks (64 KB) as n calls of `HostKVPool.gather_blocks(layer, [row])`: one
    host gather + one device_put per block.
  - coalesced: n shuffled whole blocks in ONE `HostKVPool.gather_blocks(layer, rows)` call: a host gather into
    one pinned staging buffer + one copy of n * 64 KB (n = 1 .. 1024, i.e. 64 KB .. 64 MB). Includes the
    gather and the index uploads, as the engine pays them.
  - coalesced_host_gather: the host gather of `coalesced` alone (`HostKVPool.stage_blocks`, with its index
    upload); no copy.
  - coalesced_copy: the copy of `coalesced` alone (device_put of the already-gathered staging buffer).
  - device_copy: device-to-device bandwidth of a jitted `x + 1` on a float32 device array of S bytes (reads S
    and writes S: traffic 2S), S = 1 MB .. 1 GB on GPU in powers of four.
Row fields: mode, transfer_bytes (per copy), copies, total_bytes (= copies * transfer_bytes), traffic_bytes
(bytes counted for GB/s: total_bytes, or read + write for device_copy), seconds_best, seconds_median,
gb_per_s (traffic / best), gb_per_s_median, us_per_copy (best / copies). Before timing, the script checks that
the coalesced, per-block, per-unit and fragmented paths deliver the same bits as the pool holds.
The JSON (kind "io_sweep") is rewritten after every mode, so a `timeout` keeps what was measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from pulseinfer_jax.host_offload.host_pool import HOST_IO, HostKVPool, checked_host_io  # noqa: E402
from pulseinfer_jax.host_offload.memory import device_sharding  # noqa: E402

from bench.common import write_result  # noqa: E402

KB, MB, GB = 1 << 10, 1 << 20, 1 << 30
RUNNABLE = ("per_block", "per_block_head", "per_block_head_python", "per_block_gather", "coalesced", "device_copy")
MODES = RUNNABLE + ("coalesced_host_gather", "coalesced_copy")  # every row mode (the last two come with coalesced)


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    min_bytes: int = 4 * KB  # smallest per-copy transfer of per_block
    max_bytes: int = 64 * MB  # largest per-copy transfer (per_block) and largest coalesced transfer
    volume: int = 256 * MB  # per_block: bytes moved per size (before the max_copies cap)
    max_copies: int = 8192  # most copies one measurement issues (per_block, per-unit and per-block modes)
    repeats: int = 5
    device_copy_min: int = 1 * MB
    device_copy_max: int = 1 * GB
    # KV shapes of the pool (Llama-3.1-8B): unit = 2*bs*hd*itemsize, block = unit * num_kv_heads
    block_size: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    seed: int = 0
    host_io: str = "xla"  # the pool's I/O backend: "xla" (pinned_host) or "numpy" (pageable RAM)

    @classmethod
    def smoke(cls) -> SweepConfig:
        return cls(max_bytes=256 * KB, volume=1 * MB, max_copies=128, repeats=3, device_copy_max=4 * MB)

    @classmethod
    def cpu(cls) -> SweepConfig:
        """CPU defaults: the numbers are memcpy anyway; keep memory and time modest."""
        return cls(volume=64 * MB, max_copies=2048, repeats=3, device_copy_max=256 * MB)


# ---- timing and rows ---------------------------------------------------------------------------

def time_fn(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(best, median) seconds of `fn()` until its result is ready, after one untimed warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def make_row(mode: str, transfer_bytes: int, copies: int, timing: tuple[float, float],
             traffic_bytes: int | None = None) -> dict:
    best, med = timing
    total = transfer_bytes * copies
    traffic = total if traffic_bytes is None else traffic_bytes
    return {"mode": mode, "transfer_bytes": transfer_bytes, "copies": copies, "total_bytes": total,
            "traffic_bytes": traffic, "seconds_best": best, "seconds_median": med,
            "gb_per_s": traffic / best / 1e9, "gb_per_s_median": traffic / med / 1e9,
            "us_per_copy": best / copies * 1e6}


def pow2_range(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... <= hi (lo itself when hi < lo)."""
    out = [lo]
    while out[-1] * 2 <= hi:
        out.append(out[-1] * 2)
    return out


# ---- mode 1: raw per-copy curve ----------------------------------------------------------------

def sweep_per_block(cfg: SweepConfig, device: jax.Device) -> list[dict]:
    """V/S Python device_puts of S-byte host arrays (the backend's host memory), S = min_bytes .. max_bytes."""
    io, dev = HOST_IO[cfg.host_io](device, 0), device_sharding(device)
    rows = []
    for size in pow2_range(cfg.min_bytes, cfg.max_bytes):
        copies = max(1, min(cfg.max_copies, cfg.volume // size))
        base = np.arange(copies * size, dtype=np.uint8)  # [copies * S] (values wrap; content is irrelevant)
        srcs = jax.block_until_ready([io.load(base[i * size:(i + 1) * size]) for i in range(copies)])
        del base
        timing = time_fn(lambda srcs=srcs: [jax.device_put(s, dev) for s in srcs], cfg.repeats)
        rows.append(make_row("per_block", size, copies, timing))
        del srcs
    return rows


# ---- the KV pool and its paths -----------------------------------------------------------------

def make_pool(cfg: SweepConfig, device: jax.Device, num_rows: int) -> tuple[HostKVPool, np.ndarray]:
    """One-layer HostKVPool (+ its contents as numpy [1, num_rows, 2, bs, Hkv, hd]) filled with random values."""
    pool = HostKVPool(num_rows=num_rows, first_layer=0, num_layers=1, block_size=cfg.block_size,
                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype, device=device,
                      io=cfg.host_io)
    data = np.random.default_rng(cfg.seed).standard_normal(pool.shape, np.float32).astype(pool.dtype)
    data[:, 0] = 0  # the null row stays zero
    pool.load(data)
    return pool, data


def pool_rows_needed(cfg: SweepConfig) -> int:
    """Rows (null row included) so coalesced/per-block draws distinct rows and per-unit distinct (row, head)."""
    unit = 2 * cfg.block_size * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
    block = unit * cfg.num_kv_heads
    max_units = max(1, min(cfg.max_copies, cfg.max_bytes // unit))
    max_blocks = max(1, cfg.max_bytes // block)
    return max(max_blocks, -(-max_units // cfg.num_kv_heads)) + 1


def draw_rows(pool: HostKVPool, n: int, rng: np.random.Generator) -> list[int]:
    """n shuffled distinct non-null rows (with repeats only if the pool is smaller than n)."""
    return [int(r) for r in rng.choice(np.arange(1, pool.num_rows), n, replace=n > pool.num_rows - 1)]


def draw_units(pool: HostKVPool, n: int, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """n shuffled distinct (row, head) units (with repeats only if the pool has fewer)."""
    hkv = pool.shape[4]
    avail = (pool.num_rows - 1) * hkv
    flat = rng.choice(avail, n, replace=n > avail)
    return [int(f // hkv) + 1 for f in flat], [int(f % hkv) for f in flat]


def host_units(pool: HostKVPool, data: np.ndarray, rows: list[int], heads: list[int]) -> list[jax.Array]:
    """The units as separate host arrays [2, bs, hd] of the pool's backend (cut from the pool's contents)."""
    return [pool.io.load(np.ascontiguousarray(data[0, r, :, :, h])) for r, h in zip(rows, heads, strict=True)]


def check_paths_agree(pool: HostKVPool, data: np.ndarray, rows: list[int], heads: list[int]) -> None:
    """Every H2D path delivers the pool's bits: coalesced == per-block == pool rows; fragmented == per-unit
    Python copies == coalesced units == pool units. Raises AssertionError otherwise."""
    n = len(rows)
    want_blocks = data[0, rows].view(np.uint8)  # [n, 2, bs, Hkv, hd] (bits; NaN-safe)
    coalesced = np.asarray(pool.gather_blocks(0, rows))[:n]
    per_block = np.stack([np.asarray(pool.gather_blocks(0, [r]))[0] for r in rows])
    np.testing.assert_array_equal(coalesced.view(np.uint8), want_blocks)
    np.testing.assert_array_equal(per_block.view(np.uint8), want_blocks)
    want_units = np.stack([data[0, r, :, :, h] for r, h in zip(rows, heads, strict=True)]).view(np.uint8)
    python_units = np.stack([np.asarray(pool.to_device(u)) for u in host_units(pool, data, rows, heads)])
    np.testing.assert_array_equal(np.asarray(pool.fragment_units(0, rows, heads))[:n].view(np.uint8), want_units)
    np.testing.assert_array_equal(np.asarray(pool.gather_units(0, rows, heads))[:n].view(np.uint8), want_units)
    np.testing.assert_array_equal(python_units.view(np.uint8), want_units)


# ---- modes 2 and 3: KV-shaped transfers --------------------------------------------------------

def sweep_per_block_head(cfg: SweepConfig, pool: HostKVPool, data: np.ndarray, python: bool) -> list[dict]:
    """n (block, head) units: fragment_units (XLA-issued copy per unit) or one Python device_put per unit."""
    rng = np.random.default_rng(cfg.seed + 1)
    unit = pool.unit_bytes
    rows = []
    for n in pow2_range(1, max(1, min(cfg.max_copies, cfg.max_bytes // unit))):
        r, h = draw_units(pool, n, rng)
        if python:
            srcs = jax.block_until_ready(host_units(pool, data, r, h))
            timing = time_fn(lambda srcs=srcs: [pool.to_device(s) for s in srcs], cfg.repeats)
            rows.append(make_row("per_block_head_python", unit, n, timing))
        else:
            timing = time_fn(lambda r=r, h=h: pool.fragment_units(0, r, h), cfg.repeats)
            rows.append(make_row("per_block_head", unit, n, timing))
    return rows


def sweep_per_block_gather(cfg: SweepConfig, pool: HostKVPool) -> list[dict]:
    """n whole blocks, one gather_blocks call (host gather + one copy) per block."""
    rng = np.random.default_rng(cfg.seed + 2)
    block = pool.layer_block_bytes
    rows = []
    for n in pow2_range(1, max(1, min(cfg.max_copies, cfg.max_bytes // block))):
        r = draw_rows(pool, n, rng)
        timing = time_fn(lambda r=r: [pool.gather_blocks(0, [x]) for x in r], cfg.repeats)
        rows.append(make_row("per_block_gather", block, n, timing))
    return rows


def sweep_coalesced(cfg: SweepConfig, pool: HostKVPool) -> list[dict]:
    """n shuffled whole blocks in one gather_blocks (gather + one copy); the gather alone; the copy alone."""
    rng = np.random.default_rng(cfg.seed + 3)
    block = pool.layer_block_bytes
    out = []
    for n in pow2_range(1, max(1, cfg.max_bytes // block)):
        r = draw_rows(pool, n, rng)
        size = n * block  # n is a power of two: gather_blocks pads nothing
        out.append(make_row("coalesced", size, 1, time_fn(lambda r=r: pool.gather_blocks(0, r), cfg.repeats)))
        t_gather = time_fn(lambda r=r: pool.stage_blocks(0, r), cfg.repeats)
        out.append(make_row("coalesced_host_gather", size, 1, t_gather))
        staging = jax.block_until_ready(pool.stage_blocks(0, r))  # [n, 2, bs, Hkv, hd] in host memory
        out.append(make_row("coalesced_copy", size, 1,
                            time_fn(lambda staging=staging: pool.to_device(staging), cfg.repeats)))
    return out


# ---- mode 4: device copy -----------------------------------------------------------------------

def sweep_device_copy(cfg: SweepConfig, device: jax.Device) -> list[dict]:
    """Jitted x + 1 over S bytes of float32 on the device: reads S, writes S."""
    dev = device_sharding(device)
    add = jax.jit(lambda x: x + 1)
    rows = []
    size = cfg.device_copy_min
    while size <= cfg.device_copy_max:
        x = jax.block_until_ready(jax.device_put(np.zeros(size // 4, np.float32), dev))  # [S / 4]
        rows.append(make_row("device_copy", size, 1, time_fn(lambda x=x: add(x), cfg.repeats), 2 * size))
        del x
        size *= 4
    return rows


# ---- driver ------------------------------------------------------------------------------------

def run_mode(mode: str, cfg: SweepConfig, device: jax.Device, pool_and_data) -> list[dict]:
    """Rows of one mode; `pool_and_data` is a zero-argument callable returning (pool, data) (built once)."""
    if mode == "per_block":
        return sweep_per_block(cfg, device)
    if mode == "device_copy":
        return sweep_device_copy(cfg, device)
    pool, data = pool_and_data()
    if mode in ("per_block_head", "per_block_head_python"):
        return sweep_per_block_head(cfg, pool, data, python=mode == "per_block_head_python")
    if mode == "per_block_gather":
        return sweep_per_block_gather(cfg, pool)
    if mode == "coalesced":
        return sweep_coalesced(cfg, pool)
    raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(RUNNABLE)}")


def format_row(r: dict) -> str:
    return (f"{r['mode']:22s} {_human(r['transfer_bytes']):>8s} x {r['copies']:5d} = {_human(r['total_bytes']):>8s}"
            f"  best {r['seconds_best'] * 1e3:9.3f} ms  median {r['seconds_median'] * 1e3:9.3f} ms"
            f"  {r['gb_per_s']:8.3f} GB/s  {r['us_per_copy']:9.2f} us/copy")


def _human(n: int) -> str:
    for unit, scale in (("GB", GB), ("MB", MB), ("KB", KB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def sweep(cfg: SweepConfig, device: jax.Device, modes: list[str], on_rows: Callable[[list[dict]], None]) -> dict:
    """Run `modes` in order, calling `on_rows(all rows so far)` after each; returns the payload's sweep part."""
    cache: dict = {}

    def pool_and_data():
        if "pool" not in cache:
            cache["pool"] = make_pool(cfg, device, pool_rows_needed(cfg))
            pool, data = cache["pool"]
            rng = np.random.default_rng(cfg.seed + 4)
            n = min(8, pool.num_rows - 1)
            check_paths_agree(pool, data, draw_rows(pool, n, rng), [int(h) for h in rng.integers(0, pool.shape[4], n)])
        return cache["pool"]

    rows: list[dict] = []
    for mode in modes:
        new = run_mode(mode, cfg, device, pool_and_data)
        for r in new:
            print(format_row(r), flush=True)
        rows.extend(new)
        on_rows(rows)
    return {"rows": rows, "paths_agree": True if "pool" in cache else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check of the script)")
    ap.add_argument("--out", default=None, help="result directory (default bench/results)")
    ap.add_argument("--max-bytes", type=int, default=None, help="largest per-copy / coalesced transfer in bytes")
    ap.add_argument("--volume", type=int, default=None, help="per_block bytes moved per transfer size")
    ap.add_argument("--max-copies", type=int, default=None, help="most copies one measurement issues")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats after the warm-up")
    ap.add_argument("--host-io", default="auto", choices=("auto", *HOST_IO),
                    help="the pool's I/O backend; auto = xla unless its probe fails on a GPU (default auto)")
    ap.add_argument("--modes", default=",".join(RUNNABLE),
                    help=f"comma list of {', '.join(RUNNABLE)} (coalesced includes its host-gather and copy parts)")
    args = ap.parse_args(argv)
    device = jax.devices()[0]
    cfg = SweepConfig.smoke() if args.smoke else SweepConfig() if device.platform == "gpu" else SweepConfig.cpu()
    overrides = {"max_bytes": args.max_bytes, "volume": args.volume, "max_copies": args.max_copies,
                 "repeats": args.repeats}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    host_io, probe = args.host_io, None  # (a backend named is swept as it is; "auto": the pinned pool, if it works)
    if host_io == "auto":
        host_io, probe = checked_host_io("xla", device, on_gpu=device.platform == "gpu", block_size=cfg.block_size,
                                         num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, dtype=cfg.dtype)
    if probe is not None:
        print(f"host_io xla failed its probe ({probe}); sweeping host_io numpy", flush=True)
    cfg = dataclasses.replace(cfg, host_io=host_io)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in RUNNABLE]
    if unknown:
        ap.error(f"unknown modes {unknown}; choose from {', '.join(RUNNABLE)}")

    name = "io_sweep_smoke" if args.smoke else f"io_sweep_{device.platform}"
    name += "" if host_io == "xla" else "_" + host_io.replace("-", "_")
    pcie = device.platform == "gpu"
    src = {"xla": "pinned_host", "numpy": "pageable numpy",
           "numpy-pinned": "pageable numpy (whole blocks gathered into pinned staging)"}[host_io]
    meta = {"kind": "io_sweep", "device": str(device), "pcie_meaningful": pcie, "host_io": host_io,
            "xla_probe_error": probe,
            "note": f"{src} -> device copies over PCIe" if pcie else
            f"{device.platform} backend: host and device memory are the same RAM; these are memcpy numbers, "
            "meaningless for PCIe", "config": dataclasses.asdict(cfg), "modes": modes}
    print(f"io sweep on {device} ({device.platform}); {meta['note']}", flush=True)

    def save(rows: list[dict], **extra) -> pathlib.Path:
        return write_result(name, {**meta, "rows": rows, "complete": False, **extra}, args.out)

    result = sweep(cfg, device, modes, save)  # written after every mode: a timeout keeps the finished ones
    path = write_result(name, {**meta, **result, "complete": True}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
