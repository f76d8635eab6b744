"""Bad arguments are refused before the model loads (API and CLI), token ids once the model is known and before an
engine exists; a sparse budget past the requests' context is cut to it (same tokens as dense, tables sized by the
context)."""

from __future__ import annotations

import pytest
from conftest import TINY
from pulseinfer_jax.models.loading import load_model

from pulseinfer_jax import Engine, EngineConfig, generate_long, stream_long
from pulseinfer_jax.cli import main

NOWHERE = "/nonexistent/model"  # loading it raises FileNotFoundError: a ValueError here means it was never tried


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY / "llama2")  # 2 layers, 320 tokens, 512 positions


@pytest.mark.parametrize("prompts,match", [
    ([[]], "prompt 0 is empty"),
    ([[1, -2, 3]], r"negative token ids \[-2\]"),
    ([[1, True]], "got True"),
    ([[1, 2.0]], "got 2.0"),
    ([[1, 2], [3, "4"]], "prompt 1"),
])
def test_bad_token_id_prompts_before_loading(prompts, match):
    with pytest.raises(ValueError, match=match):
        generate_long(prompts, NOWHERE)


@pytest.mark.parametrize("kw,match", [
    ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ({"max_new_tokens": 2.5}, "max_new_tokens=2.5"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"top_p": 1.5}, "top_p=1.5"),
    ({"top_k": -1}, "top_k=-1"),
    ({"seed": 2**32}, "seed="),
    ({"stop": 5}, "stop=5"),
    ({"stop": [""]}, "non-empty strings"),
    ({"chat": "yes"}, "chat='yes'"),
    ({"dtype": "float64"}, "dtype='float64' is not supported"),
    ({"budget_tokens": 0}, "budget_tokens=0"),
])
def test_bad_options_before_loading(kw, match):
    with pytest.raises(ValueError, match=match):
        generate_long([[1, 2]], NOWHERE, **kw)


def test_stream_long_refuses_at_the_call():
    """No iteration needed: the error comes from the call, before any model is looked at."""
    with pytest.raises(ValueError, match="top_p"):
        stream_long([[1, 2]], NOWHERE, top_p=0)
    with pytest.raises(ValueError, match="empty"):
        stream_long([[]], NOWHERE)


class _NoEngine(Engine):
    def __init__(self, *args, **kwargs):
        raise AssertionError("an engine was built before the prompts were checked against the model")


@pytest.mark.parametrize("prompts,match", [
    ([[1, 2, 320]], r"outside \[0, 320\) \(the model's vocabulary\): \[320\]"),
    ([[5] * 512], "512 tokens but the model handles at most 512 positions"),
])
def test_token_ids_checked_against_the_model_before_an_engine(tiny, monkeypatch, prompts, match):
    monkeypatch.setattr("pulseinfer_jax.api.Engine", _NoEngine)
    with pytest.raises(ValueError, match=match):
        generate_long(prompts, tiny)
    with pytest.raises(ValueError, match=match):  # the same for a model loaded here
        generate_long(prompts, str(TINY / "llama2"))


@pytest.mark.parametrize("flag,value,match", [
    ("--temperature", "-1", "temperature=-1.0 must be a finite number >= 0"),
    ("--temperature", "nan", "temperature=nan"),
    ("--top-p", "0", "top_p=0.0 must be in (0, 1]"),
    ("--top-k", "-3", "top_k=-3"),
    ("--max-new-tokens", "0", "max_new_tokens=0"),
    ("--seed", "-1", "seed=-1"),
    ("--stop", "", "stop=('',)"),
])
def test_cli_sampling_flags_before_loading(capsys, flag, value, match):
    assert main(["generate", "--model", NOWHERE, flag, value, "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"pulseinfer: error: argument {flag}: {err[0].split(': ', 3)[-1]}"]
    assert match in err[0] and "does not exist" not in err[0] and "see pulseinfer generate --help" in err[0]


def test_budget_for_context():
    bs = 16
    c = EngineConfig.of(mode="offload", budget_tokens=100_000, block_size=bs)  # window 64, 1 sink block
    cut = c.for_context(2008)
    assert cut.offload.budget_tokens == 126 * bs and cut.budget_blocks == 126
    assert cut.slot_blocks == 2 * (126 - 1 - 4)  # the default slot cache follows the budget
    assert c.for_context(10).offload.budget_tokens == (1 + 4 + 1) * bs  # never below the smallest budget allowed
    small = EngineConfig.of(mode="offload", budget_tokens=1000)
    assert small.for_context(2008) is small  # a budget under the context is kept (not even rounded)
    assert EngineConfig.of(budget_tokens=100_000).for_context(100).offload.budget_tokens == 100_000  # dense: unused
    slots = EngineConfig.of(mode="auto", budget_tokens=512, slot_cache_blocks=10_000).for_context(4000)
    assert slots.offload.budget_tokens == 512 and slots.offload.slot_cache_blocks == 250 - 1 - 4


def test_a_budget_past_the_context_runs_as_dense(tiny):
    prompt = [(7 * i) % 300 + 3 for i in range(200)]  # 200 + 6 tokens: 13 blocks of 16
    dense = generate_long([prompt], tiny, max_new_tokens=6, ignore_eos=True)[0]
    kw = dict(mode="offload", dense_layers=1, max_new_tokens=6, ignore_eos=True)
    big = generate_long([prompt], tiny, budget_tokens=100_000, **kw)[0]
    assert big.stats["mode"] == "offload" and big.stats["offloaded"] is True
    assert big.stats["budget_tokens"] == 100_000 and big.stats["budget_tokens_effective"] == 13 * 16
    assert big.token_ids == dense.token_ids
    under = generate_long([prompt], tiny, budget_tokens=128, **kw)[0]  # a budget under the context is kept
    assert under.stats["budget_tokens"] == under.stats["budget_tokens_effective"] == 128
