"""Layer-segmented prefill of offloaded prompts (runner/offloaded_prefill.py): the KV it streams to the host is
what dense prefill writes, the GPU holds one layer of the prompt at a time, and decoding goes on while it runs."""

import jax.numpy as jnp
import numpy as np
import pytest

from pulseinfer_jax import Engine, EngineConfig, SamplingParams, generate_long
from pulseinfer_jax.kv.blocks import blocks_for
from pulseinfer_jax.request import Status

BASE = dict(block_size=4, max_batch=4, prefill_chunk=32, key_chunk=32, window_tokens=8, sink_blocks=1)
OFFLOAD = dict(mode="offload", budget_tokens=24, dense_layers=2)


def _prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def _start(model, config: EngineConfig, prompts: list[list[int]], new: int = 4):
    eng = Engine(model, config)
    reqs = [eng.make_request(i, p, SamplingParams(max_new_tokens=new, ignore_eos=True)) for i, p in enumerate(prompts)]
    eng.ensure_pool(reqs)
    for r in reqs:
        eng.scheduler.add(r)
    return eng, reqs


def _until_first_token(eng, req) -> None:
    while not req.output:
        list(eng.step())


@pytest.mark.parametrize("loop,exact", [("layerwise", True), ("scan", False)])
@pytest.mark.parametrize("tokens", [61, 64])  # a partial last block, and whole blocks only
def test_offloaded_prefill_writes_what_dense_prefill_writes(tiny4, loop, exact, tokens):
    """Every layer of the prompt's KV, where the offloaded request keeps it (host rows of the sparse layers, resident
    blocks, dense-layer packs), equals the dense request's blocks: bit for bit against the layer-wise dense prefill
    (the same layer code with other addresses), within f32 rounding against a scan engine's (one program for all
    layers). The first token is the same."""
    prompt = _prompt(tiny4.cfg.vocab_size, tokens)
    cfg = dict(**BASE, layer_loop=loop)
    dense, (rd,) = _start(tiny4, EngineConfig.of(**cfg), [prompt])
    off, (ro,) = _start(tiny4, EngineConfig.of(**cfg, **OFFLOAD), [prompt])
    _until_first_token(dense, rd)
    _until_first_token(off, ro)
    assert ro.placement == "offload" and rd.output[0] == ro.output[0]
    bs, nl, d = 4, tiny4.cfg.num_layers, OFFLOAD["dense_layers"]
    n = blocks_for(tokens, bs)
    valid = [min(bs, tokens - j * bs) for j in range(n)]  # prompt tokens per block (the decode writes after them)
    kv_d, kv_o = np.asarray(dense.kv), np.asarray(off.kv)
    flat_o = kv_o.reshape(-1, *kv_o.shape[2:])
    host = off.host_pool.contents()
    s, nb = ro.sparse, off.sparse.nb
    compare = np.testing.assert_array_equal if exact else (
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5))
    for j in range(n):
        want = kv_d[:, rd.blocks[j], :, : valid[j]]  # [L, 2, t, Hkv, hd]
        for layer in range(nl):
            if layer < d:
                got = flat_o[s.dense_unit(j, layer, nb), :, : valid[j]]
            else:
                got = host[layer - d, s.host_rows[j], :, : valid[j]]
            compare(got, want[layer])
            if s.is_resident(j) and layer >= d:  # (a dense layer reads its packs only)
                compare(kv_o[layer, s.gpu_of[j], :, : valid[j]], want[layer])


def test_offloaded_prefill_holds_one_layer_of_the_prompt(tiny4):
    """The GPU blocks an offloaded prompt's prefill takes beyond the request's steady footprint are one layer of the
    prompt (its slot blocks' layer slices, plus the scratch blocks they lack), given back when the prefill ends; it
    writes nowhere else in the pool (every other block stays NaN), and nothing NaN reaches the tokens."""
    prompt = _prompt(tiny4.cfg.vocab_size, 121)  # 31 blocks
    cfg = EngineConfig.of(**BASE, **OFFLOAD, slot_cache_blocks=3,  # 3 slot blocks x 4 layers < 31 units
                          kv_cache_tokens=4 * 64)  # blocks no request owns
    eng, (req,) = _start(tiny4, cfg, [prompt], new=6)
    plan = eng.sparse.plan
    steady, n = plan.gpu_blocks(req.need_tokens), blocks_for(len(prompt), 4)
    scratch = plan.scratch_blocks(len(prompt), req.need_tokens)
    assert scratch == -(-(n - 3 * plan.num_layers) // plan.num_layers) == 5
    assert steady + scratch < blocks_for(req.need_tokens, 4)  # less than the dense request's KV
    eng.kv = jnp.full_like(eng.kv, jnp.nan)
    list(eng.step())  # admission: the blocks are reserved
    owned = set(eng.allocator.owned_by(req.index))
    assert len(owned) == steady + scratch
    while req.status is Status.PREFILLING:
        list(eng.step())
    assert eng.allocator.peak_used == steady + scratch and eng.allocator.num_used == steady
    others = sorted(set(range(1, eng.spec.num_blocks)) - owned)
    assert others and np.isnan(np.asarray(eng.kv)[:, others]).all()
    while req.status is not Status.FINISHED:
        list(eng.step())
    clean = Engine(tiny4, cfg)
    clean_req = clean.make_request(0, prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
    list(clean.run([clean_req]))
    assert req.output == clean_req.output
    eng.allocator.check_integrity()


def test_running_requests_decode_while_a_long_prompt_prefills(tiny4):
    """A long offloaded prompt prefills over many engine steps, one dense chunk's worth of work each, and the request
    already running gains a token at every one of them."""
    cfg = EngineConfig.of(**{**BASE, "prefill_chunk": 8}, **OFFLOAD)
    eng, (short, long_) = _start(tiny4, cfg, [_prompt(tiny4.cfg.vocab_size, 9), _prompt(tiny4.cfg.vocab_size, 121)],
                                 new=40)
    while short.status is not Status.RUNNING:
        list(eng.step())
    steps = 0
    while long_.status is Status.PREFILLING:
        before = len(short.output)
        list(eng.step())
        assert len(short.output) == before + 1
        steps += 1
    n_chunks = -(-121 // 8)
    assert steps == n_chunks  # num_layers pieces per step: n_chunks * num_layers pieces in all
    while eng.scheduler.has_work():
        list(eng.step())
    assert len(long_.output) == 40


def test_offloaded_prefill_fits_where_the_prompt_does_not(tiny4):
    """A GPU KV budget that holds half the request's dense KV (one layer of this 4-layer model is a quarter of it):
    dense refuses the request, offloaded it runs, and auto runs it offloaded, within the budget."""
    prompt = _prompt(tiny4.cfg.vocab_size, 241)  # 61 blocks
    c = tiny4.cfg
    per_block = c.num_layers * 2 * c.num_kv_heads * 4 * c.head_dim * 4
    budget = (blocks_for(241 + 8, 4) // 2) * per_block
    base = dict(**BASE, gpu_kv_budget=budget, slot_cache_blocks=3)
    with pytest.raises(ValueError, match="GPU KV pool holds"):
        generate_long([prompt], tiny4, max_new_tokens=8, engine_config=EngineConfig.of(**base))
    for mode in ("offload", "auto"):
        eng, (req,) = _start(tiny4, EngineConfig.of(**base, **{**OFFLOAD, "mode": mode, "dense_layers": 0}), [prompt],
                             new=8)
        while eng.scheduler.has_work():
            list(eng.step())
        assert req.placement == "offload" and len(req.output) == 8
        assert eng.allocator.peak_used <= eng.allocator.capacity
        assert eng.spec.total_bytes + eng.sparse.metadata_bytes <= budget
