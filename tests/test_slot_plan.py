"""Device-side slot-cache planning (selection/slot_plan.py) against the numpy SlotTable (the reference): the
same slot for every wanted block, the same hits, the same keys, over random steps with evictions, ragged lanes,
padding rows, requests of different capacities and rows reset for a new request."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pulseinfer_jax.selection import slot_plan
from pulseinfer_jax.selection.slot_plan import SlotStep
from pulseinfer_jax.selection.slot_table import SlotTable


@pytest.mark.parametrize("lanes,capacity,keys", [(1, 6, 20), (3, 5, 14)])
def test_device_plan_matches_the_numpy_slot_table(lanes, capacity, keys):
    rng = np.random.default_rng(lanes * 10 + capacity)
    layers, rows_n = 2, 4  # table rows 0..2 real, row 3 the padding row
    ref = SlotTable(layers, lanes, capacity, key_rows=4096, table_rows=rows_n)
    caps = [capacity, capacity - 2, 3]
    rrows = [ref.add(c) for c in caps]
    stamp, key = slot_plan.init_state(layers, rows_n, lanes, capacity)
    fplan = jax.jit(slot_plan.plan)
    offsets = [0, 1000, 2000]  # host rows: unique per request
    for step in range(70):
        if step == 35:  # request 1 leaves, a new one takes its row (and its host rows)
            ref.remove(rrows[1])
            rrows[1] = ref.add(caps[1])
            stamp, key = slot_plan.reset_rows(stamp, key, jnp.asarray([1, rows_n], jnp.int32))  # (padding entry)
        sl = step % layers
        width = capacity
        wanted = np.full((4, lanes, width), -1, np.int32)  # batch of 4: 3 requests + a padding row
        for b in range(3):
            for lane in range(lanes):
                n = int(rng.integers(0, caps[b] + 1))
                wanted[b, lane, :n] = rng.choice(keys, size=n, replace=False)
        order = rng.permutation(3)  # the batch lists the requests in any order
        batch_rows = np.array(list(order) + [rows_n - 1], np.int32)
        w = np.concatenate([wanted[order], wanted[3:]])
        host = np.where(w >= 0, w + np.array([offsets[r] for r in order] + [0])[:, None, None], -1)
        want_slot, want_hit = ref.plan(sl, np.array([rrows[r] for r in order]), w[:3], host[:3])
        cap_b = np.array([caps[r] for r in order] + [capacity], np.int32)
        other = 1 - sl
        before = np.asarray(stamp[other]), np.asarray(key[other])
        stamp, key, got_slot, got_hit = fplan(stamp, key, jnp.int32(sl), jnp.asarray(batch_rows), jnp.asarray(cap_b),
                                              jnp.asarray(w))
        np.testing.assert_array_equal(np.asarray(stamp[other]), before[0])  # the other layer's state is untouched
        np.testing.assert_array_equal(np.asarray(key[other]), before[1])
        # stamps stay a permutation of the slots per lane (the ranks' invariant)
        np.testing.assert_array_equal(np.sort(np.asarray(stamp[sl]), axis=-1),
                                      np.broadcast_to(np.arange(capacity), stamp[sl].shape))
        np.testing.assert_array_equal(np.asarray(got_slot)[:3], want_slot)
        np.testing.assert_array_equal(np.asarray(got_hit)[:3], want_hit)
        assert (np.asarray(got_slot)[3] == -1).all()
        for r in order:
            held = np.asarray(key[sl, r])[:, : caps[r]]
            np.testing.assert_array_equal(held, ref.keys(rrows[r])[sl])
            assert (np.asarray(key[sl, r])[:, caps[r]:] == -1).all()  # past the capacity: never used


@pytest.mark.parametrize("mode,lanes", [("recall", 1), ("recall", 2), ("bookkeep", 1), ("none", 1)])
def test_layer_plan_lists_match_its_contract(mode, lanes):
    """layer_plan's attention entries and recall list against the contract written out in numpy from `plan`'s
    slots and hits: early = resident blocks then hits, late = misses, each in selection order and compacted to the
    front; the recall list in row / lane / selection order; the host's info vector."""
    rng = np.random.default_rng(7 + lanes)
    b, n, k, cap, bs, rows_n, layers = 3, 8, 24, 6, 4, 4, 2
    stamp, key = slot_plan.init_state(layers, rows_n, lanes, cap)
    fn = jax.jit(slot_plan.layer_plan, static_argnames=("block_size", "sink", "window", "mode"))
    unit_offset = 1000
    for it in range(12):
        lengths = rng.integers(k * bs // 2, k * bs + 1, size=b).astype(np.int32)
        lengths[-1] = 0 if it % 3 == 0 else lengths[-1]  # a padding row now and then
        nblk = -(-lengths // bs)
        sel = np.full((b, lanes, n), -1, np.int32)
        for r in range(b):
            for lane in range(lanes):
                m = int(rng.integers(0, min(n, max(nblk[r], 1)) + 1)) if nblk[r] else 0
                sel[r, lane, :m] = np.sort(rng.choice(max(nblk[r], 1), size=m, replace=False))
        gpu = np.where(rng.random((b, k)) < 0.4, rng.permutation(b * k).reshape(b, k), -1).astype(np.int32)
        step = SlotStep(rows=np.array([0, 1, rows_n - 1], np.int32), capacity=np.array([cap, cap - 2, cap], np.int32),
                        gpu=gpu, host=(np.arange(b * k).reshape(b, k) + 500).astype(np.int32),
                        slots=(np.arange(b * cap).reshape(b, cap) + 200).astype(np.int32), lengths=lengths)
        if mode == "recall":  # the caller's guarantee: at most `capacity` misses per lane
            for r in range(b):
                for lane in range(lanes):
                    want = np.flatnonzero((sel[r, lane] >= 0) & (gpu[r, np.clip(sel[r, lane], 0, k - 1)] < 0))
                    sel[r, lane, want[step.capacity[r]:]] = -1
        sl = it % layers
        stamp0, key0 = stamp, key
        stamp, key, got = fn(stamp, key, jnp.int32(sl), jnp.asarray(sel), jax.tree.map(jnp.asarray, step),
                             jnp.int32(unit_offset), block_size=bs, sink=1, window=1, mode=mode)
        valid = sel >= 0
        safe = np.clip(sel, 0, k - 1)
        resident = valid & (gpu[np.arange(b)[:, None, None], safe] >= 0)
        if mode == "none":
            slot, hit = np.full(sel.shape, -1), np.zeros(sel.shape, bool)
        else:
            if mode == "recall":
                wanted = valid & ~resident
            else:
                wanted = valid & (sel >= 1) & (sel < nblk[:, None, None] - 1)
            want = jnp.asarray(np.where(wanted, sel, -1))
            _, _, slot, hit = jax.jit(slot_plan.plan)(stamp0, key0, jnp.int32(sl), jnp.asarray(step.rows),
                                                      jnp.asarray(step.capacity), want)
            slot, hit = np.asarray(slot), np.asarray(hit)
            if mode == "bookkeep":
                hit = np.zeros_like(hit)
        miss = (wanted & ~hit) if mode == "recall" else np.zeros(sel.shape, bool)
        want_early = np.zeros((2, b, lanes, n), np.int64)
        want_early[0] = -1
        want_late = want_early.copy()
        dst, lane_l, host_l = [], [], []
        for r in range(b):
            for lane in range(lanes):
                e = l_ = 0
                items = [(i, "res") for i in range(n) if resident[r, lane, i]] + \
                        [(i, "hit") for i in range(n) if hit[r, lane, i]]
                for i, kind in items:
                    unit = gpu[r, sel[r, lane, i]] if kind == "res" else step.slots[r, slot[r, lane, i]]
                    ln = np.clip(lengths[r] - sel[r, lane, i] * bs, 0, bs) if kind == "res" else bs
                    want_early[:, r, lane, e] = unit_offset + unit, ln
                    e += 1
                for i in range(n):
                    if miss[r, lane, i]:
                        block = step.slots[r, slot[r, lane, i]]
                        want_late[:, r, lane, l_] = unit_offset + block, bs
                        l_ += 1
                        dst.append(block)
                        lane_l.append(lane)
                        host_l.append(step.host[r, sel[r, lane, i]])
        np.testing.assert_array_equal(np.asarray(got.early), want_early)
        np.testing.assert_array_equal(np.asarray(got.late), want_late)
        # per lane: the misses' slot blocks and host rows in selection order, the counts; the host's reading of
        # them lists every miss in row / lane / selection order
        want_slots = np.zeros((b, lanes, n), np.int64)
        want_info = np.zeros((b, lanes, n + 4), np.int64)
        want_info[:, :, -2:] = -1  # no spare-block fill in this step
        for r in range(b):
            for lane in range(lanes):
                picks = [i for i in range(n) if miss[r, lane, i]]
                want_slots[r, lane, : len(picks)] = [step.slots[r, slot[r, lane, i]] for i in picks]
                want_info[r, lane, -4], want_info[r, lane, -3] = hit[r, lane].sum(), len(picks)
                want_info[r, lane, : len(picks)] = [step.host[r, sel[r, lane, i]] for i in picks]
        np.testing.assert_array_equal(np.asarray(got.misses), want_slots)
        np.testing.assert_array_equal(np.asarray(got.info), want_info)
        rows_l, lanes_l = slot_plan.recall_lanes(np.asarray(got.info))
        np.testing.assert_array_equal(rows_l, host_l)
        np.testing.assert_array_equal(lanes_l, lane_l)
        assert len(dst) == int(np.asarray(got.info)[:, :, -3].sum())
        if mode == "none":
            np.testing.assert_array_equal(np.asarray(key), np.asarray(key0))


@pytest.mark.parametrize("lanes", [1, 3])
def test_a_steps_plans_read_at_once_list_every_layers_misses_in_order(lanes):
    """`step_recall` over a step's stacked plans ([SL, B, S, N + 4]) gives each layer's misses exactly as
    `recall_lanes` reads that layer alone, concatenated in layer order, with each miss's layer and the count per
    layer; ragged miss counts, layers without a miss and padding rows included."""
    rng = np.random.default_rng(lanes)
    sl, b, n = 5, 4, 6
    info = rng.integers(0, 1000, (sl, b, lanes, n + 4)).astype(np.int32)
    info[..., -3] = rng.integers(0, n + 1, (sl, b, lanes))  # misses of each (row, lane)
    info[2, ..., -3] = 0  # a layer with nothing to recall
    layers, rows, lane, counts = slot_plan.step_recall(info)
    parts = [slot_plan.recall_lanes(info[i]) for i in range(sl)]
    np.testing.assert_array_equal(rows, np.concatenate([p[0] for p in parts]))
    np.testing.assert_array_equal(lane, np.concatenate([p[1] for p in parts]))
    np.testing.assert_array_equal(counts, [len(p[0]) for p in parts])
    np.testing.assert_array_equal(layers, np.repeat(np.arange(sl), counts))
    assert counts[2] == 0 and counts.sum() == info[..., -3].sum()
