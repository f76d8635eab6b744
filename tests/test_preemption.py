"""KV allocated as requests grow, and preemption when the GPU pool runs out: through host memory (bit for bit), or by
recomputation when the host has no room; offloaded requests through host memory only, resuming bit for bit."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY, doubled

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
            # the token written this step has its block (an offloaded request's window moves in its own blocks)
            assert len(r.blocks) * s.block_size >= r.seq_len or r.placement == "offload"
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


@pytest.mark.smoke
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


class FakePlacer:
    """The offload side of a scheduler without a model: every request offloaded with `blocks` GPU blocks."""

    def __init__(self, blocks: int):
        self.blocks, self.resumed = blocks, []

    def candidate(self, req):
        from pulseinfer_jax.sched.admission import Candidate

        never = 10**6  # (each request asks for its placement)
        dense, offloaded = (2, never) if req.mode == "dense" else (never, self.blocks)
        return Candidate(req.index, dense, offloaded, 0.0)

    def fits_ever(self, req, mode):
        return None

    def setup(self, req):
        req.sparse = object()

    def prefill_blocks(self, req):
        return []

    def release(self, req):
        pass

    def preempted(self, req):
        pass

    def resume(self, req, old_blocks):
        self.resumed.append((req.index, list(old_blocks), list(req.blocks)))


def test_an_offloaded_request_is_preempted_only_through_host_memory():
    """A dense request out of blocks preempts the youngest running request: an offloaded one goes to host memory whole
    and comes back in as many blocks (its placer told which took which); without room there it keeps running and the
    next youngest, here the dense request itself, goes instead."""
    for room, victim in ((100, 1), (0, 0)):
        alloc = BlockAllocator(1 + 6)
        mover, placer = FakeMover(room), FakePlacer(3)
        s = Scheduler(alloc, block_size=4, max_batch=8, mode="auto", placer=placer, mover=mover)
        dense, off = _req(0, 7), _req(1, 7)
        dense.mode, off.mode = "dense", "offload"
        for r in (dense, off):
            s.add(r)
        _decode(s, [dense, off])
        assert (dense.placement, off.placement, alloc.num_free) == ("dense", "offload", 1)
        before = list(off.blocks)
        _decode(s, [dense, off], steps=5)  # the dense request takes the last free block, then needs a fourth
        if victim == 1:
            assert off.status is Status.PREEMPTED and dense.status is Status.RUNNING and 1 in mover.held
            assert s.preempted_swap == 1 and len(dense.blocks) == 4
            s.finish(dense, "length")
            assert s.admit() == [off] and off.status is Status.RUNNING and len(off.blocks) == 3
            assert placer.resumed == [(1, before, off.blocks)] and 1 not in mover.held
        else:  # no room in host memory: the offloaded request runs on, the dense one is recomputed later
            assert off.status is Status.RUNNING and off.blocks == before and dense.status is Status.PREEMPTED
            assert dense.recompute and s.preempted_recompute == 1 and s.preempted_swap == 0
        alloc.check_integrity()


def test_a_preempted_offloaded_requests_block_roles_move_with_its_kv_and_a_cancelled_one_frees_all():
    """OffloadPlacer under the scheduler: a preempted offloaded request gives its slot-cache row back and keeps its host
    rows; resumed in other blocks, each role (window and sink blocks, spare, the block leaving the window, slots,
    packs) is at the block that took its KV; cancelled while preempted, it frees its host rows and row once."""
    import jax
    from pulseinfer_jax.host_offload.host_pool import HostKVPool
    from pulseinfer_jax.host_offload.placement import SparsePlan

    from pulseinfer_jax.sched.placer import OffloadPlacer

    plan = SparsePlan(num_layers=4, dense_layers=2, block_size=4, num_kv_heads=2, sink_blocks=1, window_blocks=2,
                      budget_blocks=6, slot_blocks=4, selection="solohead", placement="host")
    pool = HostKVPool(num_rows=64, first_layer=2, num_layers=4, block_size=4, num_kv_heads=2, head_dim=8,
                      dtype=np.float32, device=jax.devices()[0], io="numpy")
    alloc = BlockAllocator(1 + 60)
    placer = OffloadPlacer(plan, alloc, pool, 4)
    mover = FakeMover(100)
    s = Scheduler(alloc, block_size=4, max_batch=8, mode="offload", placer=placer, mover=mover)
    a, b = _req(0, 30, 10), _req(1, 30, 10)
    for r in (a, b):
        s.add(r)
    assert s.admit() == [a, b]
    for r in (a, b):
        r.sparse.prefill_done(len(r.prompt))  # (the engine's offloaded prefill does this)
        s.prefill_done(r)
        r.output.append(1)
        r.sparse.slot_fresh = False
    for _ in range(6):  # decoding: the window moves on, blocks leave it (the last one's GPU block the spare)
        for r in (a, b):
            r.sparse.advance(r.seq_len)
            r.output.append(1)
    old, before = list(b.blocks), b.sparse
    rows, slot_row = list(before.host_rows), before.slot_row
    assert before.leaving is not None and before.spare
    assert s.preempt(b) and placer._slot_rows_free == [slot_row] and pool.allocator.num_free == 64 - 1 - 2 * 10
    s.finish(a, "length")  # a's blocks free up: b lands back in blocks a held
    assert s.admit() == [b] and b.status is Status.RUNNING and set(b.blocks) - set(old)
    to = dict(zip(old, b.blocks, strict=True))
    now = b.sparse
    assert now.gpu_of == {j: to[g] for j, g in before.gpu_of.items()}
    assert now.gpu_arr.tolist() == [to[g] if g >= 0 else -1 for g in before.gpu_arr.tolist()]
    assert (now.spare, now.leaving) == ([to[g] for g in before.spare], (before.leaving[0], to[before.leaving[1]]))
    assert (now.slot_blocks, now.packs) == ([to[g] for g in before.slot_blocks], [to[g] for g in before.packs])
    assert now.slot_block_arr.tolist() == now.slot_blocks and now.owned_gpu_blocks() == sorted(b.blocks)
    assert (now.host_rows, now.num_blocks, now.tokens, now.counters) == (rows, before.num_blocks, before.tokens,
                                                                         before.counters)
    units = before.dense_units(now.num_blocks, 61).tolist()  # (flat units: layer * NB + block)
    assert now.dense_units(now.num_blocks, 61).tolist() == [[u // 61 * 61 + to[u % 61] for u in r] for r in units]
    assert s.preempt(b)
    s.finish(b, "abort")  # cancelled while preempted
    assert mover.held == {} and alloc.num_free == alloc.capacity and pool.allocator.num_free == 63
    assert sorted(placer._slot_rows_free) == [0, 1] and placer._parked == set()
    alloc.check_integrity()
    pool.check_integrity()


@pytest.fixture(scope="module")
def tiny4_bf16():
    """tiny4 (conftest) in bfloat16: its KV "auto" is bfloat16."""
    from pulseinfer_jax.models.loading import load_model

    return doubled(load_model(TINY / "llama31", dtype="bfloat16"), "tiny4-bf16")


def _offloaded(model, prompts: list[list[int]], config: EngineConfig, new: int, before_step=None):
    """Greedy decode of `prompts` in `config`'s engine, step by step as Engine.run does, with `before_step(k, engine,
    requests)` called before engine step k (None: nothing). Returns (engine, requests)."""
    eng = Engine(model, config)
    reqs = [eng.make_request(i, p, SamplingParams(max_new_tokens=new, ignore_eos=True)) for i, p in enumerate(prompts)]
    eng.ensure_pool(reqs)
    for r in reqs:
        eng.submit(r)
    while eng.busy:
        if before_step is not None:
            before_step(eng.steps, eng, reqs)
        for _ in eng.step():
            pass
    return eng, reqs


OFFLOAD = dict(block_size=4, max_batch=4, prefill_chunk=32, key_chunk=32, window_tokens=8, sink_blocks=1,
               mode="offload", budget_tokens=24, dense_layers=2)


def _prompts(model, lengths=(61, 38, 47)):
    rng = np.random.default_rng(5)
    return [rng.integers(3, model.cfg.vocab_size, int(k)).tolist() for k in lengths]


def _check_preempted_run(eng, reqs, alone, moved):
    """The preempted run `eng` gave the unpreempted run's tokens, its requests really moved, and nothing leaked."""
    assert [r.output for r in reqs] == [r.output for r in alone]
    assert any(before != after for _, before, after in moved)  # (KV really changed blocks)
    assert eng.scheduler.preempted_swap == sum(r.preemptions for r in reqs) == len(moved)
    assert eng.scheduler.preempted_recompute == 0
    assert eng.swap.swapped_in == eng.swap.swapped_out == len(moved)
    eng.check_drained()  # every GPU block, host row and swap block free, the allocators consistent
    assert eng.scheduler.placer._parked == set() and not eng._slots_out


def _back(out: dict, reqs, moved: list) -> None:
    """The preempted requests in `out` (index -> its blocks then) that are back (running, or done in the step they
    came back in), moved to `moved` as (index, blocks before, blocks now)."""
    for i in [i for i in out if reqs[i].status is not Status.PREEMPTED]:
        moved.append((i, out.pop(i), list(reqs[i].blocks)))


def _preempt(eng, r, out: dict) -> None:
    out[r.index] = list(r.blocks)
    assert eng.scheduler.preempt(r) and r.status is Status.PREEMPTED and r.blocks == []


@pytest.mark.smoke
@pytest.mark.parametrize("kv_dtype", ["auto", "float8_e4m3fn"])
def test_preempted_offloaded_requests_give_the_unpreempted_tokens_bit_for_bit(tiny4_bf16, kv_dtype):
    """Offloaded requests (sparse selection: 3 of up to 17 middle blocks a step, recall one step ahead; bfloat16 or
    float8 KV) preempted before most steps, one or two at a time, each back in the same step in the blocks and
    slot-cache row another left: each resumes with its slot caches, the recalls it had in flight, its key bounds and
    its window as they were, and gives the unpreempted run's tokens; nothing is left over. (Back in the same step,
    every decode batch is the unpreempted run's: XLA:CPU rounds a one-row bfloat16 batch differently from a larger
    one, so a longer absence is checked on float32, below.)"""
    config = EngineConfig.of(**OFFLOAD, kv_dtype=kv_dtype)
    prompts = _prompts(tiny4_bf16)
    _, alone = _offloaded(tiny4_bf16, prompts, config, 20)
    # (every prompt is longer than the 24-token budget: each step selects, and recalls what its slots lack)
    assert min(map(len, prompts)) > 24 and all(r.sparse.counters.recalled_blocks for r in alone)
    moved, out = [], {}

    def churn(k, eng, reqs):
        _back(out, reqs, moved)
        for i in [[1, 2], [0], [2]][k % 3]:
            if reqs[i].status is Status.RUNNING:
                _preempt(eng, reqs[i], out)

    eng, reqs = _offloaded(tiny4_bf16, prompts, config, 20, churn)
    _back(out, reqs, moved)
    _check_preempted_run(eng, reqs, alone, moved)
    assert len({i for i, _, _ in moved}) == 3 and len(moved) >= 20


def test_an_offloaded_request_out_for_several_steps_resumes_bit_for_bit(tiny4):
    """An offloaded request (float8 KV) preempted for 4 steps while the others decode on (the batch capped at them),
    then back in the blocks of one preempted as it returns: its tokens, and everyone's, are the unpreempted run's."""
    config = EngineConfig.of(**OFFLOAD, kv_dtype="float8_e4m3fn")
    prompts = _prompts(tiny4)
    _, alone = _offloaded(tiny4, prompts, config, 20)
    moved, out, waited = [], {}, []

    def hold(k, eng, reqs):
        _back(out, reqs, moved)
        waited.extend(i for i in out if 10 < k < 15)
        eng.scheduler.max_batch = 2 if 10 <= k < 15 else config.max_batch
        if k in (10, 15):  # request 0 out; back, in blocks request 1 leaves then
            _preempt(eng, reqs[0 if k == 10 else 1], out)

    eng, reqs = _offloaded(tiny4, prompts, config, 20, hold)
    _back(out, reqs, moved)
    _check_preempted_run(eng, reqs, alone, moved)
    assert waited == [0] * 4 and len(moved) == 2
    assert set(moved[0][2]) - set(moved[0][1])  # (request 0 is back in blocks request 1 held)
