"""RoPE scaling against Hugging Face transformers: YaRN inverse frequencies and cos/sin factor (golden from
tests/goldens/make_rope_golden.py), and that the tables the model uses carry them."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDENS
from pulseinfer_jax.models.config import ModelConfig, YarnScaling
from pulseinfer_jax.models.presets import PRESETS
from pulseinfer_jax.models.rope import rope_tables

GOLDEN = json.loads((GOLDENS / "rope_yarn.json").read_text())


def _cfg(d: dict) -> ModelConfig:
    base = {"vocab_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    return ModelConfig.from_hf_dict({**base, **d}, name="yarn")


@pytest.mark.parametrize("name", sorted(GOLDEN["cases"]))
def test_yarn_matches_transformers(name):
    case = GOLDEN["cases"][name]
    cfg = _cfg(case["config"])
    assert isinstance(cfg.rope_scaling, YarnScaling)
    # transformers computes in float32; ours in float64
    np.testing.assert_allclose(cfg.inv_freq(), case["inv_freq"], rtol=2e-6, atol=0)
    assert cfg.rope_cos_sin_scale == pytest.approx(case["attention_factor"], rel=1e-12)


def test_rope_tables_carry_the_attention_factor():
    cfg = _cfg(GOLDEN["cases"]["qwen3_14b_128k"]["config"])
    pos = jnp.array([0, 1, 100_000])
    cos, sin = rope_tables(cfg, pos)
    angles = (np.asarray(pos, np.float32)[:, None] * cfg.inv_freq().astype(np.float32)).astype(np.float64)
    f = GOLDEN["cases"]["qwen3_14b_128k"]["attention_factor"]
    np.testing.assert_allclose(np.asarray(cos), np.cos(angles) * f, atol=1e-5)
    np.testing.assert_allclose(np.asarray(sin), np.sin(angles) * f, atol=1e-5)
    assert float(cos[0, 0]) == pytest.approx(f)


def test_yarn_factor_defaults_and_the_qwen3_128k_preset():
    d = dict(GOLDEN["cases"]["qwen3_14b_128k"]["config"])
    d["rope_scaling"] = {"rope_type": "yarn", "original_max_position_embeddings": 32768}  # factor from the ratio
    assert _cfg(d).rope_scaling.factor == 4.0
    long = ModelConfig.from_hf_dict(PRESETS["qwen3-14b-128k"], name="qwen3-14b-128k")
    short = ModelConfig.from_hf_dict(PRESETS["qwen3-14b"], name="qwen3-14b")
    assert long.max_position_embeddings == 131072 and short.max_position_embeddings == 40960
    np.testing.assert_allclose(long.inv_freq(), GOLDEN["cases"]["qwen3_14b_128k"]["inv_freq"], rtol=2e-6)
    assert dataclasses.replace(long, rope_scaling=None, max_position_embeddings=40960, name="qwen3-14b") == short


def test_a_yarn_checkpoint_loads_and_decodes(tmp_path, monkeypatch):
    """A Qwen3 checkpoint with a YaRN setting runs end to end, and the scaling changes the logits (positions
    past the original context get interpolated frequencies and cos/sin carry the attention factor)."""
    import shutil

    from conftest import TINY, record_sampled_logits
    from pulseinfer_jax.models.loading import load_model

    from pulseinfer_jax import generate_long

    d = tmp_path / "qwen3_yarn"
    shutil.copytree(TINY / "qwen3", d)
    cfg = json.loads((d / "config.json").read_text())
    # transformers 5 spelling (the goldens above use the older `rope_scaling`)
    cfg["rope_parameters"] = {"rope_theta": 1000000.0, "rope_type": "yarn", "factor": 4.0,
                              "original_max_position_embeddings": 64}
    (d / "config.json").write_text(json.dumps(cfg))
    plain, yarn = load_model(TINY / "qwen3"), load_model(d)
    assert isinstance(yarn.cfg.rope_scaling, YarnScaling) and plain.cfg.rope_scaling is None
    seen = record_sampled_logits(monkeypatch)
    prompt = [[5, 17, 42, 7, 99, 3, 12, 8] * 12]
    first = {}
    for name, m in (("plain", plain), ("yarn", yarn)):
        res = generate_long(prompt, m, max_new_tokens=4, ignore_eos=True)
        assert len(res[0].token_ids) == 4
        first[name] = np.array(seen[(0, 0)])
        assert np.isfinite(first[name]).all()
    assert not np.allclose(first["plain"], first["yarn"], atol=1e-3)
