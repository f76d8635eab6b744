"""KV allocated as requests grow, and preemption when the GPU pool runs out: through host memory (bit for bit), or by
recomputation when the host has no room."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY

from pulseinfer_jax import Engine, EngineConfig, generate_long
from pulseinfer_jax.kv.blocks import BlockAllocator
from pulseinfer_jax.request import Request, SamplingParams, Status
from pulseinfer_jax.sched.scheduler import Scheduler


class FakeMover:
    """Swap space of `room` blocks that records what it holds (the scheduler's KVMover, without a cache)."""

    def __init__(self, room: int):
        self.room, self.held = room, {}

    def swap_out(self, req):
        if sum(self.held.values()) + len(req.blocks) > self.room:
            return False
        self.held[req.index] = len(req.blocks)
        return True

    def swap_in(self, req, blocks):
        assert len(blocks) == self.held.pop(req.index)

    def drop(self, req):
        self.held.pop(req.index, None)


def _req(i, prompt_len, max_new=64):
    return Request(i, list(range(prompt_len)), SamplingParams(max_new_tokens=max_new), max_new)


def _decode(s, reqs, steps=1):
    """`steps` decode steps of the running requests, as the engine makes them: blocks first, then one token each."""
    for _ in range(steps):
        s.reserve_decode()
        s.admit()
        for r in list(s.prefilling):
            s.prefill_done(r)
            r.output.append(1)
        for r in s.running:
            assert len(r.blocks) * s.block_size >= r.seq_len  # the token written this step has its block
            r.output.append(1)


def test_admission_takes_the_prompt_blocks_and_decode_grows_them():
    alloc = BlockAllocator(1 + 20)
    s = Scheduler(alloc, block_size=4, max_batch=8, mover=FakeMover(100), watermark=0)
    r = _req(0, 6)  # 6 prompt tokens + the first generated one: 2 blocks, not 18 (prompt + max_new_tokens)
    s.add(r)
    assert s.admit() == [r] and len(r.blocks) == 2
    s.prefill_done(r)
    r.output.append(1)  # the first token (seq_len 7: its KV goes to position 6, block 1)
    for seq_len in range(7, 20):
        s.reserve_decode()
        assert len(r.blocks) == -(-seq_len // 4)
        r.output.append(1)
    alloc.check_integrity()


def test_the_youngest_is_preempted_and_resumes_first_when_blocks_free():
    alloc = BlockAllocator(1 + 6)
    mover = FakeMover(100)
    s = Scheduler(alloc, block_size=4, max_batch=8, mover=mover, watermark=0)
    reqs = [_req(0, 7), _req(1, 7), _req(2, 3)]  # 2, 2, 1 blocks at admission
    for r in reqs:
        s.add(r)
    _decode(s, reqs)  # prompts in, first tokens
    assert alloc.num_free == 1
    _decode(s, reqs, steps=2)  # requests 0 and 1 cross into their third block: 2 is preempted for them
    assert reqs[2].status is Status.PREEMPTED and s.waiting[0] is reqs[2] and reqs[2].blocks == []
    assert s.preempted_swap >= 1 and s.preempted_recompute == 0 and 2 in mover.held
    s.add(_req(3, 1))  # a new request waits behind the preempted one
    s.finish(reqs[0], "length")
    s.reserve_decode()
    back = s.admit()
    assert back[0] is reqs[2] and reqs[2].status is Status.RUNNING and 2 not in mover.held
    assert len(reqs[2].blocks) * 4 >= reqs[2].seq_len
    alloc.check_integrity()


def test_without_host_room_the_preempted_request_is_recomputed():
    alloc = BlockAllocator(1 + 4)
    s = Scheduler(alloc, block_size=4, max_batch=8, mover=FakeMover(0), watermark=0)
    a, b = _req(0, 7), _req(1, 7)
    s.add(a)
    s.add(b)
    _decode(s, [a, b], steps=2)  # both need a third block: b (the younger) gives its blocks up
    assert b.status is Status.PREEMPTED and b.recompute and b.prefilled == 0 and s.preempted_recompute == 1
    s.finish(a, "stop")
    (back,) = s.admit()
    assert back is b and b.status is Status.PREFILLING
    assert b.context == b.prompt + b.output[:-1]  # its prefill writes what it had, the pending token aside
    assert len(b.blocks) * 4 >= len(b.context) + 1


def test_admission_leaves_the_watermark_for_growth_and_a_preempted_request_ends_cleanly():
    alloc = BlockAllocator(1 + 5)
    mover = FakeMover(100)
    s = Scheduler(alloc, block_size=4, max_batch=8, mover=mover, watermark=2)
    a, b = _req(0, 7), _req(1, 7)
    s.add(a)
    assert s.admit() == [a]
    s.prefill_done(a)
    a.output.append(1)
    s.add(b)
    assert s.admit() == []  # 3 free, 2 kept for a's growth: b's 2 blocks wait
    s.preempt(a)
    assert a in s.waiting and mover.held == {0: 2}
    s.finish(a, "abort")  # cancelled while swapped out: its host copy goes too
    assert mover.held == {} and a.status is Status.FINISHED and alloc.num_free == alloc.capacity


def test_a_dense_request_is_capped_at_what_the_pool_holds():
    alloc = BlockAllocator(1 + 10)
    s = Scheduler(alloc, block_size=4, max_batch=8)
    r = _req(0, 10, max_new=1 << 20)  # a chat without max_tokens: it runs to what the whole pool holds
    s.add(r)
    s.admit()
    assert r.max_new_tokens == 10 * 4 - 10


@pytest.fixture(scope="module")
def tiny():
    from pulseinfer_jax.models.loading import load_model

    return load_model(TINY / "llama31")


@pytest.mark.parametrize("kv_dtype", ["auto", "float8_e4m3fn"])
def test_preempted_dense_requests_give_the_unpreempted_tokens_bit_for_bit(tiny, kv_dtype):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, tiny.cfg.vocab_size, int(k)).tolist() for k in (20, 35, 12, 50)]
    kw = dict(max_new_tokens=40, ignore_eos=True)
    alone = generate_long(prompts, tiny, block_size=8, kv_dtype=kv_dtype, **kw)
    # a pool of 20 blocks where the four need 37 at their longest: the youngest running ones go to host memory
    eng = Engine(tiny, EngineConfig.of(block_size=8, kv_cache_tokens=160, kv_dtype=kv_dtype))
    res = generate_long(prompts, eng, engine_config=eng.config, **kw)
    assert eng.scheduler.preempted_swap > 0 and eng.scheduler.preempted_recompute == 0
    assert [r.token_ids for r in res] == [r.token_ids for r in alone]
    assert sum(r.stats["preemptions"] for r in res) == eng.scheduler.preemptions
    assert eng.swap.swapped_in == eng.swap.swapped_out and eng.swap.used_blocks == 0  # (run() checked it drained)
    from pulseinfer_jax.serving.metrics import ServerMetrics

    metrics = ServerMetrics()
    metrics.pools(eng)
    metrics.state(eng)
    text = metrics.render().decode()
    assert f'pulseinfer_preemptions_total{{kind="swap"}} {float(eng.scheduler.preempted_swap)}' in text
    assert "pulseinfer_swap_kv_blocks_used 0.0" in text


def test_without_swap_space_preempted_requests_recompute_and_finish(tiny):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, tiny.cfg.vocab_size, int(k)).tolist() for k in (20, 35, 12, 50)]
    eng = Engine(tiny, EngineConfig.of(block_size=8, kv_cache_tokens=160, swap_kv_tokens=0))
    res = generate_long(prompts, eng, engine_config=eng.config, max_new_tokens=40, ignore_eos=True)
    assert eng.scheduler.preempted_recompute > 0 and eng.scheduler.preempted_swap == 0
    assert [len(r.token_ids) for r in res] == [40] * 4 and all(r.finish_reason == "length" for r in res)


def test_the_documented_serve_command_admits_a_prompt_of_the_models_positions_minus_one():
    """docs/serving.md's `pulseinfer serve --gpu-kv-budget 600000000` (SmolLM2 in float32): a chat without max_tokens
    and a prompt of 8,191 tokens are admitted, their KV allocated as they grow."""
    import re

    from pulseinfer_jax.models.config import ModelConfig
    from pulseinfer_jax.models.presets import PRESETS

    from pulseinfer_jax.sched.pools import pool_sizes

    budget = int(re.search(r"pulseinfer serve .*--gpu-kv-budget (\d+)", (TINY.parents[2] / "docs" / "serving.md")
                           .read_text()).group(1))
    cfg = ModelConfig.from_hf_dict(PRESETS["smollm2-135m"], name="smollm2-135m")
    config = EngineConfig.of(gpu_kv_budget=budget)
    sizes = pool_sizes(config, cfg, np.float32, 1, None, budget)
    s = Scheduler(BlockAllocator(sizes.num_blocks), config.block_size, config.max_batch)
    n = cfg.max_position_embeddings
    r = Request(0, [5] * (n - 1), SamplingParams(max_new_tokens=1 << 30), 1)  # (make_request caps it at the positions)
    s.add(r)
    assert s.admit() == [r] and len(r.blocks) == n // config.block_size


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.uint8])
def test_swap_space_moves_a_request_in_chunks_bit_for_bit(monkeypatch, dtype):
    """A request longer than a chunk leaves and lands in several programs (`swap.CHUNK_BLOCKS` blocks each at most,
    the last one padded to a power of two): its blocks come back bit for bit in new blocks, the others untouched."""
    from pulseinfer_jax.host_offload import swap

    monkeypatch.setattr(swap, "CHUNK_BLOCKS", 4)
    widths = []
    gather = swap._gather
    monkeypatch.setattr(swap, "_gather", lambda kv, idx: (widths.append(idx.shape[0]), gather(kv, idx))[1])
    rng = np.random.default_rng(3)
    kv = jnp.asarray(rng.integers(0, 255, (2, 24, 2, 3, 2, 4)).astype(np.float32), dtype)  # [L, NB, 2, r, Hkv, hd]
    before = np.asarray(kv)
    space = swap.SwapSpace(16)
    old = [5, 1, 9, 2, 17, 3, 11, 4, 8, 6]  # 10 blocks: chunks of 4, 4 and 2
    space.swap_out(kv, old, owner=7)
    assert widths == [4, 4, 2] and space.used_blocks == 10
    new = [13, 14, 15, 16, 18, 19, 20, 21, 22, 23]
    kv = space.swap_in(kv, new, owner=7)
    after = np.asarray(kv)
    np.testing.assert_array_equal(after[:, new], before[:, old])
    untouched = [b for b in range(1, 24) if b not in new]
    np.testing.assert_array_equal(after[:, untouched], before[:, untouched])
    assert space.used_blocks == 0 and space.swapped_in == space.swapped_out == 1
