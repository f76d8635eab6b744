"""The split-K merge inside the sparse decode kernel beyond its own tests: the engine decoding with its attention split
2, 4 and 16 ways (MAX_SPLIT_K, the most the kernel picks on its own) against the jnp path, and the GPU stress
script's CPU smoke run. The kernel's own merge tests are in test_sparse_decode_attention.py."""

import json

import jax
import numpy as np
import pulseinfer_jax.pallas_kernels.sparse_decode_attention as sda_kernel
import pytest
from conftest import record_sampled_logits
from jax.experimental import pallas as pl

from bench import merge_stress
from pulseinfer_jax import Engine, EngineConfig, generate_long

BASE = dict(block_size=4, max_batch=4, prefill_chunk=32, key_chunk=32, window_tokens=8, sink_blocks=1,
            mode="offload", budget_tokens=512, dense_layers=1, progress=False)


def test_engine_attention_split_k_ways_matches_the_jnp_path(tiny, monkeypatch):
    """Offloaded decode (one dense and one sparse layer of the tiny model, the whole context in the budget) with the
    Pallas attention forced to 2, 4 and MAX_SPLIT_K splits, merged inside the kernel with the decoder's one counter
    buffer: the jnp path's greedy tokens, logits within 1e-5 of their scale, every kernel call at the forced split
    count, the counters 0 after. The lists (55 and 64 blocks of 4 tokens) are 4 steps of 16 blocks: every split holds
    tokens at 2 and 4 splits, 4 of 16 do at 16 (the others are empty partials the merge must weigh 0)."""
    assert sda_kernel.MAX_SPLIT_K == 16
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, tiny.cfg.vocab_size, 213).tolist()]
    seen = record_sampled_logits(monkeypatch)
    want = generate_long(prompts, tiny, max_new_tokens=6, ignore_eos=True,
                         engine_config=EngineConfig.of(**BASE, decode_attention="jnp"))
    want_logits = dict(seen)
    scale = max(float(np.max(np.abs(v))) for v in want_logits.values())

    splits: list[int] = []
    pick = sda_kernel._pick_split_k
    monkeypatch.setattr(sda_kernel, "_pick_split_k", lambda *a: splits.append(pick(*a)) or splits[-1])
    for split_k in (2, 4, sda_kernel.MAX_SPLIT_K):  # (a static argument of the layer calls: traced anew for each)
        seen.clear()
        splits.clear()
        eng = Engine(tiny, EngineConfig.of(**BASE, decode_attention="pallas", attention_split_k=split_k))
        got = generate_long(prompts, eng, max_new_tokens=6, ignore_eos=True, engine_config=eng.config)
        assert splits and set(splits) == {split_k}, splits
        assert [r.token_ids for r in got] == [r.token_ids for r in want], split_k
        assert seen.keys() == want_logits.keys()
        worst = max(float(np.max(np.abs(seen[k] - want_logits[k]))) for k in seen)
        assert worst <= 1e-5 * scale, (split_k, worst, scale)
        assert not np.asarray(eng.sparse.arrivals).any()
        assert all(r.stats["offloaded"] and r.stats["recalled_blocks"] > 0 for r in got)


def test_merge_stress_smoke(tmp_path, monkeypatch):
    """bench/merge_stress.py --smoke (interpret mode, tiny shapes, a strided launch order) runs end to end and records
    every case as agreeing with the reference, bit for bit from call to call, its counters back at 0; with a gate that
    merges in the last program of each grid row instead of the last to arrive it reports the failure and exits 1."""
    out = tmp_path / "stress.json"
    assert merge_stress.main(["--smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    cases = data["cases"]
    assert data["ok"] and len(cases) >= 2 and {c["split_k"] for c in cases} >= {2, sda_kernel.MAX_SPLIT_K}
    for c in cases:
        assert c["iterations"] > c["variants"] and c["bad_iterations"] == 0 and c["counters_left"] == 0
        assert c["max_abs_err"] <= c["tol"] and c["order"] == "strided"
    with pytest.raises(SystemExit):
        merge_stress.main(["--smoke", "--splits", "0", "--out", str(out)])

    monkeypatch.setattr(sda_kernel, "_arrived_last", lambda arrivals, counter, splits, *, barrier:
                        pl.program_id(2) == splits - 1)
    jax.clear_caches()  # (traced anew with the broken gate)
    try:
        assert merge_stress.main(["--smoke", "--splits", "4", "--layouts", "headwise", "--out", str(out)]) == 1
    finally:
        monkeypatch.undo()
        jax.clear_caches()  # (no kernel traced with the broken gate stays cached)
    data = json.loads(out.read_text())
    assert not data["ok"] and data["cases"][0]["bad_iterations"] > 0
