"""The embedded default model (SmolLM2-135M-Instruct GGUF) against transformers' own GGUF load (goldens)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import GOLDENS, record_sampled_logits

from pulseinfer_jax import generate_long

GOLD = json.loads((GOLDENS / "smollm2_gguf.json").read_text())
LOGITS = np.load(GOLDENS / "smollm2_gguf_logits.npz")


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    from pulseinfer_jax.models.default_model import ModelNotFoundError, default_model_path
    from pulseinfer_jax.models.loading import load_model

    try:
        default_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    return load_model(None)


@pytest.mark.parametrize("name", ["chat", "plain"])
def test_last_prompt_logits(smollm2, name):
    ids = LOGITS[f"{name}_prompt_ids"]
    ours = np.asarray(smollm2.transformer.forward(smollm2.params, jnp.asarray(ids[None]))[0, -1])
    np.testing.assert_allclose(ours, LOGITS[f"{name}_last_logits"], atol=2e-3, rtol=0)
    top = GOLD["prompts"][name]["last_logits_top20_ids"]
    assert np.argsort(-ours)[:5].tolist() == top[:5]


def test_greedy_matches_transformers_gguf(smollm2):
    """Both golden prompts decode together (continuous batching) and match token for token and in text."""
    gp = GOLD["prompts"]
    res = generate_long([gp["chat"]["prompt_token_ids"], gp["plain"]["prompt_token_ids"]], smollm2,
                        max_new_tokens=GOLD["greedy_new_tokens"])
    for r, name in zip(res, ["chat", "plain"], strict=True):
        g = gp[name]["greedy"]
        assert r.token_ids == g["new_token_ids"], name
        assert r.text == g["text_skip_special"]
        assert r.finish_reason == ("stop" if g["stop_reason"] == "eos" else "length")


def test_chat_prompt_text_path(smollm2):
    """Text + chat template + our GGUF tokenizer reach the same prompt ids and answer as transformers."""
    g = GOLD["prompts"]["chat"]
    r = generate_long([g["messages"][0]["content"]], smollm2, chat=True, max_new_tokens=16)[0]
    assert r.text == g["greedy"]["text_skip_special"]
    assert r.stats["prompt_tokens"] == len(g["prompt_token_ids"])


def test_offload_full_budget_equals_dense(smollm2, monkeypatch):
    """SmolLM2 (30 layers, 2 dense): a ~700-token prompt over 44 blocks, offloaded with a budget covering it
    all, decodes exactly as dense (tokens; logits within 1e-5 of their scale) while recalling from the host."""
    from pulseinfer_jax.demo import passkey_prompt

    seen = record_sampled_logits(monkeypatch)
    prompt = passkey_prompt(smollm2.tokenizer, 700, 0.3, 52817)
    kw = dict(max_new_tokens=12, ignore_eos=True)
    dense = generate_long([prompt], smollm2, **kw)[0]
    dense_logits = dict(seen)
    seen.clear()
    off = generate_long([prompt], smollm2, **kw, mode="offload", budget_tokens=2048)[0]
    assert off.token_ids == dense.token_ids
    scale = max(float(np.max(np.abs(v))) for v in dense_logits.values())
    worst = max(float(np.max(np.abs(seen[k] - dense_logits[k]))) for k in dense_logits)
    assert worst <= 1e-5 * scale, (worst, scale)
    s = off.stats
    assert s["offloaded"] and s["prompt_tokens"] > 640 and s["recalled_blocks"] >= 28 * 30
    assert s["reused_blocks"] > s["recalled_blocks"]  # later steps reuse the slot cache
