"""bench/oracle_accuracy.py: policy parsing, a budget covering everything is dense, small budgets drop blocks, the
script runs end to end (its Quest scores are the engine's `block_scores_reference`, tested in test_block_scoring)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from bench import oracle_accuracy as oa


def test_parse_policy():
    assert oa.parse_policy("quest-solohead:perhead:beta=0.5:temp=2") == (
        "quest-solohead", {"perhead": True, "beta": 0.5, "temp": 2.0, "sub": 1, "middle": False, "est": "",
                           "bounds": "float8_e4m3fn", "coarse": 1, "keep": 2.0})
    assert oa.parse_policy("quest-solohead:bounds=kv")[1]["bounds"] == "kv"
    assert oa.parse_policy("quest-solohead:coarse=16:keep=4")[1] == {
        **oa.parse_policy("quest-solohead")[1], "coarse": 16, "keep": 4.0}
    assert oa.parse_policy("oracle-solohead:est")[1]["est"] == "mean"
    assert oa.parse_policy("quest-headwise:est=mid")[1]["est"] == "mid"
    assert oa.parse_policy("quest-solohead:middle")[1]["middle"] is True
    assert oa.parse_policy("quest-solohead:sub=2")[1]["sub"] == 2
    for bad in ("quest", "oracle-solohead:beta=1", "quest-headwise:perhead", "quest-solohead:gamma=1",
                "quest-solohead:sub=0", "quest-solohead:sub=x", "quest-solohead:est=max", "oracle-solohead:est:sub=2",
                "quest-solohead:bounds=int8", "oracle-solohead:bounds=kv", "quest-solohead:coarse=x",
                "oracle-solohead:coarse=4"):
        with pytest.raises(ValueError):
            oa.parse_policy(bad)


def _rows(model, n_prompt=70, n_rows=12, seed=0):
    rng = np.random.default_rng(seed)
    toks = rng.integers(3, model.cfg.vocab_size, n_prompt + n_rows).tolist()
    k, v, first = oa.prompt_pass(model, toks[:n_prompt])
    return k, v, first, jnp.asarray(toks[n_prompt:], jnp.int32), toks


def test_full_budget_is_dense_and_the_prompt_pass_is_the_model(tiny4):
    k, v, first, rows, toks = _rows(tiny4)
    kw = dict(bs=4, sink=1, window=2, dense_layers=1)
    dense = oa.rows_pass(tiny4.transformer, tiny4.params, k, v, rows, policy="dense", budget=1, **kw)
    ref = tiny4.transformer.forward(tiny4.params, jnp.asarray(toks)[None])[0]  # plain causal forward
    np.testing.assert_allclose(first, ref[69], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dense, ref[70:], rtol=1e-4, atol=1e-4)
    for policy in ("quest-solohead", "oracle-headwise", "quest-solohead:perhead:beta=0.5", "quest-solohead:sub=2",
                   "quest-solohead:perhead:middle", "quest-solohead:est", "oracle-solohead:est=mid"):
        full = oa.rows_pass(tiny4.transformer, tiny4.params, k, v, rows, policy=policy, budget=32, **kw)
        tol = 1e-4 if ":est" in policy else 1e-6  # (est: the pseudo-token columns change the reduction order)
        np.testing.assert_allclose(full, dense, rtol=tol, atol=tol)  # 32 blocks cover all 21 blocks
        small = oa.rows_pass(tiny4.transformer, tiny4.params, k, v, rows, policy=policy, budget=4, **kw)
        assert np.abs(np.asarray(small) - np.asarray(dense)).max() > 1e-3  # 4 of 18-21 blocks: it drops some


def test_estimated_tail_changes_only_what_is_dropped(tiny4):
    """`:est` adds the unselected blocks as pseudo-tokens: a different result at a small budget, and the mean key
    differs from the bounds' midpoint."""
    k, v, _, rows, _ = _rows(tiny4)
    kw = dict(bs=4, sink=1, window=2, dense_layers=1)
    run = {p: np.asarray(oa.rows_pass(tiny4.transformer, tiny4.params, k, v, rows, policy=p, budget=4, **kw))
           for p in ("oracle-solohead", "oracle-solohead:est", "oracle-solohead:est=mid")}
    assert all(np.isfinite(r).all() for r in run.values())
    assert np.abs(run["oracle-solohead:est"] - run["oracle-solohead"]).max() > 1e-4
    assert np.abs(run["oracle-solohead:est"] - run["oracle-solohead:est=mid"]).max() > 1e-5


def test_main_smoke_writes_json(tmp_path):
    pytest.importorskip("gguf")
    from pulseinfer_jax.models.default_model import ModelNotFoundError, default_model_path

    try:
        default_model_path()  # the smoke runs the embedded SmolLM2 (it needs a tokenizer and a text)
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    assert oa.main(["--smoke", "--out", str(tmp_path), "--policies", "quest-solohead,oracle-solohead"]) == 0
    data = json.loads((tmp_path / "oracle_accuracy_smoke.json").read_text())
    assert data["complete"] is True and [r["policy"] for r in data["results"]] == ["quest-solohead",
                                                                                 "oracle-solohead"]
    assert all(0 <= r["top1"] <= 1 and r["kl"] >= 0 for r in data["results"])


@pytest.mark.parametrize("policy,engine_kw", [
    ("quest-solohead:perhead:beta=0.5", {}),  # the engine's default scoring (sink and window blocks scored too)
    ("quest-solohead:perhead:beta=0.5:bounds=kv", dict(score_bounds_dtype="kv")),  # exact bounds
    ("quest-solohead:perhead:beta=0.5:middle", dict(score_kept_blocks=False)),
    ("quest-solohead:beta=0.5:sub=2", dict(score_per_query_head=False, score_sub_blocks=2)),
    ("quest-solohead:perhead:beta=0.5:sub=2:middle", dict(score_sub_blocks=2, score_kept_blocks=False)),
    ("quest-headwise:beta=0.5", dict(selection="headwise")),
    ("quest-solohead:perhead:beta=0.5:coarse=2:keep=1", dict(score_coarse_group=2, score_coarse_keep=1.0)),
    ("quest-headwise:beta=0.5:sub=2:coarse=4:keep=1", dict(selection="headwise", score_sub_blocks=2,
                                                          score_coarse_group=4, score_coarse_keep=1.0)),
])
def test_harness_reproduces_the_engine(tiny4, policy, engine_kw):
    """The harness's teacher-forced logits are the engine's own (offloaded sparse decoding, same budget / sinks /
    window / dense layers, same scoring; the engine without the resident-block bonus, which depends on what earlier
    steps recalled and so has no place in the harness's parallel rows), while the budget really drops blocks and
    scoring the kept blocks (or not) really changes the SoloHead selection."""
    from bench.accuracy import teacher_forced_logits
    from pulseinfer_jax import EngineConfig

    k, v, first, rows, toks = _rows(tiny4)
    targets = toks[70:]

    def harness(pol):
        return np.concatenate([first[None], np.asarray(oa.rows_pass(
            tiny4.transformer, tiny4.params, k, v, rows[:-1], policy=pol, budget=6, bs=4, sink=1, window=2,
            dense_layers=1))])

    cfg = EngineConfig.of(block_size=4, prefill_chunk=32, key_chunk=32, window_tokens=8, sink_blocks=1, dense_layers=1,
                       mode="offload", budget_tokens=24, resident_bonus=0.0, recall="interruptible",
                       **engine_kw)  # (no slot history; the same-layer recall attends the whole selection in its step)
    engine = teacher_forced_logits(tiny4, cfg, toks[:70], targets)
    same = harness(policy)
    assert engine.shape == same.shape == (len(targets), tiny4.cfg.vocab_size)
    scale = np.abs(engine).max()
    np.testing.assert_allclose(same, engine, rtol=0, atol=1e-5 * scale)
    dense_cfg = EngineConfig.of(block_size=4, prefill_chunk=32, key_chunk=32)
    dense = teacher_forced_logits(tiny4, dense_cfg, toks[:70], targets)
    assert np.abs(dense - engine).max() > 1e-3 * scale  # 6 of 18-21 blocks: the selection matters
    if ":coarse" in policy:  # the first level really drops blocks the plain scorer would select
        assert np.abs(harness(policy.split(":coarse")[0]) - engine).max() > 1e-3 * scale
    if policy.startswith("quest-solohead"):
        other = policy.replace(":middle", "") if policy.endswith(":middle") else policy + ":middle"
        assert np.abs(harness(other) - engine).max() > 1e-3 * scale  # the kept blocks' scores change selections
