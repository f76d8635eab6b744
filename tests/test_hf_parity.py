"""Logit and greedy parity with Hugging Face transformers on tiny seeded checkpoints of every family.

Goldens come from tests/goldens/make_goldens.py (transformers + torch, Python 3.11); when torch is
importable here the same references are also recomputed live.
"""

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, TINY_FAMILIES
from pulseinfer_jax.models.loading import load_model

from pulseinfer_jax import generate_long
from pulseinfer_jax.kv.cache import CacheSpec
from pulseinfer_jax.runner.dense import decode_step, prefill_step

ATOL = 1e-4


def _golden(name):
    g = np.load(TINY / name / "golden.npz")
    n = len([k for k in g if k.startswith("prompt_")])
    return [(g[f"prompt_{i}"].tolist(), g[f"logits_{i}"], g[f"greedy_{i}"].tolist()) for i in range(n)]


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def family(request):
    return request.param, load_model(TINY / request.param), _golden(request.param)


def test_full_forward_logits(family):
    name, m, gold = family
    for prompt, logits, _ in gold:
        ours = np.asarray(m.transformer.forward(m.params, jnp.asarray([prompt], jnp.int32))[0])
        assert np.abs(ours - logits).max() <= ATOL, name


def paged_logits(m, prompt, kv_dtype=jnp.float32, block_size=16, chunk=16):
    """Prefill the first half of `prompt` in chunks through a paged cache of `kv_dtype` (shuffled blocks), then decode
    the rest token by token: (half, logits [n - half + 1, V] of positions half - 1 .. n - 1)."""
    c = m.cfg
    kv = CacheSpec(c.num_layers, 40, c.num_kv_heads, block_size, c.head_dim, kv_dtype).allocate()
    n = len(prompt)
    nblk = -(-n // block_size)
    table = np.zeros(16, np.int32)
    table[:nblk] = np.random.default_rng(n).permutation(np.arange(1, 40))[:nblk]  # shuffled blocks
    half = max(1, n // 2)
    for start in range(0, half, chunk):
        k = min(chunk, half - start)
        toks = np.zeros(chunk, np.int32)
        toks[:k] = prompt[start:start + k]
        kv, last = prefill_step(m.transformer, m.params, kv, jnp.asarray(toks), jnp.int32(start), jnp.int32(k),
                                jnp.asarray(table), key_chunk=chunk)
    out = [np.asarray(last)]
    for pos in range(half, n):
        kv, lg = decode_step(m.transformer, m.params, kv, jnp.asarray([prompt[pos]], jnp.int32),
                             jnp.asarray([pos], jnp.int32), jnp.asarray(table[None]))
        out.append(np.asarray(lg[0]))
    return half, np.stack(out)


@pytest.mark.parametrize("block_size,chunk", [(4, 8), (16, 16)])
def test_paged_prefill_then_decode_logits(family, block_size, chunk):
    """Prefill the first half through the paged cache in chunks, then decode the rest token by token."""
    name, m, gold = family
    for prompt, logits, _ in gold:
        half, got = paged_logits(m, prompt, block_size=block_size, chunk=chunk)
        assert np.abs(got[0] - logits[half - 1]).max() <= ATOL, name
        for pos, lg in zip(range(half, len(prompt)), got[1:], strict=True):
            assert np.abs(lg - logits[pos]).max() <= ATOL, (name, pos)


@pytest.mark.parametrize("block_size,batched", [(4, True), (16, True), (16, False)])
def test_greedy_32_tokens(family, block_size, batched):
    name, m, gold = family
    prompts = [p for p, _, _ in gold]
    want = [g for _, _, g in gold]
    if batched:  # all prompt lengths decode together through continuous batching
        res = generate_long(prompts, m, max_new_tokens=32, ignore_eos=True, block_size=block_size, prefill_chunk=16)
    else:
        res = [generate_long([p], m, max_new_tokens=32, ignore_eos=True, block_size=block_size,
                             prefill_chunk=16)[0] for p in prompts]
    for r, w in zip(res, want, strict=True):
        assert r.token_ids == w, name
        assert r.finish_reason == "length"


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed: goldens only")
def test_live_against_transformers(family):
    import sys

    sys.path.insert(0, str(TINY.parent))
    from make_goldens import reference_logits

    name, m, gold = family
    prompts = [p for p, _, _ in gold]
    ref = reference_logits(TINY / name, prompts)
    for (_, logits, _), live in zip(gold, ref, strict=True):
        assert np.abs(np.asarray(live) - logits).max() <= ATOL
