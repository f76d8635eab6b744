"""The fused selection and slot-plan kernel (pallas_kernels/select_plan.py, Pallas interpret mode) against its jnp
reference bit for bit, and the reference against the contract it fuses: `policy.select_blocks` followed by
`slot_plan.layer_plan` in "recall" mode (selections equal up to exact float ties, plans equal bit for bit), over
steps that carry the slot state: shuffled table rows, a padding row, ties, NaN / inf scores, NaN past each
sequence's blocks, lengths at block boundaries, budgets above the block count, the spare-block fill, and forced
middle blocks (a replayed trace's: lanes listing blocks, repeats, sinks / window / blocks past the end, nothing at
all, beside lanes that keep the scored selection)."""

import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from pulseinfer_jax.pallas_kernels.select_plan import SCORER, select_plan, select_plan_reference

from pulseinfer_jax.selection import slot_plan
from pulseinfer_jax.selection.kept_blocks import kept_logical, with_kept_scores
from pulseinfer_jax.selection.policy import resident_mask, select_blocks, summed_shares, with_middle
from pulseinfer_jax.selection.slot_plan import SlotStep

B, H, K, C, N, SL, R, BS = 4, 4, 37, 14, 6, 2, 6, 4  # (N: not a power of two)
SINK, WINDOW, SCALE, UNIT = 1, 2, 0.3, 100
M = N - SINK - WINDOW  # forced middle blocks a lane may list


def _seed(*case) -> int:
    """A seed per case, the same in every process (str hashes are salted per process)."""
    return zlib.crc32(repr(case).encode())


def _step(rng, it, ties):
    """One step's inputs: row 3 is padding (no blocks, the table's last row)."""
    shape = (B, H, K)
    scores = rng.integers(-3, 4, shape).astype(np.float32) if ties else rng.normal(size=shape).astype(np.float32)
    scores[rng.random(shape) < 0.03] = np.nan
    scores[rng.random(shape) < 0.03] = np.inf
    scores[rng.random(shape) < 0.03] = -np.inf
    nb = rng.integers(0, K + 1, B).astype(np.int32)
    nb[0] = [K, N, N - 1, 0, 1, K - 1][it % 6]  # budget >= blocks, exactly the budget, none, ...
    nb[3] = 0
    for b in range(B):
        scores[b, :, nb[b]:] = np.nan  # never read as a score
    rows = np.append(rng.permutation(R - 1)[: B - 1], R - 1).astype(np.int32)
    cap = np.array([C, C - 4, C - 1, C], np.int32)
    gpu = np.where(rng.random((B, K)) < 0.3, rng.integers(0, 60, (B, K)), -1).astype(np.int32)
    host = rng.integers(0, 1000, (B, K)).astype(np.int32)
    # slot blocks: each row its own; spare blocks: apart from every slot (as the pools lay them out; a fill's copy
    # reading another row's slot would depend on program order)
    ids = rng.permutation(np.arange(1, UNIT - 1)).astype(np.int32)
    slots = ids[: B * C].reshape(B, C)
    lengths = np.maximum(nb * BS - rng.integers(0, BS, B) * (it % 2), 0).astype(np.int32)  # at a boundary or not
    spare = (np.full(B, -1, np.int32), ids[B * C: B * C + B])
    for b in range(B):  # the block that just left the window: not resident, scored high (selected: a miss or a hit)
        j = nb[b] - WINDOW - 1
        if j >= SINK and rng.random() < 0.8:
            spare[0][b], gpu[b, j] = j, -1
            scores[b, :, j] = 3.0
    return scores, nb, rows, cap, gpu, host, slots, lengths, spare


def _middle(rng, lanes):
    """Forced middle blocks [SL, B, lanes, M]: per lane the scored selection (SCORER anywhere), nothing (-1 only), or
    blocks anywhere in [-1, K + 2) (the middle range's, sinks, window, past the row's end, repeats)."""
    mid = rng.integers(-1, K + 2, (SL, B, lanes, M)).astype(np.int32)
    kind = rng.integers(0, 4, (SL, B, lanes))
    mid[kind == 0] = -1
    at = rng.integers(0, M, (SL, B, lanes))
    for idx in zip(*np.nonzero(kind == 1), strict=True):
        mid[idx + (at[idx],)] = SCORER
    mid[..., 1][kind == 2] = mid[..., 0][kind == 2]  # a repeat
    return mid


def _args(stamp, key, layer, st, with_spare, with_kept=False):
    """The kernel's positional arguments; `with_kept`: the always-kept blocks' own scores (normalized_sum)."""
    scores, nb, rows, cap, gpu, host, slots, lengths, spare = (jnp.asarray(a) if not isinstance(a, tuple) else
                                                              tuple(map(jnp.asarray, a)) for a in st)
    kept = None
    if with_kept:
        logical = kept_logical(np.asarray(nb), SINK, WINDOW)
        own = np.random.default_rng(int(np.asarray(nb).sum())).normal(size=(B, H, logical.shape[1]))
        kept = (jnp.asarray(own.astype(np.float32)), jnp.asarray(logical))
    return (scores, nb, stamp, key, jnp.int32(layer), rows, cap, gpu, host, slots, lengths, jnp.int32(UNIT),
            spare if with_spare else None, 2, kept)


def _kw(select):
    return dict(budget=N, sink=SINK, window=WINDOW, select=select, scale=SCALE,
                bonus=0.25 if select in ("normalized_sum", "summed") else 0.0, block_size=BS)


CASES = [("normalized_sum", 1, False, True), ("normalized_sum", 1, True, False), ("retrieval_head", 1, False, True),
         ("headwise", H, False, True), ("headwise", H, True, True)]


MIDDLE = [("normalized_sum", 1, False, True), ("headwise", H, True, True), ("retrieval_head", 1, True, False)]


@pytest.mark.parametrize("select,lanes,ties,spare,middle", [c + (False,) for c in CASES]
                         + [("summed", 1, True, True, False)] + [c + (True,) for c in MIDDLE])
def test_kernel_matches_reference_bit_for_bit(select, lanes, ties, spare, middle):
    rng = np.random.default_rng(_seed(select, ties, spare, middle))
    stamp, key = slot_plan.init_state(SL, R, lanes, C)
    fills = replayed = hits = 0
    for it in range(8):
        args = _args(stamp, key, it % SL, _step(rng, it, ties), spare, select == "normalized_sum")
        # with the spare fill: the cache too (the fill copies blocks of layer UNIT // NB = 1; NaN-poisoned elsewhere)
        kv = None
        if spare:
            kv = np.full((2, UNIT, 2, BS, lanes if select == "headwise" else 2, 8), np.nan, np.float32)
            kv[1] = rng.normal(size=kv[1].shape)
            kv = jnp.asarray(kv)
        mid = jnp.asarray(_middle(rng, lanes)) if middle else None
        ref = select_plan_reference(*args, kv, mid, **_kw(select))
        got = select_plan(*args[:2], jnp.array(stamp), jnp.array(key), *args[4:], None if kv is None else
                          jnp.array(kv), mid, interpret=True, **_kw(select))
        for name, a, b in zip(ref._fields, got, ref, strict=True):
            if b is None:
                assert a is None
                continue
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"step {it}: {name}")
        if spare:  # every fill copied its block (the source block's contents now in the slot)
            info, kv_got = np.asarray(ref.info), np.asarray(got.kv)
            for b_, s_ in zip(*np.nonzero(info[:, :, -2] >= 0), strict=True):
                dst, src = info[b_, s_, -2], info[b_, s_, -1]
                want = np.asarray(kv)[1, src] if select != "headwise" else np.asarray(kv)[1, src, :, :, s_]
                have = kv_got[1, dst] if select != "headwise" else kv_got[1, dst, :, :, s_]
                np.testing.assert_array_equal(have, want)
                fills += 1
        if middle:  # the replayed lanes took their listed blocks (none of them scored), the others their own
            forced = _forced(np.asarray(args[1]), np.asarray(mid)[it % SL])
            sel = np.asarray(ref.sel)
            for (b_, s_), want in forced.items():
                assert set(sel[b_, s_]) - {-1} == want, (it, b_, s_)
            replayed += len(forced)
        hits += int(np.asarray(ref.info)[..., -4].sum())
        stamp, key = ref.stamp, ref.key
    assert hits > 0  # the state carried: hits happen
    assert fills > 0 or not spare
    assert replayed > 0 or not middle


def _forced(nb, mid):
    """(row, lane) -> the blocks a replayed lane selects: its sinks, window and listed middle blocks."""
    out = {}
    for b, s in np.ndindex(*mid.shape[:2]):
        if (mid[b, s] == SCORER).any():
            continue
        n = int(nb[b])
        kept = {j for j in range(n) if j < SINK or j >= n - WINDOW}
        out[(b, s)] = kept | {int(j) for j in mid[b, s] if SINK <= j < n - WINDOW}
    return out


def _same_up_to_ties(got, want, sel_key):
    """Selections equal, or differing only between blocks of equal key (the contract breaks ties by index; two sums
    of the same floats in another order may differ in the last bit)."""
    for b in range(got.shape[0]):
        for s in range(got.shape[1]):
            g, w = set(got[b, s]) - {-1}, set(want[b, s]) - {-1}
            assert len(g) == len(w)
            for x, y in zip(sorted(g - w), sorted(w - g), strict=True):
                np.testing.assert_allclose(sel_key[b, s, x], sel_key[b, s, y], rtol=1e-5)


@pytest.mark.parametrize("select,lanes,ties,spare,middle", [c + (False,) for c in CASES]
                         + [c + (True,) for c in CASES])
def test_reference_is_select_blocks_then_layer_plan(select, lanes, ties, spare, middle):
    """... and with forced middle blocks, `select_blocks` then `policy.with_middle` (the jnp path's rule)."""
    rng = np.random.default_rng(1 + _seed(select, ties, spare, middle))
    stamp, key = slot_plan.init_state(SL, R, lanes, C)
    for it in range(8):
        st = _step(rng, it, ties)
        args = _args(stamp, key, it % SL, st, spare, select == "normalized_sum")
        scores, nb, rows, cap, gpu, host, slots, lengths, spare_a = args[0], args[1], *args[5:11], args[12]
        layer = args[4]
        mid = jnp.asarray(_middle(rng, lanes)) if middle else None
        ref = select_plan_reference(*args, None, mid, **_kw(select))
        norm = select == "normalized_sum"
        if norm:  # the contract scores the kept blocks by `with_kept_scores` first
            scores = with_kept_scores(scores, *args[14])
        sel = select_blocks(scores, nb, budget_blocks=N, sink_blocks=SINK, window_blocks=WINDOW,
                            mode="headwise" if select == "headwise" else "solohead",
                            solohead="normalized_sum" if norm else "retrieval_head", retrieval_head=2,
                            score_scale=SCALE, resident=resident_mask(key[layer, rows, 0], K) if norm else None,
                            resident_bonus=0.25 if norm else 0.0)
        if middle:
            sel = with_middle(sel, mid[layer], nb, SINK, WINDOW)
        if norm:  # the summed shares the selection ranks (tie check)
            x = np.nan_to_num(np.asarray(scores) * SCALE, nan=-np.inf, posinf=np.finfo(np.float32).max)
            x = np.where(np.arange(K) < np.asarray(nb)[:, None, None], x, -np.inf)
            with np.errstate(over="ignore", invalid="ignore"):
                e = np.exp(x - np.where(np.isfinite(x.max(-1, keepdims=True)), x.max(-1, keepdims=True), 0))
                e = e / np.maximum(e.sum(-1, keepdims=True), 1e-38)
            _same_up_to_ties(np.asarray(ref.sel), np.asarray(sel), e.sum(1, keepdims=True))
        else:
            np.testing.assert_array_equal(np.asarray(ref.sel), np.asarray(sel))
        step = SlotStep(rows, cap, gpu, host, slots, lengths, None, spare_a)
        st2, ky2, plan = slot_plan.layer_plan(stamp, key, layer, ref.sel, step, jnp.int32(UNIT), block_size=BS,
                                              sink=SINK, window=WINDOW, mode="recall")
        fused = slot_plan.fused_layer_plan(ref, spare_a is not None)
        want = dict(stamp=st2, key=ky2, early=plan.early, late=plan.late, misses=plan.misses, info=plan.info,
                    fill=plan.fill)
        got = dict(stamp=ref.stamp, key=ref.key, early=fused.early, late=fused.late, misses=fused.misses,
                   info=fused.info, fill=fused.fill)
        for name in want:
            if want[name] is None:
                assert got[name] is None
                continue
            for a, b in zip(np.atleast_1d(got[name]) if not isinstance(got[name], tuple) else got[name],
                            np.atleast_1d(want[name]) if not isinstance(want[name], tuple) else want[name],
                            strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"step {it}: {name}")
        stamp, key = ref.stamp, ref.key


def test_summed_shares_select_as_normalized_sum():
    """Tensor parallelism's path: the shares summed outside (`policy.summed_shares`) then "summed" selects what
    "normalized_sum" selects from the per-head scores (up to exact ties), and plans the same."""
    rng = np.random.default_rng(5)
    stamp, key = slot_plan.init_state(SL, R, 1, C)
    for it in range(4):
        args = _args(stamp, key, it % SL, _step(rng, it, False), True, True)
        shares = summed_shares(with_kept_scores(args[0], *args[14]), args[1], SCALE)
        want = select_plan_reference(*args, **_kw("normalized_sum"))
        got = select_plan_reference(shares, *args[1:14], **_kw("summed"))
        _same_up_to_ties(np.asarray(got.sel), np.asarray(want.sel), np.asarray(shares))
        if np.array_equal(np.asarray(got.sel), np.asarray(want.sel)):
            np.testing.assert_array_equal(np.asarray(got.stamp), np.asarray(want.stamp))
            np.testing.assert_array_equal(np.asarray(got.early_units), np.asarray(want.early_units))
        stamp, key = want.stamp, want.key


def test_select_plan_rejects_bad_arguments():
    rng = np.random.default_rng(0)
    stamp, key = slot_plan.init_state(SL, R, 1, C)
    args = _args(stamp, key, 0, _step(rng, 0, False), True)
    with pytest.raises(ValueError, match="must be positive"):
        select_plan_reference(*args, **{**_kw("normalized_sum"), "budget": 0})
    with pytest.raises(ValueError, match="fit the budget"):
        select_plan_reference(*args, **{**_kw("normalized_sum"), "sink": 4, "window": 5})
    with pytest.raises(ValueError, match="one slot lane per score head"):
        select_plan_reference(*args, **_kw("headwise"))
    with pytest.raises(ValueError, match="kept scores are normalized_sum's"):
        select_plan_reference(*_args(stamp, key, 0, _step(rng, 0, False), True, True)[:13], 0,
                              _args(stamp, key, 0, _step(rng, 0, False), True, True)[14], **_kw("retrieval_head"))
    with pytest.raises(ValueError, match="must be normalized_sum"):
        select_plan_reference(*args, **_kw("top_p"))
    with pytest.raises(ValueError, match=r"\[B, H, K\]"):
        select_plan_reference(args[0][0], *args[1:], **_kw("normalized_sum"))
