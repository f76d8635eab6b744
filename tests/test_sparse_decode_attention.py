"""Sparse decode attention (Pallas, interpret mode on CPU) against a float64 NumPy oracle and the jnp reference.

Every case draws its own random inputs. Pools start as NaN and only the valid slots of the blocks a
sequence owns are written, so any read of an unused block, a padding entry or the unwritten tail of a
partial block shows up as a non-finite or wrong output. Shapes stay tiny: interpret mode is slow.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pulseinfer_jax.pallas_kernels.sparse_decode_attention as sda_kernel
import pytest
from jax.experimental import pallas as pl
from pulseinfer_jax.pallas_kernels.merge import merge_attention_partials
from pulseinfer_jax.pallas_kernels.sparse_decode_attention import (
    sparse_decode_attention,
    sparse_decode_attention_reference,
)

from pulseinfer_jax.kv import quant as kv_quant
from pulseinfer_jax.runner.paged_attention import paged_decode_attention

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


@dataclasses.dataclass
class Case:
    q: jax.Array  # [B, Hq, hd]
    pool: jax.Array  # [NB, 2, bs, Hkv, hd], NaN outside written slots
    tables: list[np.ndarray]  # per sequence: its physical blocks in logical order
    lengths: list[int]  # per sequence: tokens


def _make_case(rng, lengths, *, hkv, group, hd, bs, dtype, spare_blocks=3) -> Case:
    """Sequences of `lengths` tokens in shuffled physical blocks of a NaN-filled pool (block 0 unused)."""
    nblk = [-(-n // bs) for n in lengths]
    nb = 1 + sum(nblk) + spare_blocks
    perm = rng.permutation(np.arange(1, nb))
    pool = np.full((nb, 2, bs, hkv, hd), np.nan, np.float32)
    tables, used = [], 0
    for n, c in zip(lengths, nblk, strict=True):
        table = perm[used:used + c]
        used += c
        for j, blk in enumerate(table):
            fill = min(bs, n - j * bs)
            pool[blk, :, :fill] = rng.standard_normal((2, fill, hkv, hd))
        tables.append(table)
    q = rng.standard_normal((len(lengths), hkv * group, hd)).astype(np.float32)
    return Case(jnp.asarray(q, dtype), jnp.asarray(pool, dtype), tables, list(lengths))


def _block_lens(case: Case, b: int, logical: np.ndarray, bs: int) -> np.ndarray:
    return np.minimum(bs, case.lengths[b] - logical * bs).astype(np.int32)


def _dense_lists(case: Case, bs: int) -> tuple[np.ndarray, np.ndarray]:
    """Every block of each sequence in logical order, -1 padded: [B, 1, K] ids and lens."""
    k = max(len(t) for t in case.tables)
    ids = np.full((len(case.tables), 1, k), -1, np.int32)
    lens = np.zeros_like(ids)
    for b, table in enumerate(case.tables):
        ids[b, 0, :len(table)] = table
        lens[b, 0, :len(table)] = _block_lens(case, b, np.arange(len(table)), bs)
    return ids, lens


def _sparse_lists(rng, case: Case, bs: int, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per (sequence, row) a random non-empty subset of the sequence's blocks in random order, with -1
    padding entries scattered among them: [B, rows, k] ids and lens (0 for padding)."""
    ids = np.full((len(case.tables), rows, k), -1, np.int32)
    lens = np.zeros_like(ids)
    for b, table in enumerate(case.tables):
        for r in range(rows):
            n_sel = rng.integers(1, min(len(table), k) + 1)
            logical = rng.choice(len(table), n_sel, replace=False)
            where = np.sort(rng.choice(k, n_sel, replace=False))  # padding lands between entries
            ids[b, r, where] = table[logical]
            lens[b, r, where] = _block_lens(case, b, logical, bs)
    return ids, lens


def _oracle(q, pool, ids, lens, scale=None):
    """float64 NumPy loops over exactly the listed tokens: (o [B, Hq, hd], m [B, Hq], l [B, Hq])."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    pool = np.asarray(pool.astype(jnp.float32), np.float64)
    b_, hq, hd = q.shape
    hkv = pool.shape[3]
    g = hq // hkv
    scale = hd ** -0.5 if scale is None else scale
    o = np.zeros((b_, hq, hd))
    m = np.full((b_, hq), -np.inf)
    l = np.zeros((b_, hq))  # noqa: E741
    for b in range(b_):
        for h in range(hkv):
            r = h if ids.shape[1] == hkv else 0
            keys = [pool[i, 0, :n, h] for i, n in zip(ids[b, r], lens[b, r], strict=True) if i >= 0 and n > 0]
            vals = [pool[i, 1, :n, h] for i, n in zip(ids[b, r], lens[b, r], strict=True) if i >= 0 and n > 0]
            if not keys:
                continue
            k, v = np.concatenate(keys), np.concatenate(vals)
            s = q[b, h * g:(h + 1) * g] @ k.T * scale  # [G, T]
            mx = s.max(-1)
            p = np.exp(s - mx[:, None])
            m[b, h * g:(h + 1) * g] = mx
            l[b, h * g:(h + 1) * g] = p.sum(-1)
            o[b, h * g:(h + 1) * g] = (p @ v) / p.sum(-1)[:, None]
    return o, m, l


def _assert_close(got, want, dtype, tol=None):
    tol = TOL[dtype] if tol is None else tol
    o, m, l = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in got)  # noqa: E741
    assert np.isfinite(o).all(), "output has NaN/inf: a masked or unused slot leaked in"
    np.testing.assert_allclose(o, want[0], atol=tol, rtol=tol)
    np.testing.assert_allclose(m, want[1], atol=tol, rtol=tol)
    np.testing.assert_allclose(l, want[2], atol=tol, rtol=tol)


def _run(case, ids, lens, **kw):
    return sparse_decode_attention(case.q, case.pool, jnp.asarray(ids), jnp.asarray(lens), **kw)


# Each block size, group size, head_dim, dtype and list layout appears at least once.
@pytest.mark.parametrize("dtype,bs,group,hd,headwise", [
    (jnp.float32, 16, 4, 64, False),
    (jnp.bfloat16, 16, 2, 128, True),
    (jnp.float32, 8, 8, 64, True),
    (jnp.bfloat16, 32, 1, 64, False),
    (jnp.float32, 32, 2, 128, True),
    (jnp.bfloat16, 8, 4, 128, False),
])
def test_sparse_lists_match_oracle_and_reference(dtype, bs, group, hd, headwise):
    rng = np.random.default_rng([bs, group, hd, headwise, dtype == jnp.float32])
    hkv = 2
    case = _make_case(rng, [1, bs - 1, bs, bs + 1, 4 * bs + 3], hkv=hkv, group=group, hd=hd, bs=bs,
                      dtype=dtype)
    ids, lens = _sparse_lists(rng, case, bs, rows=hkv if headwise else 1, k=7)
    want = _oracle(case.q, case.pool, ids, lens)
    _assert_close(_run(case, ids, lens), want, dtype)
    ref = sparse_decode_attention_reference(case.q, case.pool, jnp.asarray(ids), jnp.asarray(lens))
    _assert_close(ref, want, dtype)


def test_all_blocks_listed_is_dense_decode():
    """Boundary lengths incl. 513 tokens (33 blocks, auto split-K), against NumPy and the engine's jnp path."""
    rng = np.random.default_rng(513)
    bs, hkv, group, hd = 16, 2, 2, 64
    case = _make_case(rng, [1, 15, 16, 17, 513], hkv=hkv, group=group, hd=hd, bs=bs, dtype=jnp.float32)
    ids, lens = _dense_lists(case, bs)
    o, m, l = _run(case, ids, lens)  # noqa: E741
    _assert_close((o, m, l), _oracle(case.q, case.pool, ids, lens), jnp.float32)

    tables = np.where(ids[:, 0] >= 0, ids[:, 0], 0)  # the jnp path pads tables with block 0 (NaN here)
    dense = paged_decode_attention(case.q, case.pool[None], jnp.int32(0), jnp.asarray(tables),
                                   jnp.asarray(case.lengths, jnp.int32))
    np.testing.assert_allclose(np.asarray(o), np.asarray(dense), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("headwise", [False, True])
def test_split_k_and_step_size_do_not_change_the_result(headwise):
    rng = np.random.default_rng(7 + headwise)
    bs, hkv = 8, 2
    case = _make_case(rng, [9 * bs + 5, 3 * bs], hkv=hkv, group=2, hd=64, bs=bs, dtype=jnp.float32)
    ids, lens = _sparse_lists(rng, case, bs, rows=hkv if headwise else 1, k=12)
    want = _oracle(case.q, case.pool, ids, lens)
    base = _run(case, ids, lens, split_k=1, blocks_per_step=2)
    _assert_close(base, want, jnp.float32)
    for kw in ({"split_k": 2, "blocks_per_step": 2}, {"split_k": 4, "blocks_per_step": 2},
               {"split_k": 2, "blocks_per_step": 4}):
        got = _run(case, ids, lens, **kw)
        for x, y in zip(got, base, strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-6, rtol=2e-6, err_msg=str(kw))


@pytest.mark.parametrize("headwise,f8", [(False, False), (True, False), (False, True), (True, True)])
def test_the_merge_inside_the_kernel_equals_the_merge_after_it(headwise, f8):
    """Several splits merged by the last program of each (sequence, KV head) to arrive (`merge="inside"`, the
    default) against the XLA merge after the kernel and the oracle: shuffled NaN-poisoned pools, a sequence whose
    later splits are all padding (empty partials), float8 too. The arrival counters come back 0 and serve the next
    call; too few counters, counters of the wrong dtype, an unknown merge are errors."""
    rng = np.random.default_rng([17, headwise, f8])
    bs, hkv, group, hd = 8, 2, 2, 32
    make = (functools.partial(_make_f8_case, q_dtype=jnp.float32) if f8
            else functools.partial(_make_case, dtype=jnp.float32))
    case = make(rng, [9 * bs + 5, 3 * bs, 1], hkv=hkv, group=group, hd=hd, bs=bs)
    ids, lens = _sparse_lists(rng, case, bs, rows=hkv if headwise else 1, k=12)
    ids[2], lens[2] = -1, 0  # the 1-token sequence: its block first, the later splits nothing but padding
    ids[2, :, 0], lens[2, :, 0] = case.tables[2][0], 1
    pool = kv_quant.unpack_blocks(case.pool, jnp.float32) if f8 else case.pool
    want = _oracle(case.q, pool, ids, lens)
    counters = jnp.zeros((3 * hkv + 5,), jnp.int32)
    for split_k in (2, 3, 4, 6):  # (unrolled up to UNROLLED_MERGE splits, a loop beyond)
        kw = dict(split_k=split_k, blocks_per_step=2)
        after = _run(case, ids, lens, merge="after", **kw)
        inside = _run(case, ids, lens, **kw)
        *given, counters = sparse_decode_attention(case.q, case.pool, jnp.asarray(ids), jnp.asarray(lens), counters,
                                                   **kw)
        assert np.all(np.asarray(counters) == 0), counters
        _assert_close(inside, want, jnp.float32)
        for got in (inside, given):
            for x, y in zip(got, after, strict=True):
                np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-6, rtol=2e-6, err_msg=str(kw))
        assert np.all(np.asarray(inside[2])[2] == 1.0)  # the 1-token sequence attended its one token
    one = sparse_decode_attention(case.q, case.pool, jnp.asarray(ids), jnp.asarray(lens), counters, split_k=1)
    assert len(one) == 4 and one[3] is not None  # (one split: the counters pass through unread)
    with pytest.raises(ValueError, match="B \\* Hkv"):
        sparse_decode_attention(case.q, case.pool, jnp.asarray(ids), jnp.asarray(lens), counters[:5], split_k=2)
    with pytest.raises(ValueError, match="int32"):
        sparse_decode_attention(case.q, case.pool, jnp.asarray(ids), jnp.asarray(lens), counters.astype(jnp.int16))
    with pytest.raises(ValueError, match="merge"):
        _run(case, ids, lens, merge="later")


def _last_to_run(order, grid):
    """Per (sequence, KV head): the split whose program runs last when interpret mode runs the grid in launch order
    under `program_order` = order, and whether that program is the last one launched in its grid row (i, h, :)."""
    b, hkv, splits = grid
    n = b * hkv * splits
    last = {}
    for launched in range(n):  # row-major launch order, as interpret mode runs it
        logical = (order[0] * launched + order[1]) % n
        last[divmod(logical // splits, hkv)] = (logical % splits, launched % splits == splits - 1)
    return last


def _gate_by_grid_index(arrivals, counter, splits, *, barrier):
    """A broken gate: the program launched last in its grid row merges, no counter."""
    return pl.program_id(2) == splits - 1


def _gate_by_split_index(order, grid):
    """A broken gate: the program of the last split merges, no counter."""
    def gate(arrivals, counter, splits, *, barrier):
        return sda_kernel._logical_program(pl.program_id(0), pl.program_id(1), pl.program_id(2), grid, order)[2] \
            == splits - 1
    return gate


@pytest.mark.parametrize("split_k", [4, 6])  # (the merge unrolled, and in a loop: > UNROLLED_MERGE)
def test_the_merge_inside_relies_on_its_arrival_counters_alone(monkeypatch, split_k):
    """Interpret mode runs the programs one at a time in grid order, where the last split of each (sequence, KV head)
    is always the last to arrive; a permuted `program_order` makes other splits arrive last. The merge inside must
    still equal the oracle and leave its counters 0, and the check must have teeth: gates that merge in the last
    program of a grid row or in the last split, instead of in the last to arrive, give wrong attention under the
    strided order (each split holds tokens: a merge that runs early misses some)."""
    rng = np.random.default_rng([23, split_k])
    bs, hkv, group, hd, bps = 8, 2, 2, 16, 2
    case = _make_case(rng, [24 * bs, 23 * bs + 5], hkv=hkv, group=group, hd=hd, bs=bs, dtype=jnp.float32)
    ids, lens = _dense_lists(case, bs)  # 24 entries: 12 steps of 2 blocks, every split some
    want = _oracle(case.q, case.pool, ids, lens)
    grid = (2, hkv, split_k)
    n = math.prod(grid)
    reverse, strided = (n - 1, n - 1), (5, 3)
    # the orders do what the test needs: some (sequence, KV head) arrives last with another split, and under the
    # strided order also in a program that is not the last of its grid row
    for order in (reverse, strided):
        assert any(s != split_k - 1 for s, _ in _last_to_run(order, grid).values())
    assert any(not row_last for _, row_last in _last_to_run(strided, grid).values())

    def run(order, **kw):
        counters = jnp.zeros((2 * hkv + 3,), jnp.int32)
        o, m, l, counters = sparse_decode_attention(case.q, case.pool, jnp.asarray(ids), jnp.asarray(lens),  # noqa: E741
                                                    counters, split_k=split_k, blocks_per_step=bps,
                                                    program_order=order, **kw)
        return (o, m, l), np.asarray(counters)

    for order in (reverse, strided):
        got, counters = run(order)
        _assert_close(got, want, jnp.float32)
        assert np.all(counters == 0), (order, counters)
    after, _ = run(strided, merge="after")  # (no counters: the XLA merge, the same order)
    _assert_close(after, want, jnp.float32)

    try:
        for gate in (_gate_by_grid_index, _gate_by_split_index(strided, grid)):
            monkeypatch.setattr(sda_kernel, "_arrived_last", gate)
            jax.clear_caches()  # (traced anew with the broken gate)
            got, _ = run(strided)
            with pytest.raises(AssertionError):
                _assert_close(got, want, jnp.float32)
            monkeypatch.undo()
    finally:
        monkeypatch.undo()
        jax.clear_caches()  # (no kernel traced with a broken gate stays cached)


@pytest.mark.parametrize("dtype,headwise", [(jnp.float32, True), (jnp.bfloat16, False)])
def test_merge_of_disjoint_parts_equals_attention_over_the_union(dtype, headwise):
    rng = np.random.default_rng([11, headwise])
    bs, hkv = 16, 2
    case = _make_case(rng, [6 * bs + 1, 2 * bs, 17], hkv=hkv, group=4, hd=64, bs=bs, dtype=dtype)
    ids, lens = _sparse_lists(rng, case, bs, rows=hkv if headwise else 1, k=6)
    part = rng.random(ids.shape) < 0.5  # disjoint split of the entries (a part may be empty for a row)
    ids_a, ids_b = np.where(part, ids, -1), np.where(part, -1, ids)
    lens_a, lens_b = np.where(part, lens, 0), np.where(part, 0, lens)
    whole = _run(case, ids, lens)
    merged = merge_attention_partials([_run(case, ids_a, lens_a), _run(case, ids_b, lens_b)])
    want = _oracle(case.q, case.pool, ids, lens)
    _assert_close(whole, want, dtype)
    _assert_close(merged, want, dtype)
    assert merged[0].dtype == dtype


def test_empty_selection_is_an_empty_partial_and_merges_cleanly():
    rng = np.random.default_rng(3)
    bs, hkv = 16, 2
    case = _make_case(rng, [40, 5], hkv=hkv, group=2, hd=64, bs=bs, dtype=jnp.float32)
    ids = np.full((2, 1, 3), -1, np.int32)
    lens = np.zeros_like(ids)
    ids[0, 0, 1] = case.tables[0][0]  # a real block listed with 0 valid tokens is empty too
    o, m, l = _run(case, ids, lens)  # noqa: E741
    assert np.all(np.asarray(m) == -np.inf) and np.all(np.asarray(l) == 0)
    assert np.all(np.asarray(o) == 0)

    full_ids, full_lens = _dense_lists(case, bs)
    full = _run(case, full_ids, full_lens)
    for parts in ([(o, m, l), full], [full, (o, m, l)], [(o, m, l), full, (o, m, l)]):
        merged = merge_attention_partials(parts)
        for x, y in zip(merged, full, strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=1e-6)
    eo, em, el = merge_attention_partials([(o, m, l), (o, m, l)])
    assert np.all(np.asarray(eo) == 0) and np.all(np.asarray(em) == -np.inf) and np.all(np.asarray(el) == 0)


def test_merge_ignores_garbage_in_empty_partials():
    o = jnp.ones((1, 2, 4))
    empty = (jnp.full((1, 2, 4), jnp.nan), jnp.full((1, 2), -jnp.inf), jnp.zeros((1, 2)))
    got = merge_attention_partials([empty, (o, jnp.zeros((1, 2)), jnp.ones((1, 2)))])
    np.testing.assert_array_equal(np.asarray(got[0]), np.ones((1, 2, 4)))
    np.testing.assert_array_equal(np.asarray(got[2]), np.ones((1, 2)))
    with pytest.raises(ValueError, match="at least one"):
        merge_attention_partials([])
    with pytest.raises(ValueError, match="partial 1"):
        merge_attention_partials([(o, jnp.zeros((1, 2)), jnp.ones((1, 2))), (o[:, :1], o[:, :1, 0], o[:, :1, 0])])


NAN8 = 0x7F  # a float8_e4m3fn NaN byte


def poison_scales(block: np.ndarray, n: int, bs: int, hd: int) -> None:
    """NaN bytes over the scales of slots n..bs-1 of a stored float8 block [2, rows, Hkv, hd] (in place)."""
    for t in range(n, bs):
        for byte in range(kv_quant.SCALE_BYTES):
            row, col = kv_quant.scale_position(t, byte, bs, hd)
            block[:, row, :, col] = NAN8


def _make_f8_case(rng, lengths, *, hkv, group, hd, bs, q_dtype, spare_blocks=2) -> Case:
    """`_make_case`'s layout in the cache's float8 storage: K and V of every block packed by `kv_quant.pack_blocks`
    (values in rows 0..bs-1, bfloat16 scales in the scale rows after them) from values whose magnitude varies per
    (token, head), so the scales differ; then the value AND scale bytes of every unwritten slot, and of every block no
    sequence owns, are NaN bytes: a read the kernel should mask shows up as a NaN or a wrong scale."""
    nblk = [-(-n // bs) for n in lengths]
    nb = 1 + sum(nblk) + spare_blocks
    perm = rng.permutation(np.arange(1, nb))
    mag = np.exp2(rng.uniform(-2, 2, (nb, 2, bs, hkv, 1)))
    pool = kv_quant.pack_blocks(jnp.asarray(rng.standard_normal((nb, 2, bs, hkv, hd)) * mag, jnp.float32),
                                jnp.float8_e4m3fn)  # [NB, 2, bs + r, Hkv, hd] uint8 (the cache's storage)
    raw = np.array(pool)
    fill = np.zeros(nb, np.int64)  # tokens written per physical block (0: unused)
    tables, used = [], 0
    for n, c in zip(lengths, nblk, strict=True):
        table = perm[used:used + c]
        used += c
        fill[table] = np.minimum(bs, n - np.arange(c) * bs)
        tables.append(table)
    for blk in range(nb):
        raw[blk, :, fill[blk]:bs] = NAN8  # values of the unwritten slots
        poison_scales(raw[blk], fill[blk], bs, hd)  # and their scales
    pool = jnp.asarray(raw)
    q = rng.standard_normal((len(lengths), hkv * group, hd)).astype(np.float32)
    return Case(jnp.asarray(q, q_dtype), pool, tables, list(lengths))


# bs == hd (two scale rows), SoloHead and headwise, bfloat16 and float32 queries
@pytest.mark.parametrize("q_dtype,bs,group,hd,headwise", [
    (jnp.float32, 8, 2, 32, False),
    (jnp.bfloat16, 16, 4, 64, True),
    (jnp.float32, 16, 1, 16, True),
    (jnp.bfloat16, 8, 2, 64, False),
])
def test_float8_pool_matches_dequantise_then_attend(q_dtype, bs, group, hd, headwise):
    """A float8 pool (values + bfloat16 scales) attends as its dequantised float32 pool: kernel against the float64
    oracle on the dequantised pool (TOL), the reference against the reference on that pool (float32 rounding).
    Entries cover lengths 0, 1, bs - 1 and bs in shuffled blocks, with -1 padding between them."""
    rng = np.random.default_rng([bs, group, hd, headwise, q_dtype == jnp.float32, 8])
    hkv = 2
    case = _make_f8_case(rng, [1, bs - 1, bs, 2 * bs + 1], hkv=hkv, group=group, hd=hd, bs=bs, q_dtype=q_dtype)
    ids, lens = _sparse_lists(rng, case, bs, rows=hkv if headwise else 1, k=5)
    pad = np.argwhere(ids < 0)[0]
    ids[tuple(pad)] = case.tables[3][0]  # a real (full) block listed with 0 tokens
    assert {0, 1, bs - 1, bs} <= set(lens[ids >= 0].tolist())
    dequantised = kv_quant.unpack_blocks(case.pool, jnp.float32)  # [NB, 2, bs, Hkv, hd], NaN where poisoned
    want = _oracle(case.q, dequantised, ids, lens)

    got = _run(case, ids, lens)
    _assert_close(got, want, q_dtype)
    assert got[0].dtype == q_dtype
    if q_dtype == jnp.float32:  # several steps and splits: the same partials as one step
        steps = _run(case, ids, lens, split_k=2, blocks_per_step=max(1, 16 // bs))
        for x, y in zip(steps, got, strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-6, rtol=2e-6)

    ref = sparse_decode_attention_reference(case.q, case.pool, jnp.asarray(ids), jnp.asarray(lens))
    _assert_close(ref, want, q_dtype)
    plain = sparse_decode_attention_reference(case.q, dequantised, jnp.asarray(ids), jnp.asarray(lens))
    tol = 1e-6 if q_dtype == jnp.float32 else 2.0 ** -8  # (float8 attends in the rotated basis: o may differ by an ulp)
    for x, y in zip(ref, plain, strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("rows,hd,match", [(10, 16, "no float8 block"), (16, 64, "block_size")])
def test_float8_pool_shape_errors(rows, hd, match):
    """A float8 pool's rows are bs plus its scale rows (no bs gives 10 rows of 16 bytes); bs a power of two."""
    q = jnp.zeros((1, 8, hd), jnp.bfloat16)
    pool = jnp.zeros((4, 2, rows, 4, hd), kv_quant.STORAGE)
    ids = jnp.zeros((1, 1, 2), jnp.int32)
    with pytest.raises(ValueError, match=match):
        sparse_decode_attention(q, pool, ids, ids)


@pytest.mark.parametrize("q_shape,pool_shape,ids_shape,kw,match", [
    ((1, 6, 64), (4, 2, 16, 4, 64), (1, 1, 2), {}, "divisible"),
    ((1, 8, 64), (4, 2, 16, 4, 32), (1, 1, 2), {}, "head_dim"),
    ((1, 8, 64), (4, 2, 16, 4, 64), (1, 2, 2), {}, "SoloHead"),
    ((2, 8, 64), (4, 2, 16, 4, 64), (1, 1, 2), {}, "batch"),
    ((1, 8, 48), (4, 2, 16, 4, 48), (1, 1, 2), {}, "power of two"),
    ((1, 8, 64), (4, 2, 12, 4, 64), (1, 1, 2), {}, "block_size"),
    ((1, 8, 64), (4, 2, 8, 4, 64), (1, 1, 2), {"blocks_per_step": 1}, "blocks_per_step"),
    ((1, 8, 64), (4, 2, 16, 4, 64), (1, 1, 2), {"split_k": 0}, "split_k"),
    ((1, 8, 64), (4, 16, 4, 64), (1, 1, 2), {}, "pool"),
])
def test_bad_inputs_raise_clear_errors(q_shape, pool_shape, ids_shape, kw, match):
    q = jnp.zeros(q_shape)
    pool = jnp.zeros(pool_shape)
    ids = jnp.zeros(ids_shape, jnp.int32)
    with pytest.raises(ValueError, match=match):
        sparse_decode_attention(q, pool, ids, ids, **kw)
