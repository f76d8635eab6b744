"""The recall's host gather: GB/s of gathering a layer's selected KV blocks into one staging buffer, on the host.

    python bench/host_gather.py [--pool-gib 4] [--blocks 64,256,1024] [--out DIR]

On a GPU machine a coalesced recall is a host gather (host_offload/xla_io.stage_blocks: one XLA host computation,
XLA:CPU code run by the host) and one host-to-device copy of the staging buffer; the recall runs at the slower of
the two, so this gather is measured against the ~50 GB/s of PCIe Gen5. The host code is the same on this CPU
machine (the CPU backend runs the same XLA:CPU gather on the same pool layout), so it is measured here, at the sizes
a GPU step produces: Llama-3.1-8B blocks (16 tokens x 8 KV heads x 128 x bf16, K and V: 64 KiB), 64 to 1,024 of
them (4 to 64 MiB per layer and micro-batch), random rows of a pool larger than the caches. Also: numpy's fancy-
index gather (host_io="numpy"), the same into a preallocated buffer as host_io="numpy-pinned" gathers (checked rows,
mode "clip"; numpy's default mode "raise" gathers into a temporary first), and a copy of the same bytes (the machine's
memory bandwidth for a streaming copy, the ceiling), each with 1 and, where it helps, several threads.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from pulseinfer_jax.host_offload.pinned_staging import PinnedStaging  # noqa: E402

from bench.common import write_result  # noqa: E402

BLOCK = (2, 16, 8, 128)  # one block of one layer: K|V, tokens, KV heads, head dim (Llama-3.1-8B)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up (and compile)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(n: int, io, pool, pool_np: np.ndarray, rng, threads: list[int], repeats: int) -> dict:
    """GB/s of each way to gather n random blocks of one layer (a different layer each call: cold in the caches)."""
    layers, rows = pool_np.shape[:2]
    block_bytes = int(np.prod(pool_np.shape[2:])) * pool_np.dtype.itemsize
    as_bytes = pool_np.view(np.uint8).reshape(layers, rows, block_bytes)  # a block = one row of bytes
    picks = [np.sort(rng.choice(rows, n, replace=False)).astype(np.int32) for _ in range(layers)]
    staging = np.empty((n, block_bytes), np.uint8)
    state = {"layer": 0}

    def next_layer() -> int:
        state["layer"] = (state["layer"] + 1) % layers
        return state["layer"]

    def xla():
        layer = next_layer()
        jax.block_until_ready(io.stage_blocks(pool, layer, picks[layer]))

    def numpy_fancy():
        layer = next_layer()
        return pool_np[layer][picks[layer]]

    def bytes_fancy():
        layer = next_layer()
        return as_bytes[layer][picks[layer]]

    def bytes_take():
        layer = next_layer()
        np.take(as_bytes[layer], picks[layer], axis=0, out=staging)

    pinned_staging = np.empty((n, *pool_np.shape[2:]), pool_np.dtype)

    def numpy_into_staging():  # as host_offload/pinned_staging.py gathers (checked rows, mode "clip")
        layer = next_layer()
        PinnedStaging.take_rows(pool_np[layer], picks[layer], pinned_staging)

    src = np.ascontiguousarray(as_bytes[0, :n])

    def stream_copy():
        np.copyto(staging, src)

    nbytes = n * block_bytes
    ways = {"xla host gather (engine)": xla, "numpy fancy index (numpy io)": numpy_fancy,
            "numpy into staging (numpy-pinned io)": numpy_into_staging,
            "numpy rows of bytes": bytes_fancy, "numpy rows of bytes into staging": bytes_take,
            "contiguous copy (ceiling)": stream_copy}
    out = {name: nbytes / timed(fn, repeats) / 1e9 for name, fn in ways.items()}
    for k in threads:
        if k == 1:
            continue
        with concurrent.futures.ThreadPoolExecutor(k) as ex:
            parts = [part for part in np.array_split(np.arange(n), k) if len(part)]

            def parallel(parts=parts, ex=ex):
                layer = next_layer()

                def one(idx):
                    np.take(as_bytes[layer], picks[layer][idx], axis=0, out=staging[idx[0]:idx[-1] + 1])

                list(ex.map(one, parts))

            out[f"numpy rows of bytes into staging, {k} threads"] = nbytes / timed(parallel, repeats) / 1e9
    return {"blocks": n, "bytes": nbytes, "gb_per_s": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pool-gib", type=float, default=4.0, help="host pool size (larger than the caches)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--blocks", default="64,256,1024")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", default=None, help="comma list of thread counts for the parallel gathers "
                    "(default 1 and the machine's cores)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from pulseinfer_jax.host_offload.xla_io import XlaHostIO

    block_bytes = int(np.prod(BLOCK)) * 2
    rows = int(a.pool_gib * (1 << 30) // (a.layers * block_bytes))
    shape = (a.layers, rows, *BLOCK)
    rng = np.random.default_rng(0)
    pool_np = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(jnp.bfloat16)
    io = XlaHostIO(jax.devices()[0], first_layer=0)
    pool = io.load(pool_np)
    cores = os.cpu_count() or 1
    threads = [int(t) for t in a.threads.split(",")] if a.threads else sorted({1, cores})
    grid = []
    for n in (int(x) for x in a.blocks.split(",")):
        row = measure(n, io, pool, pool_np, rng, threads, a.repeats)
        grid.append(row)
        print(f"{n:5d} blocks ({row['bytes'] / 2**20:5.1f} MiB): " + ", ".join(
            f"{k} {v:6.2f} GB/s" for k, v in row["gb_per_s"].items()), flush=True)
    rates = [r["gb_per_s"]["xla host gather (engine)"] for r in grid]
    path = write_result("host_gather_cpu", {"pool_bytes": int(pool_np.nbytes), "pool_shape": list(shape),
                                            "block_bytes": block_bytes, "threads": threads, "grid": grid,
                                            "predict_rate_bytes_per_s": float(np.median(rates)) * 1e9,
                                            "note": "XLA:CPU host gather as stage_blocks runs it (CPU backend, "
                                                    "the same host code a GPU machine runs); median of repeats; "
                                                    "predict_rate: the median over sizes of the engine's gather"},
                        a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
