"""The recall-ahead decode step as one program (runner/sparse_step.py): what a step dispatches and reads back, and
sampling inside it."""

import numpy as np
from pulseinfer_jax.host_offload.host_pool import HostKVPool

from pulseinfer_jax import Engine, EngineConfig, SamplingParams, generate_long
from pulseinfer_jax.runner import sampling, sparse_layer, sparse_step

BASE = dict(block_size=4, max_batch=4, prefill_chunk=32, key_chunk=32, window_tokens=8, sink_blocks=1)


def _prompts(vocab, lengths=(61, 38, 47), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def test_a_step_is_one_program_one_plan_read_and_one_recall(tiny4, monkeypatch):
    """Every recall-ahead step (all but a request's first, which recalls in the layer) dispatches the step program
    once and no per-layer call, sampling included; its misses of every layer go up in one recall (at most one copy
    a step), landed by one program just before the next step's."""
    calls: dict[str, int] = {}
    order: list[str] = []

    def counting(owner, name):
        real = getattr(owner, name)

        def call(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            order.append(name)
            return real(*a, **k)
        monkeypatch.setattr(owner, name, call)

    for name in ("ahead_layer", "dense_layer", "embed", "logits", "sparse_pre"):
        counting(sparse_layer, name)
    counting(sparse_step, "ahead_step")
    counting(sparse_step, "land_step")
    counting(HostKVPool, "recall_step")
    eng = Engine(tiny4, EngineConfig.of(**BASE, mode="offload", budget_tokens=24, dense_layers=2))
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    reqs = [eng.make_request(i, p, sp) for i, p in enumerate(_prompts(tiny4.cfg.vocab_size, lengths=(61, 45)))]
    eng.ensure_pool(reqs)
    for r in reqs:
        eng.submit(r)
    steps = landed = 0
    while eng.busy:
        first = any(r.sparse is not None and r.sparse.slot_fresh for r in eng.scheduler.running)
        before, seen = dict(calls), len(order)
        list(eng.step())
        new = {k: v - before.get(k, 0) for k, v in calls.items() if v != before.get(k, 0)}
        if not first and "ahead_step" in new:
            steps += 1
            assert new["ahead_step"] == 1 and set(new) <= {"ahead_step", "recall_step", "land_step"}, new
            # (land_step after the step: `land_pending`, before a finished request's blocks are freed)
            before_step = order[seen:order.index("ahead_step", seen)]
            assert new.get("recall_step", 0) <= 1 and before_step.count("land_step") <= 1, order[seen:]
            landed += before_step.count("land_step")
    ahead = [e for e in eng.sparse.step_log if "late_recalls" in e]
    assert steps >= 8 and len(ahead) == steps and landed > 0
    assert all(e["h2d_copies"] <= 1 for e in ahead) and sum(e["h2d_copies"] for e in ahead) > 0
    assert all(len(r.output) == 12 for r in reqs)


def test_sampling_inside_the_step_draws_what_the_dense_step_draws(tiny4):
    """Temperature, top-k and top-p sampling with seeds: a budget covering the context gives the offloaded requests
    (sampled inside the step program) the tokens the dense engine samples from its logits, per request and seed."""
    prompts = _prompts(tiny4.cfg.vocab_size)
    kw = dict(max_new_tokens=16, ignore_eos=True, temperature=0.9, top_k=20, top_p=0.95, seed=3)
    dense = generate_long(prompts, tiny4, engine_config=EngineConfig.of(**BASE), **kw)
    off = generate_long(prompts, tiny4, engine_config=EngineConfig.of(**BASE, mode="offload", budget_tokens=512,
                                                                      dense_layers=2), **kw)
    assert all(r.stats["offloaded"] for r in off)
    assert [r.token_ids for r in off] == [r.token_ids for r in dense]
    greedy = generate_long(prompts, tiny4, max_new_tokens=16, ignore_eos=True, engine_config=EngineConfig.of(**BASE))
    assert [r.token_ids for r in dense] != [r.token_ids for r in greedy]  # (it did sample)


def test_all_greedy_batches_send_no_sampling_inputs():
    assert sampling.BatchSampling((SamplingParams(),) * 3, (0, 1, 2), (0, 0, 0), 0).rows([0, 1, 2], 4) is None
