"""Device-side slot-cache planning (pulseinfer_jax/slot_plan.py) against the numpy SlotTable (the reference): the
same slot for every wanted block, the same hits, the same keys, over random steps with evictions, ragged lanes,
padding rows, requests of different capacities and rows reset for a new request."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from host_offload.slot_cache import SlotTable
from pulseinfer_jax import slot_plan


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
        new_stamp, new_key, got_slot, got_hit = fplan(stamp[sl], key[sl], jnp.asarray(batch_rows),
                                                      jnp.asarray(cap_b), jnp.asarray(w))
        stamp, key = stamp.at[sl].set(new_stamp), key.at[sl].set(new_key)
        np.testing.assert_array_equal(np.asarray(got_slot)[:3], want_slot)
        np.testing.assert_array_equal(np.asarray(got_hit)[:3], want_hit)
        assert (np.asarray(got_slot)[3] == -1).all()
        for r in order:
            held = np.asarray(key[sl, r])[:, : caps[r]]
            np.testing.assert_array_equal(held, ref.keys(rrows[r])[sl])
            assert (np.asarray(key[sl, r])[:, caps[r]:] == -1).all()  # past the capacity: never used
