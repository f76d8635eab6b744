"""bench/io_sweep.py and bench/plots.py: row accounting, every mode measured, the paths move the same bits."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from bench import io_sweep
from bench.io_sweep import SweepConfig

# tiny KV shapes: unit = 2*4*8*4 = 256 B, block = 2 units = 512 B
TINY = SweepConfig(min_bytes=256, max_bytes=2048, volume=4096, max_copies=8, repeats=1, device_copy_min=4096,
                   device_copy_max=16384, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
DEV = jax.devices()[0]


@pytest.mark.parametrize("host_io", ["xla", "numpy", "numpy-pinned"])
def test_sweep_rows_account_bytes_and_cover_every_mode(host_io):
    snapshots = []
    cfg = dataclasses.replace(TINY, host_io=host_io)
    out = io_sweep.sweep(cfg, DEV, list(io_sweep.RUNNABLE), lambda rows: snapshots.append(len(rows)))
    rows = out["rows"]
    assert out["paths_agree"] is True
    assert {r["mode"] for r in rows} == set(io_sweep.MODES)
    # written after every mode, each time with more rows (what survives a timeout)
    assert len(snapshots) == len(io_sweep.RUNNABLE) and snapshots == sorted(set(snapshots))
    assert snapshots[-1] == len(rows)
    for r in rows:
        assert r["total_bytes"] == r["copies"] * r["transfer_bytes"] > 0
        assert 0 < r["seconds_best"] <= r["seconds_median"]
        want_traffic = 2 * r["total_bytes"] if r["mode"] == "device_copy" else r["total_bytes"]
        assert r["traffic_bytes"] == want_traffic
        assert r["gb_per_s"] == pytest.approx(want_traffic / r["seconds_best"] / 1e9)
        assert r["us_per_copy"] == pytest.approx(r["seconds_best"] / r["copies"] * 1e6)
    by = {m: [r for r in rows if r["mode"] == m] for m in io_sweep.MODES}
    # per_block: one row per power-of-two size, copies capped by volume and max_copies
    assert [r["transfer_bytes"] for r in by["per_block"]] == [256, 512, 1024, 2048]
    assert [r["copies"] for r in by["per_block"]] == [8, 8, 4, 2]
    # fixed-unit paths: the pool's unit / block sizes, n = 1, 2, 4, ... copies
    assert {r["transfer_bytes"] for r in by["per_block_head"]} == {256}
    assert {r["transfer_bytes"] for r in by["per_block_head_python"]} == {256}
    assert [r["copies"] for r in by["per_block_head"]] == [1, 2, 4, 8]
    assert {r["transfer_bytes"] for r in by["per_block_gather"]} == {512}
    assert [r["copies"] for r in by["per_block_gather"]] == [1, 2, 4]
    # coalesced and its parts: one copy of n blocks, n = 1 .. max_bytes / block
    for mode in ("coalesced", "coalesced_host_gather", "coalesced_copy"):
        assert [(r["transfer_bytes"], r["copies"]) for r in by[mode]] == [(512, 1), (1024, 1), (2048, 1)]
    assert [r["transfer_bytes"] for r in by["device_copy"]] == [4096, 16384]


def _tiny_pool(rows=9, host_io="xla"):
    pool, data = io_sweep.make_pool(dataclasses.replace(TINY, host_io=host_io), DEV, rows)
    data[0, 3, 1, 2, 1, 5] = np.nan  # NaN payloads must survive every path
    pool.load(data)
    return pool, data


@pytest.mark.parametrize("host_io", ["xla", "numpy"])
def test_coalesced_moves_the_same_bits_as_per_block(host_io):
    pool, data = _tiny_pool(host_io=host_io)
    rows = [int(r) for r in np.random.default_rng(1).permutation(np.arange(1, 9))]  # shuffled, all rows
    coalesced = np.asarray(pool.gather_blocks(0, rows))  # [8, 2, bs, Hkv, hd]: one copy
    per_block = np.stack([np.asarray(pool.gather_blocks(0, [r]))[0] for r in rows])  # 8 copies
    # per_block mode's way: host slices in the backend's memory, one Python device_put each
    python = np.stack([np.asarray(pool.to_device(pool.io.load(data[0, r]))) for r in rows])
    assert coalesced.shape == per_block.shape == (8, 2, 4, 2, 8)
    assert np.isnan(coalesced).any()
    np.testing.assert_array_equal(coalesced.view(np.uint8), per_block.view(np.uint8))
    np.testing.assert_array_equal(coalesced.view(np.uint8), python.view(np.uint8))
    np.testing.assert_array_equal(coalesced.view(np.uint8), data[0, rows].view(np.uint8))
    heads = [r % 2 for r in rows]
    io_sweep.check_paths_agree(pool, data, rows, heads)


def test_check_paths_agree_catches_a_wrong_bit():
    pool, data = _tiny_pool()
    bad = data.copy()
    bad[0, 2, 0, 0, 0, 0] = np.float32(1.0) if data[0, 2, 0, 0, 0, 0] != 1.0 else np.float32(2.0)
    with pytest.raises(AssertionError):
        io_sweep.check_paths_agree(pool, bad, [2, 5], [0, 1])


@pytest.mark.parametrize("host_io", ["auto", "numpy", "numpy-pinned"])
def test_main_writes_partial_then_complete_json(tmp_path, host_io):
    args = ["--max-bytes", "8192", "--volume", "16384", "--max-copies", "4", "--repeats", "1",
            "--modes", "per_block,coalesced", "--out", str(tmp_path), "--host-io", host_io]
    assert io_sweep.main(args) == 0
    suffix = {"auto": "", "numpy": "_numpy", "numpy-pinned": "_numpy_pinned"}[host_io]
    data = json.loads((tmp_path / f"io_sweep_{DEV.platform}{suffix}.json").read_text())
    assert data["kind"] == "io_sweep" and data["complete"] is True
    assert data["host_io"] == ("xla" if host_io == "auto" else host_io)
    assert data["pcie_meaningful"] is (DEV.platform == "gpu")
    assert {r["mode"] for r in data["rows"]} == {"per_block", "coalesced", "coalesced_host_gather", "coalesced_copy"}
    assert "machine" in data and "date" in data


def test_plots_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from bench import plots

    t = (1e-3, 2e-3)
    rows = [io_sweep.make_row("per_block", s, 4, t) for s in (4096, 8192, 16384)]
    rows += [io_sweep.make_row("per_block_head", 8192, n, t) for n in (1, 2, 4)]
    rows += [io_sweep.make_row("coalesced", s, 1, t) for s in (65536, 131072)]
    rows += [io_sweep.make_row("device_copy", s, 1, t, 2 * s) for s in (1 << 20, 1 << 22)]
    src = tmp_path / "io_sweep_test.json"  # no "kind": dispatched on the file name prefix
    src.write_text(json.dumps({"date": "2025-01-01", "machine": {"device": "Test GPU", "jax_backend": "gpu"},
                               "rows": rows}))
    assert plots.main([str(src), "--out", str(tmp_path / "png")]) == 0
    png = tmp_path / "png" / "io_sweep_test.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    per_copy, per_batch = plots.io_sweep_panels(rows)
    assert set(per_copy) == {"per_block", "coalesced", "device_copy"}
    assert set(per_batch) == {"per_block_head", "coalesced"}
    unknown = tmp_path / "other.json"
    unknown.write_text("{}")
    with pytest.raises(SystemExit, match="no 'kind'"):
        plots.main([str(unknown)])
