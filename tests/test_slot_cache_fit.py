"""A tight GPU KV budget shrinks the offloaded requests' slot cache, down to one step's selection, before it refuses."""

import numpy as np
import pytest
from conftest import TINY, doubled
from pulseinfer_jax.models.config import ModelConfig
from pulseinfer_jax.models.presets import PRESETS

from pulseinfer_jax import Engine, EngineConfig, SamplingParams, generate_long
from pulseinfer_jax.request import Request
from pulseinfer_jax.sched.pools import offload_blocks, pool_sizes

BASE = dict(mode="offload", block_size=4, window_tokens=8, budget_tokens=64, dense_layers=0, prefill_chunk=32,
            key_chunk=32, progress=False)  # one step selects 13 middle blocks; the default slot cache is 26


@pytest.fixture(scope="module")
def tiny4():
    from pulseinfer_jax.models.loading import load_model

    return doubled(load_model(TINY / "llama31"), "tiny4")


def _block_bytes(c):
    return c.num_layers * 2 * c.num_kv_heads * 4 * c.head_dim * 4


def test_the_slot_cache_shrinks_to_what_the_budget_holds(tiny4):
    prompt = np.random.default_rng(0).integers(3, tiny4.cfg.vocab_size, 241).tolist()  # 61 blocks
    budget = 26 * _block_bytes(tiny4.cfg)  # the default slot cache needs 30 blocks offloaded, 17 slots fit
    eng = Engine(tiny4, EngineConfig.of(**BASE, gpu_kv_budget=budget))
    (res,) = generate_long([prompt], eng, max_new_tokens=8, ignore_eos=True)
    assert eng.sparse.plan.slot_blocks == 17 and res.stats["slot_cache_blocks_effective"] == 17
    # the same tokens as the slot cache set to that size by hand
    (want,) = generate_long([prompt], tiny4, max_new_tokens=8, ignore_eos=True,
                            engine_config=EngineConfig.of(**BASE, gpu_kv_budget=budget, slot_cache_blocks=17))
    assert res.token_ids == want.token_ids
    # set by hand, it is what it is: refused
    with pytest.raises(ValueError, match="needs 30 GPU blocks .* or slot_cache_blocks"):
        generate_long([prompt], tiny4, max_new_tokens=8, engine_config=EngineConfig.of(
            **BASE, gpu_kv_budget=budget, slot_cache_blocks=26))


def test_a_refusal_comes_only_when_one_steps_selection_does_not_fit(tiny4):
    prompt = np.random.default_rng(0).integers(3, tiny4.cfg.vocab_size, 241).tolist()
    with pytest.raises(ValueError, match=r"needs 20 GPU blocks \(of 19, with the smallest slot cache"):
        generate_long([prompt], tiny4, max_new_tokens=8,
                      engine_config=EngineConfig.of(**BASE, gpu_kv_budget=24 * _block_bytes(tiny4.cfg)))


def test_a_long_passkey_prompt_under_a_quarter_of_its_dense_kv():
    """SmolLM2, a 6,787-token prompt, mode offload with budget_tokens=1024 under a GPU KV budget of a quarter of its
    dense KV (bfloat16): the default slot cache (2 x 59 blocks) does not fit, a smaller one does."""
    cfg = ModelConfig.from_hf_dict(PRESETS["smollm2-135m"], name="smollm2-135m")
    req = Request(0, [5] * 6787, SamplingParams(), 128)
    dense = -(-req.need_tokens // 16) * cfg.num_layers * 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 2
    config = EngineConfig.of(mode="offload", budget_tokens=1024, gpu_kv_budget=dense // 4)
    sizes = pool_sizes(config, cfg, "bfloat16", 1, [req], dense // 4)
    assert config.slot_blocks == 118 and sizes.plan.middle_blocks <= sizes.plan.slot_blocks < 118
    assert offload_blocks(sizes.plan, req) <= sizes.num_blocks - 1
