"""Calibration pass for SoloHead `retrieval_head`: which KV head's own selection best serves every head.

    heads = calibrate_retrieval_heads(model, prompt_ids, config)   # one KV head per sparse layer
    EngineConfig.of(..., solohead="retrieval_head", retrieval_heads=heads)

One dense forward over the calibration prompt captures, per layer, the queries of its last `queries`
positions and every key; `policy.block_attention_mass` turns them into the true attention mass per block and
`policy.calibrate_retrieval_head` picks, per layer, the KV head whose top-k selection (same budget, sinks
and window as at run time) covers the most mass of all heads. The forward attends with full O(T^2) scores
per layer, so keep calibration prompts to a few thousand tokens, and several times longer than the budget
(a prompt inside the budget is rejected: every head would cover all of it; measured: calibrating a 2,048-token
budget on a 2,048-token prompt picked head 0 everywhere and lost passkeys).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from pulseinfer_jax.config import EngineConfig
from pulseinfer_jax.models.loading import LoadedModel
from pulseinfer_jax.selection.policy import block_attention_mass, calibrate_retrieval_head

MAX_CALIBRATION_TOKENS = 8192


def capture_queries_and_keys(model: LoadedModel, tokens: Sequence[int], queries: int
                             ) -> tuple[Float[Array, "L P Hq hd"], Float[Array, "L T Hkv hd"]]:
    """Post-RoPE queries of the last `queries` positions and all keys of every layer (float32)."""
    c = model.cfg
    t = len(tokens)
    p = min(queries, t)
    tok = jnp.asarray(np.asarray(tokens, np.int32))[None]

    def run(params, tok):
        tr = model.transformer
        positions = jnp.arange(t, dtype=jnp.int32)[None]

        def attend(layer, q, k, v, st):
            qs, ks = st
            qs = qs.at[layer].set(q[0, t - p:].astype(jnp.float32))
            ks = ks.at[layer].set(k[0].astype(jnp.float32))
            return tr.causal_attention(q, k, v), (qs, ks)

        init = (jnp.zeros((c.num_layers, p, c.num_heads, c.head_dim), jnp.float32),
                jnp.zeros((c.num_layers, t, c.num_kv_heads, c.head_dim), jnp.float32))
        _, st = tr.layers(params, tr.embed(params, tok), positions, attend, init)
        return st

    return jax.jit(run)(model.params, tok)


def calibrate_retrieval_heads(model: LoadedModel, tokens: Sequence[int], config: EngineConfig, *,
                              queries: int = 16) -> tuple[int, ...]:
    """The retrieval KV head of every sparse layer (layers dense_layers..L-1) for `config`'s block size,
    budget, sinks and window, calibrated on `tokens` (its last `queries` positions are the queries)."""
    t = len(tokens)
    if t < 2 * config.block_size:
        raise ValueError(f"a {t}-token calibration prompt is too short; give at least {2 * config.block_size}")
    if t > MAX_CALIBRATION_TOKENS:
        raise ValueError(f"calibration prompt has {t} tokens; the pass is O(T^2), keep it <= "
                         f"{MAX_CALIBRATION_TOKENS}")
    if -(-t // config.block_size) <= config.budget_blocks:
        raise ValueError(f"a {t}-token calibration prompt fits in the {config.offload.budget_tokens}-token budget, so "
                         "every head's selection covers all of it and no head can be told apart; calibrate on a prompt "
                         "several times longer than the budget")
    c = model.cfg
    if not 0 <= config.offload.dense_layers < c.num_layers:
        raise ValueError(f"dense_layers={config.offload.dense_layers} leaves no sparse layer in {c.num_layers} layers")
    qs, ks = capture_queries_and_keys(model, tokens, queries)
    p = qs.shape[1]
    positions = jnp.arange(t - p, t)
    heads = []
    for layer in range(config.offload.dense_layers, c.num_layers):
        mass = block_attention_mass(qs[layer], ks[layer], config.block_size, q_positions=positions)
        heads.append(calibrate_retrieval_head(mass, config.budget_blocks, config.offload.sink_blocks,
                                              config.window_blocks, c.group_size))
    return tuple(heads)
