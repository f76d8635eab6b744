"""Block selection policies (pulseinfer_jax.selection.policy) against a numpy reference and constructed cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pulseinfer_jax.pallas_kernels.block_metadata import block_key_bounds, update_bounds
from pulseinfer_jax.pallas_kernels.block_scoring import block_scores

from pulseinfer_jax.selection.policy import (
    block_attention_mass,
    bucket_budget,
    calibrate_retrieval_head,
    candidate_ids,
    logical_to_physical,
    membership_mask,
    resident_mask,
    select_blocks,
    top_groups,
)


def _np_select(scores, n, budget, sink, window):
    """Reference for one row: all blocks if n <= budget, else sinks + window + the best middle blocks
    ordered by (-score, index) with a stable sort (lower index wins ties). Sorted, padded with -1."""
    if n <= budget:
        chosen = list(range(n))
    else:
        forced = set(range(sink)) | set(range(n - window, n))
        middle = [i for i in range(n) if i not in forced]
        s = np.where(np.isnan(scores), -np.inf, scores)
        order = sorted(middle, key=lambda i: (-s[i], i))  # Python's sort is stable; index breaks ties anyway
        chosen = sorted(forced) + order[: budget - len(forced)]
    chosen = sorted(chosen)
    return np.array(chosen + [-1] * (budget - len(chosen)), np.int32)


@pytest.mark.parametrize("budget,sink,window", [(8, 1, 2), (6, 0, 1), (5, 2, 3)])
def test_headwise_matches_numpy_with_ties(budget, sink, window):
    rng = np.random.default_rng(budget * 10 + sink + window)
    b, h, k = 5, 3, 24
    scores = rng.integers(0, 3, size=(b, h, k)).astype(np.float32)  # few values: ties everywhere
    scores[0, 1, 5] = np.nan  # NaN ranks like -inf
    n = np.array([0, 3, budget, 13, 24], np.int32)
    sel = np.asarray(select_blocks(jnp.asarray(scores), jnp.asarray(n), budget_blocks=budget, sink_blocks=sink,
                                   window_blocks=window, mode="headwise"))
    assert sel.shape == (b, h, budget) and sel.dtype == np.int32
    for i in range(b):
        for j in range(h):
            np.testing.assert_array_equal(sel[i, j], _np_select(scores[i, j], n[i], budget, sink, window))


def test_ties_lower_index_wins_and_sinks_window_forced():
    k, budget, sink, window = 16, 6, 1, 2
    scores = np.zeros((1, 1, k), np.float32)
    scores[0, 0, [3, 7, 9, 11]] = 5.0  # four tied winners for three middle slots: 3, 7, 9 win
    scores[0, 0, [0, 14, 15]] = -1e9  # sink and window score worst but are always kept
    sel = np.asarray(select_blocks(jnp.asarray(scores), jnp.asarray([k]), budget_blocks=budget, sink_blocks=sink,
                                   window_blocks=window, mode="headwise"))
    np.testing.assert_array_equal(sel[0, 0], [0, 3, 7, 9, 14, 15])


def test_partial_last_block_is_in_window_and_budget_covers_all():
    scores = jnp.asarray(np.random.default_rng(0).standard_normal((2, 2, 12)), jnp.float32)
    n = jnp.asarray([11, 4], jnp.int32)  # 11 blocks: the last one (index 10) is the partial one
    sel = np.asarray(select_blocks(scores, n, budget_blocks=4, sink_blocks=1, window_blocks=1, mode="headwise"))
    assert (sel[0, :, 0] == 0).all() and (sel[0, :, -1] == 10).all()
    np.testing.assert_array_equal(sel[1], [[0, 1, 2, 3]] * 2)  # n == budget: everything
    big = np.asarray(select_blocks(scores, n, budget_blocks=16, sink_blocks=2, window_blocks=2, mode="solohead"))
    assert big.shape == (2, 1, 16)  # budget > K: padded with -1
    np.testing.assert_array_equal(big[0, 0], list(range(11)) + [-1] * 5)
    np.testing.assert_array_equal(big[1, 0], list(range(4)) + [-1] * 12)


def test_output_sorted_padded_and_shapes():
    rng = np.random.default_rng(5)
    b, h, k = 3, 4, 40
    scores = jnp.asarray(rng.standard_normal((b, h, k)), jnp.float32)
    n = jnp.asarray([40, 7, 25], jnp.int32)
    kw = dict(budget_blocks=16, sink_blocks=2, window_blocks=3)
    hw = np.asarray(select_blocks(scores, n, mode="headwise", **kw))
    solo = np.asarray(select_blocks(scores, n, mode="solohead", solohead="normalized_sum", **kw))
    rh = np.asarray(select_blocks(scores, n, mode="solohead", solohead="retrieval_head", retrieval_head=2, **kw))
    assert hw.shape == (b, h, 16) and solo.shape == rh.shape == (b, 1, 16)
    for sel in (hw, solo, rh):
        for row, nb in zip(sel.reshape(b, -1, 16), np.asarray(n), strict=True):
            for r in row:
                real = r[r >= 0]
                assert len(real) == min(16, nb) and (r[len(real):] == -1).all()
                assert (np.diff(real) > 0).all() and real.max() < nb
                assert {0, 1, nb - 3, nb - 2, nb - 1} <= set(real.tolist())  # sinks + window


def test_normalized_sum_prefers_blocks_several_heads_need():
    """Block 9 is very high for head 0 only; block 5 is fairly high for all three heads. A raw sum prefers
    9 (13 > 3 * 4); the per-head softmax sum prefers 5, and head 0 alone (headwise) prefers 9."""
    k = 16
    scores = np.zeros((1, 3, k), np.float32)
    scores[0, :, 5] = 4.0
    scores[0, 0, 9] = 13.0
    kw = dict(budget_blocks=3, sink_blocks=1, window_blocks=1)  # exactly one middle slot
    n = jnp.asarray([k], jnp.int32)
    solo = np.asarray(select_blocks(jnp.asarray(scores), n, mode="solohead", solohead="normalized_sum", **kw))
    np.testing.assert_array_equal(solo[0, 0], [0, 5, 15])
    raw = np.asarray(select_blocks(jnp.asarray(scores.sum(1, keepdims=True)), n, mode="headwise", **kw))
    np.testing.assert_array_equal(raw[0, 0], [0, 9, 15])
    hw = np.asarray(select_blocks(jnp.asarray(scores), n, mode="headwise", **kw))
    np.testing.assert_array_equal(hw[0, 0], [0, 9, 15])
    inf_row = scores.copy()
    inf_row[0, 2, :] = -np.inf  # a head with no finite score contributes nothing (no NaN)
    out = np.asarray(select_blocks(jnp.asarray(inf_row), n, mode="solohead", **kw))
    assert (out >= 0).all()


def test_retrieval_head_uses_one_heads_scores_and_traces():
    rng = np.random.default_rng(11)
    scores = jnp.asarray(rng.standard_normal((2, 4, 30)), jnp.float32)
    n = jnp.asarray([30, 21], jnp.int32)
    kw = dict(budget_blocks=8, sink_blocks=1, window_blocks=2)
    hw = np.asarray(select_blocks(scores, n, mode="headwise", **kw))
    for head in range(4):
        rh = np.asarray(select_blocks(scores, n, mode="solohead", solohead="retrieval_head", retrieval_head=head,
                                      **kw))
        np.testing.assert_array_equal(rh[:, 0], hw[:, head])

    @jax.jit
    def per_layer(s, head):  # the retrieval head as a traced per-layer value
        return select_blocks(s, n, mode="solohead", solohead="retrieval_head", retrieval_head=head, **kw)

    np.testing.assert_array_equal(np.asarray(per_layer(scores, jnp.int32(3)))[:, 0], hw[:, 3])


def test_select_blocks_rejects_bad_arguments():
    s, n = jnp.zeros((1, 2, 8)), jnp.asarray([8], jnp.int32)
    with pytest.raises(ValueError, match="count toward the budget"):
        select_blocks(s, n, budget_blocks=4, sink_blocks=2, window_blocks=3, mode="headwise")
    with pytest.raises(ValueError, match="mode="):
        select_blocks(s, n, budget_blocks=4, sink_blocks=1, window_blocks=1, mode="perhead")
    with pytest.raises(ValueError, match="retrieval_head=5"):
        select_blocks(s, n, budget_blocks=4, sink_blocks=1, window_blocks=1, mode="solohead",
                      solohead="retrieval_head", retrieval_head=5)
    with pytest.raises(ValueError, match="num_blocks_total"):
        select_blocks(s, jnp.asarray([8, 8]), budget_blocks=4, sink_blocks=1, window_blocks=1, mode="headwise")


def test_bucket_budget_powers_of_two():
    assert bucket_budget(2048, 16) == 128
    assert bucket_budget(2049, 16) == 256
    assert bucket_budget(100, 16) == 16  # floor
    assert bucket_budget(100, 16, min_blocks=4) == 8
    assert len({bucket_budget(t, 16) for t in range(1, 8193, 7)}) <= 6
    with pytest.raises(ValueError, match="must be positive"):
        bucket_budget(0, 16)


def test_candidate_ids_and_logical_to_physical():
    tables = jnp.asarray([[7, 3, 9, 0], [2, 5, 0, 0]], jnp.int32)
    cand = np.asarray(candidate_ids(tables, jnp.asarray([3, 2], jnp.int32), num_candidates=5))
    np.testing.assert_array_equal(cand, [[7, 3, 9, -1, -1], [2, 5, -1, -1, -1]])
    sel = jnp.asarray([[[0, 2, -1]], [[1, -1, -1]]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(logical_to_physical(sel, tables)), [[[7, 9, -1]], [[5, -1, -1]]])


def test_block_attention_mass_matches_numpy():
    rng = np.random.default_rng(2)
    t, hkv, g, hd, bs = 37, 2, 3, 16, 8
    q = rng.standard_normal((4, hkv * g, hd)).astype(np.float32)
    keys = rng.standard_normal((t, hkv, hd)).astype(np.float32)
    pos = np.array([10, 20, 36, 36])
    mass = np.asarray(block_attention_mass(jnp.asarray(q), jnp.asarray(keys), bs, q_positions=jnp.asarray(pos)))
    kr = np.repeat(keys, g, axis=1).astype(np.float64)
    logits = np.einsum("phd,thd->pht", q.astype(np.float64), kr) / np.sqrt(hd)
    logits = np.where(np.arange(t)[None, None] <= pos[:, None, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    rows = np.stack([p[..., i * bs:(i + 1) * bs].sum(-1) for i in range(-(-t // bs))], -1)  # [P, Hq, NB]
    assert mass.shape == (hkv * g, 5)
    np.testing.assert_allclose(mass, rows.mean(0), rtol=1e-5, atol=1e-6)
    per_query = block_attention_mass(jnp.asarray(q), jnp.asarray(keys), bs, q_positions=jnp.asarray(pos),
                                     average=False)
    assert per_query.shape == (4, hkv * g, 5)
    np.testing.assert_allclose(np.asarray(per_query), rows, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mass.sum(-1), 1.0, rtol=1e-5)


def test_calibration_picks_the_head_that_covers_the_others():
    """Blocks S are shared by everyone. Head 2 attends only to S; heads 0, 1, 3 put half their mass on S
    (spread thin) and half on private blocks (concentrated, so their own top-k picks the private ones).
    Head 2's selection (= S) covers 0.5 of each other head + all of itself; any other head's covers ~0.5."""
    nb, budget, sink, window = 32, 8, 1, 1
    shared = [5, 9, 14, 20, 25, 28]
    private = {0: [2, 3, 4, 6, 7, 8], 1: [10, 11, 12, 13, 15, 16], 3: [17, 18, 19, 21, 22, 23]}
    mass = np.zeros((4, nb), np.float32)
    mass[2, shared] = 1.0 / len(shared)
    for h, blocks in private.items():
        mass[h, shared] = 0.5 / len(shared)
        mass[h, blocks] = 0.5 / len(blocks) + 0.01  # beats a shared block for its own head
    mass /= mass.sum(-1, keepdims=True)
    assert calibrate_retrieval_head(jnp.asarray(mass), budget, sink, window, group_size=1) == 2
    # Same case as query-head rows (G = 2 rows per KV head, the mass split between them).
    rows = np.repeat(mass, 2, axis=0) * np.tile([[0.3], [0.7]], (4, 1))
    assert calibrate_retrieval_head(jnp.asarray(rows), budget, sink, window, group_size=2) == 2
    # ... and with a leading prompt axis: two prompts agreeing on head 2
    assert calibrate_retrieval_head(jnp.asarray(np.stack([mass, mass])), budget, sink, window, group_size=1) == 2
    with pytest.raises(ValueError, match="group_size=3"):
        calibrate_retrieval_head(jnp.asarray(mass), budget, sink, window, group_size=3)


def test_scores_to_selection_finds_the_needle():
    """End to end: a key aligned with the query planted in one middle block; Quest scores from the kernel
    (interpret mode) and both SoloHead policies select that block with one middle slot."""
    rng = np.random.default_rng(9)
    bs, hkv, g, hd, nblk = 8, 2, 2, 64, 12
    keys = rng.standard_normal((nblk * bs - 3, hkv, hd)).astype(np.float32) * 0.3
    q = rng.standard_normal((1, hkv * g, hd)).astype(np.float32)
    needle = 6 * bs + 5
    keys[needle] = q[0].reshape(hkv, g, hd).mean(1) * 4.0  # high q.k for every head
    nb = nblk + 4
    phys = rng.permutation(np.arange(1, nb))[:nblk].astype(np.int32)
    pool = np.full((nb, 2, bs, hkv, hd), np.nan, np.float32)
    for i, p in enumerate(phys):
        chunk = keys[i * bs:(i + 1) * bs]
        pool[p, 0, :len(chunk)] = chunk
    lens = np.array([min(bs, len(keys) - i * bs) for i in range(nblk)], np.int32)
    kmin, kmax = block_key_bounds(jnp.asarray(pool), jnp.asarray(phys), jnp.asarray(lens))
    meta_min, meta_max = update_bounds(jnp.full((nb, hkv, hd), jnp.nan), jnp.full((nb, hkv, hd), jnp.nan),
                                       jnp.asarray(phys), kmin, kmax)
    tables = jnp.asarray(phys[None])
    n = jnp.asarray([nblk], jnp.int32)
    scores = block_scores(jnp.asarray(q), meta_min, meta_max, candidate_ids(tables, n))
    kw = dict(budget_blocks=4, sink_blocks=1, window_blocks=2, mode="solohead")
    for policy in ("normalized_sum", "retrieval_head"):
        sel = select_blocks(scores, n, solohead=policy, score_scale=1.0 / (g * np.sqrt(hd)), **kw)
        np.testing.assert_array_equal(np.asarray(sel)[0, 0], [0, 6, 10, 11])
        np.testing.assert_array_equal(np.asarray(logical_to_physical(sel, tables))[0, 0], phys[[0, 6, 10, 11]])


def test_normalized_sum_is_a_softmax_over_each_heads_valid_blocks():
    """The SoloHead key: per head, softmax(score * scale) over the sequence's blocks (padding excluded)."""
    from pulseinfer_jax.selection.policy import _softmax_over_valid

    rng = np.random.default_rng(4)
    s = rng.standard_normal((2, 3, 10)).astype(np.float32) * 5
    valid = np.arange(10)[None, None] < np.array([10, 6])[:, None, None]
    p = np.asarray(_softmax_over_valid(jnp.asarray(s), jnp.asarray(valid), 0.5))
    for b, n in enumerate([10, 6]):
        np.testing.assert_allclose(p[b, :, :n], np.asarray(jax.nn.softmax(0.5 * s[b, :, :n], axis=-1)), rtol=1e-5)
        assert (p[b, :, n:] == 0).all()


def test_resident_mask_marks_each_slot_key():
    keys = np.array([[3, -1, 0, 9], [-1, -1, -1, -1], [5, 2, 7, 6]], np.int32)  # 9 / 7 / 6: past K = 6 or 7
    got = np.asarray(resident_mask(jnp.asarray(keys), 7))
    want = np.zeros((3, 7), bool)
    want[0, [3, 0]] = want[2, [5, 2, 6]] = True
    np.testing.assert_array_equal(got, want)


def test_resident_bonus_is_hysteresis_on_normalized_sum():
    """A resident middle block keeps its place unless a non-resident one holds more than (1 + bonus) x its
    estimated share; sinks, window and the budget are untouched; bonus 0 or no mask = the plain selection."""
    # one head, logits -> shares; blocks 0 (sink) and 7 (window) forced, budget 4 -> 2 middle slots
    s = np.log(np.array([[[5, 1.0, 2.0, 1.9, 1.5, 0.5, 0.2, 5]]], np.float32))
    n = jnp.array([8], jnp.int32)
    kw = dict(budget_blocks=4, sink_blocks=1, window_blocks=1, mode="solohead")
    plain = np.asarray(select_blocks(jnp.asarray(s), n, **kw))[0, 0]
    assert plain.tolist() == [0, 2, 3, 7]
    res = np.zeros((1, 8), bool)
    res[0, [1, 4]] = True  # blocks 1 (share 1.0) and 4 (1.5) sit in the slot cache
    sel = lambda bonus: np.asarray(select_blocks(jnp.asarray(s), n, resident=jnp.asarray(res),  # noqa: E731
                                                 resident_bonus=bonus, **kw))[0, 0].tolist()
    assert sel(0.0) == plain.tolist()
    assert sel(0.2) == [0, 2, 3, 7]  # block 4: 1.5 x 1.2 = 1.8 < 1.9 (block 3): no change
    assert sel(0.3) == [0, 2, 4, 7]  # 1.95 > 1.9: block 4 stays, 3 is not recalled
    assert sel(1.5) == [0, 1, 4, 7]  # 3.75 and 2.5 beat 2.0
    res[0, 0] = res[0, 7] = True  # residency of forced blocks changes nothing
    assert sel(1.5) == [0, 1, 4, 7]
    with pytest.raises(ValueError, match="normalized_sum only"):
        select_blocks(jnp.asarray(s), n, resident=jnp.asarray(res), resident_bonus=1.0,
                      **{**kw, "mode": "headwise"})
    with pytest.raises(ValueError, match=r"\[B, K\]"):
        select_blocks(jnp.asarray(s), n, resident=jnp.asarray(res[:, :5]), resident_bonus=1.0, **kw)


def test_top_groups_keeps_the_largest_summed_shares():
    """First level of two-level scoring: per row, the groups with the largest softmax share summed over heads
    (numpy reference; ties to the lower index), groups with no finite score never kept (-1 when too few)."""
    rng = np.random.default_rng(7)
    b, h, g, keep, scale = 4, 3, 10, 4, 0.7
    scores = rng.integers(-3, 3, size=(b, h, g)).astype(np.float32)  # few values: ties
    scores[1, :, 2:] = -np.inf  # row 1: only groups 0, 1 valid -> [0|1, 1|0, -1, -1]
    scores[2, 0, 5] = np.nan  # NaN on one head only: the group stays valid through the other heads
    got = np.asarray(top_groups(jnp.asarray(scores), keep, scale))
    assert got.shape == (b, keep) and got.dtype == np.int32
    for i in range(b):
        s = np.where(np.isnan(scores[i]), -np.inf, scores[i]) * scale
        valid = np.isfinite(s)
        e = np.where(valid, np.exp(s - np.max(np.where(valid, s, -np.inf), axis=1, keepdims=True)), 0.0)
        share = (e / e.sum(1, keepdims=True)).sum(0)
        order = [j for j in sorted(range(g), key=lambda j: (-share[j], j)) if valid[:, j].any()][:keep]
        want = order + [-1] * (keep - len(order))
        assert got[i].tolist() == want, (i, got[i], want)
    mask = np.asarray(membership_mask(jnp.asarray(got), g))
    assert mask.sum(1).tolist() == [(got[i] >= 0).sum() for i in range(b)] and mask[1, :2].all() and mask[1].sum() == 2


@pytest.mark.parametrize("kernel", ["reference", "pallas"])
def testtwo_level_scores_equal_plain_scores_on_kept_groups(kernel):
    """`sparse_layer.two_level_scores`: inside the kept groups every block's score is the plain scorer's (bit for bit),
    outside it is -inf; the kept groups are `top_groups` of the groups' scores from the min / max of their blocks'
    bounds; keeping every group reproduces plain scoring. Shuffled metadata rows, NaN-poisoned unused rows, -1
    candidates (no metadata) and a group with none."""
    from pulseinfer_jax.pallas_kernels.block_scoring import block_scores_reference

    from pulseinfer_jax.runner.sparse_layer import two_level_scores
    from pulseinfer_jax.selection.policy import BlockScoring

    fn = block_scores if kernel == "pallas" else block_scores_reference
    rng = np.random.default_rng(3)
    b, hq, hkv, hd, k, f, m = 2, 4, 2, 64, 16, 4, 2
    nrows = 40  # metadata blocks (m rows each); rows not listed are NaN
    meta = rng.standard_normal((2, nrows * m, hkv, hd)).astype(np.float32)
    meta_min, meta_max = np.minimum(meta[0], meta[1]), np.maximum(meta[0], meta[1])
    cand = np.full((b, k), -1, np.int32)
    perm = rng.permutation(np.arange(1, nrows))
    cand[0, 1:14] = perm[:13]  # sequence 0: blocks 1..13 scored (group 3 holds 12, 13 only)
    cand[1, 4:11] = perm[13:20]  # sequence 1: group 0 has no scored block
    used = np.unique(cand[cand >= 0])
    unused = np.setdiff1d(np.arange(nrows), used)
    for a in (meta_min, meta_max):
        a.reshape(nrows, m, hkv, hd)[unused] = np.nan
    # group bounds as the engine keeps them: min / max over each group's scored blocks, one row per group
    kg = k // f
    gmin = np.full((b * kg, hkv, hd), np.nan, np.float32)
    gmax = np.full((b * kg, hkv, hd), np.nan, np.float32)
    groups = np.full((b, kg), -1, np.int32)
    for i in range(b):
        for g in range(kg):
            rows = [r for r in cand[i, g * f:(g + 1) * f] if r >= 0]
            if rows:
                idx = (np.array(rows)[:, None] * m + np.arange(m)).ravel()
                gmin[i * kg + g], gmax[i * kg + g] = meta_min[idx].min(0), meta_max[idx].max(0)
                groups[i, g] = i * kg + g
    q = jnp.asarray(rng.standard_normal((b, hq, hd)).astype(np.float32))
    scoring = BlockScoring(sub_blocks=m, coarse_group=f)
    args = (q, jnp.asarray(meta_min), jnp.asarray(meta_max), jnp.asarray(cand), jnp.asarray(gmin), jnp.asarray(gmax),
            jnp.asarray(groups))
    plain = np.asarray(fn(q, args[1], args[2], args[3], per_head=True, beta=scoring.beta, sub_blocks=m, scale=0.1))
    everything = np.asarray(two_level_scores(fn, *args, keep=kg, scoring=scoring, per_head=True, scale=0.1))
    np.testing.assert_array_equal(everything, np.where(cand[:, None] >= 0, plain, -np.inf))
    two = np.asarray(two_level_scores(fn, *args, keep=2, scoring=scoring, per_head=True, scale=0.1))
    coarse = fn(q, args[4], args[5], args[6], per_head=True, beta=scoring.beta, scale=0.1)
    kept = np.asarray(top_groups(coarse, 2, 0.1))
    assert (kept >= 0).all() and 0 not in kept[1]  # group 0 of sequence 1 has nothing to score
    inside = np.repeat(np.asarray(membership_mask(jnp.asarray(kept), kg)), f, axis=1) & (cand >= 0)  # [B, K]
    assert inside.sum() < (cand >= 0).sum()  # the first level dropped blocks
    np.testing.assert_array_equal(two, np.where(inside[:, None], plain, -np.inf))
