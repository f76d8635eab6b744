"""Compiled for an H200 without one: the Pallas kernels through XLA:GPU's whole pipeline (Triton, PTX for sm_90a,
ptxas), the kernels' own bounds against the real compiler, the check's verdicts and the cost model's counts.

Runs where jax's CUDA plugin is installed (`./run.sh compile-gpu` runs it in .venv-gpuc, with JAX_PLATFORMS=cpu);
skipped in the CPU-only test venv. What passing proves: the programs compile for the target and fit its launch
limits. Not what they compute on a device, how fast, or faults that only a launch shows.
"""

from __future__ import annotations

import functools
import math
import pathlib
import types

import pytest

pytest.importorskip("jax_plugins.xla_cuda13", reason="needs jax's CUDA plugin: ./run.sh compile-gpu runs this")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from pulseinfer_jax.pallas_kernels import (  # noqa: E402
    block_scoring,
    grouped_matmul,
    kept_scores,
    select_plan,
    sparse_decode_attention,
)

from bench import gather_scatter  # noqa: E402
from bench.aot import check  # noqa: E402
from bench.aot.programs import program, spec  # noqa: E402
from bench.aot.ptxas import PtxasRecorder  # noqa: E402
from bench.aot.target import CompileTarget, use_cpu_backend  # noqa: E402
from pulseinfer_jax.kv import quant as kv_quant
from pulseinfer_jax.selection import slot_plan  # noqa: E402

I32 = jnp.int32
# (pytest.mark.smoke: the kernel cases, which CI also compiles on the newest jax allowed: ./run.sh smoke-newest)


@pytest.fixture(scope="module")
def target():
    use_cpu_backend()
    # (programs compiled for the H200 target cannot be read back from the tests' compilation cache: it is off here)
    jax.config.update("jax_enable_compilation_cache", False)
    yield CompileTarget.load()
    jax.config.update("jax_enable_compilation_cache", True)


@pytest.fixture(scope="module")
def compiler(target, tmp_path_factory):
    """compile(program) -> the check's report row for it (status, kernels, cost, violations)."""
    work = tmp_path_factory.mktemp("aot")
    recorder = PtxasRecorder(work)
    return lambda prog: check.compile_one(target, recorder, prog, pathlib.Path(work))


def _kernel(fn, args, pallas, **statics):
    return program(fn.__name__, "kernel", fn, args, {**statics, "interpret": False}, pallas=(pallas,))


def _ok(row):
    assert row["status"] == "compiled", row.get("error")
    assert not row["violations"], row["violations"]
    assert row["pallas"], "no Triton kernel in the compiled program"
    return row


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3fn"])
@pytest.mark.parametrize("b,hkv,group,hd,bs,rows", [(2, 2, 4, 64, 16, 1), (1, 4, 8, 128, 8, 4), (3, 1, 1, 64, 32, 1),
                                                    (8, 8, 4, 128, 16, 1), (8, 8, 4, 128, 16, 8)])
def test_sparse_decode_attention_compiles(compiler, dtype, b, hkv, group, hd, bs, rows):
    """float8: the cache's storage (e4m3 bytes plus a scale-code row, bs + 1 rows of uint8) under bfloat16 queries."""
    q_dtype = "bfloat16" if dtype == "float8_e4m3fn" else dtype
    pool = spec((97, 2, kv_quant.block_rows(bs, hd, dtype), hkv, hd), kv_quant.storage_dtype(dtype))
    args = (spec((b, hkv * group, hd), q_dtype), pool,
            spec((b, rows, 37), I32), spec((b, rows, 37), I32))
    row = _ok(compiler(_kernel(sparse_decode_attention.sparse_decode_attention, args, "sparse_decode_attention")))
    assert row["max_shared_memory"] <= 232448
    # the paddings (query rows to 16; the 37 entries to whole splits), the kernel, and the split-K merge as
    # elementwise fusions in at most two kernels (its reductions over the splits were four); float8 too: the kernel
    # rotates q into the cache's basis and its accumulator back, so no rotation kernel runs outside it
    assert row["cost"]["launches"] <= 6, [k["name"] for k in row["kernels"]]


def test_programs_equal_but_for_their_valid_fractions_compile_once(target, tmp_path):
    """Two programs the check costs at different valid fractions are one compile: the second row names the first,
    counts no compile time, shares its fingerprint and counts fewer bytes; the groups go largest first."""
    pool = spec((97, 2, 16, 8, 128), "bfloat16")
    args = (spec((8, 32, 128), "bfloat16"), pool, spec((8, 1, 37), I32), spec((8, 1, 37), I32))
    fn, name = sparse_decode_attention.sparse_decode_attention, "sparse_decode_attention"
    full, sparse = (program(fn.__name__, "kernel", fn, args, {"interpret": False}, pallas=(name,),
                            valid=((name, v),)) for v in (0.9, 0.1))
    small = _kernel(fn, (spec((1, 32, 128), "bfloat16"), pool, spec((1, 1, 37), I32), spec((1, 1, 37), I32)), name)
    assert full.key != sparse.key and full.compile_key == sparse.compile_key != small.compile_key
    progs = {p.key: p for p in (small, full, sparse)}
    assert sorted(check._compile_order(progs, list(progs))) == sorted([[small.key], [full.key, sparse.key]])
    sized = {k: types.SimpleNamespace(compile_key=c, size=n) for k, c, n in (("a", "x", 1), ("b", "y", 9),
                                                                               ("c", "x", 1))}
    assert check._compile_order(sized, ["a", "b", "c"]) == [["b"], ["a", "c"]]
    rows = check.compile_group(target, PtxasRecorder(tmp_path), [full, sparse], tmp_path)
    assert [r["status"] for r in rows] == ["compiled"] * 2 and rows[0]["compile_s"] > 0
    assert rows[1]["compiled_as"] == full.key and rows[1]["compile_s"] == 0 and "compiled_as" not in rows[0]
    assert rows[1]["fingerprint"] == rows[0]["fingerprint"]
    assert rows[1]["cost"]["bytes"] < rows[0]["cost"]["bytes"]


@pytest.mark.smoke
@pytest.mark.parametrize("bs,hd", [(16, 128), (8, 64)])
def test_float8_pool_under_float32_queries_compiles_without_spills(compiler, bs, hd):
    """float32 queries over a float8 pool compute in float32: one software-pipelining stage by default (two spill
    ~400 bytes of registers at these tiles)."""
    args = (spec((4, 32, hd), "float32"), spec((97, 2, bs + 1, 8, hd), kv_quant.STORAGE), spec((4, 1, 37), I32),
            spec((4, 1, 37), I32))
    _ok(compiler(_kernel(sparse_decode_attention.sparse_decode_attention, args, "sparse_decode_attention")))


@pytest.mark.parametrize("dtype,bs,hd", [("bfloat16", 16, 128), ("float32", 16, 128), ("bfloat16", 8, 64),
                                         ("bfloat16", 32, 128)])
def test_blocks_per_step_bound_is_the_compilers(compiler, dtype, bs, hd):
    """The largest blocks_per_step the kernel allows compiles; twice it is refused by the public function and, forced
    through the private call, by the compiler (shared memory over the limit): the bound is neither loose nor tight
    by a factor of two."""
    itemsize = jnp.dtype(dtype).itemsize
    most = sparse_decode_attention.max_blocks_per_step(bs, hd, itemsize)
    q, pool = spec((4, 8, 16, hd), dtype), spec((257, 2, bs, 8, hd), dtype)
    ids = spec((4, 1, 4 * most), I32)

    def forced(p):
        call = functools.partial(sparse_decode_attention._sparse_decode_call, scale=0.1, split_k=1, blocks_per_step=p,
                                 num_warps=8 if p * bs * hd >= 8192 else 4, num_stages=2, interpret=False)
        return program("_sparse_decode_call", "kernel", jax.jit(call), (q, pool, ids, ids))

    assert compiler(forced(most))["status"] == "compiled"
    row = compiler(forced(2 * most))
    assert row["status"] == "rejected" and "hared memory" in row["error"], row
    qa = jnp.zeros((4, 64, hd), dtype)
    with pytest.raises(ValueError, match="blocks_per_step"):
        sparse_decode_attention.sparse_decode_attention.trace(
            qa, jax.ShapeDtypeStruct(pool.shape, pool.dtype), jax.ShapeDtypeStruct(ids.shape, I32),
            jax.ShapeDtypeStruct(ids.shape, I32), blocks_per_step=2 * most, interpret=False)


@pytest.mark.parametrize("group,hd,k,per_head,meta_dtype,beta,m", [
    (3, 64, 300, True, "float32", 1.0, 1), (8, 128, 37, False, "float32", 1.0, 1),
    (4, 128, 64, False, "bfloat16", 1.0, 1), (4, 128, 2048, True, "bfloat16", 0.5, 1),
    (4, 128, 2048, True, "bfloat16", 0.5, 2), (3, 64, 40, False, "float32", 0.5, 4),
    (4, 128, 2048, True, "float8_e4m3fn", 0.5, 1), (4, 128, 2048, True, "float8_e4m3fn", 0.5, 2)])
@pytest.mark.smoke
def test_block_scores_compiles_without_spills(compiler, group, hd, k, per_head, meta_dtype, beta, m):
    meta = spec((16 * k * m, 8, hd), meta_dtype)
    args = (spec((16, 8 * group, hd), "bfloat16"), meta, meta, spec((16, k), I32))
    _ok(compiler(_kernel(block_scoring.block_scores, args, "block_scores", per_head=per_head, beta=beta,
                         sub_blocks=m)))


@pytest.mark.parametrize("group,hd,per_head,meta_dtype,m,kv_dtype", [
    (4, 128, True, "float8_e4m3fn", 1, "bfloat16"), (4, 128, True, "float8_e4m3fn", 2, "float8_e4m3fn"),
    (4, 128, False, "bfloat16", 1, "bfloat16"), (3, 64, True, "float32", 4, "float32")])
@pytest.mark.smoke
def test_append_and_score_is_one_kernel_updating_the_bounds_in_place(compiler, group, hd, per_head, meta_dtype, m,
                                                                     kv_dtype):
    """Decode's scoring with the new keys joining their bounds (`block_scoring.append_and_score`; a float8 cache's
    keys dequantised and rotated back inside), the bounds donated as the layer call donates them: one Triton kernel,
    no spills, the bounds aliased (no copy of them), reading the candidates' rows, one key per (sequence, head) of
    the cache and writing back only the appended rows."""
    b, k, bs = 16, 2048, 16
    meta = spec((b * k * m, 8, hd), meta_dtype)
    pool = spec((32 * 1000, 2, kv_quant.block_rows(bs, hd, kv_dtype), 8, hd), kv_quant.storage_dtype(kv_dtype))
    app = block_scoring.KeyAppend(spec((b,), I32), spec((b,), I32), spec((b,), I32))
    args = (spec((b, 8 * group, hd), "bfloat16"), meta, meta, spec((b, k), I32), spec((), I32), app, pool,
            spec((), I32))
    fn = jax.jit(functools.partial(block_scoring.append_and_score, per_head=per_head, beta=0.5, sub_blocks=m,
                                   interpret=False), donate_argnums=(1, 2))
    row = _ok(compiler(program("append_and_score", "kernel", fn, args, pallas=("block_scores",))))
    assert row["cost"]["launches"] == 1, [kr["name"] for kr in row["kernels"]]
    item = jnp.dtype(meta_dtype).itemsize
    assert row["memory"]["alias"] == 2 * b * k * m * 8 * hd * item
    assert row["cost"]["bytes"] <= 2 * b * k * m * 8 * hd * item * 1.1


@pytest.mark.smoke
@pytest.mark.parametrize("dtype,bs,hkv,hd", [("bfloat16", 16, 8, 128), ("float32", 8, 3, 64),
                                           ("uint8", 17, 8, 128)])  # uint8: a float8 cache's blocks, bs 16 + scales
def test_gather_scatter_compile(compiler, dtype, bs, hkv, hd):
    pool = spec((100, 2, bs, hkv, hd), dtype)
    idx = spec((37,), I32)
    for fn, args in ((gather_scatter.gather_blocks, (pool, idx)),
                     (gather_scatter.scatter_blocks, (pool, idx, spec((37, 2, bs, hkv, hd), dtype))),
                     (gather_scatter.gather_block_heads, (pool, idx, idx)),
                     (gather_scatter.scatter_block_heads, (pool, idx, idx, spec((37, 2, bs, hd), dtype)))):
        _ok(compiler(_kernel(fn, args, fn.__name__)))


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("tile", [16, 128])
def test_grouped_matmul_compiles_without_spills(compiler, dtype, axis, tile):
    """Qwen3-30B-A3B's expert shapes (gate_up [d, E, 2f] on axis 1, down [E, f, d] on axis 0)."""
    k, n = (2048, 1536) if axis == 1 else (768, 2048)
    w = spec((128, k, n) if axis == 0 else (k, 128, n), dtype)
    args = (spec((24 * tile, k), dtype), w, spec((24,), I32))
    _ok(compiler(_kernel(grouped_matmul.grouped_matmul, args, "grouped_matmul", tile_m=tile, expert_axis=axis)))


@pytest.mark.smoke
def test_an_interpreted_kernel_fails_the_check(compiler):
    """A Pallas call left in interpret mode compiles (to a loop of XLA ops) but is not a GPU kernel: the check
    says so, even for a program not in the default configuration."""
    args = (spec((2, 8, 64), "bfloat16"), spec((9, 2, 16, 2, 64), "bfloat16"), spec((2, 1, 5), I32),
            spec((2, 1, 5), I32))
    p = program("sparse_decode_attention", "kernel", sparse_decode_attention.sparse_decode_attention, args,
                {"interpret": True}, pallas=("sparse_decode_attention",), default=False)
    row = compiler(p)
    assert row["status"] == "compiled"
    assert check.verdict(row) and "interpret mode" in check.verdict(row)


def _cost(compiler, fn, *args, donate=()):
    row = compiler(program("f", "test", jax.jit(fn, donate_argnums=donate), args))
    assert row["status"] == "compiled", row.get("error")
    return row["cost"]


def test_cost_of_an_elementwise_kernel(compiler):
    c = _cost(compiler, lambda x: x * 2 + 1, spec((1 << 20,), "bfloat16"))
    assert c["bytes"] == 2 * (1 << 21)  # read once, written once
    assert c["launches"] == 1


def test_cost_of_a_dynamic_slice_is_the_slice(compiler):
    """Reading one row of a [1024, 4096] table costs the row, not the table (XLA's generic count charges it all)."""
    c = _cost(compiler, lambda t, i: jax.lax.dynamic_index_in_dim(t, i, keepdims=False) * 3,
              spec((1024, 4096), "float32"), spec((), I32))
    assert c["bytes"] <= 4 * 4096 * 2 + 64


def test_cost_of_an_in_place_update_is_the_update(compiler):
    c = _cost(compiler, lambda cache, i, u: cache.at[i].set(u), spec((4096, 1024), "bfloat16"), spec((), I32),
              spec((1024,), "bfloat16"), donate=(0,))
    assert c["bytes"] <= 4 * 1024 * 2 + 64


def test_cost_counts_a_loop_body_per_trip(compiler):
    def f(x):
        return jax.lax.fori_loop(0, 8, lambda i, v: jnp.sin(v) * 2.0, x)

    c = _cost(compiler, f, spec((1 << 20,), "float32"))
    one_pass = 2 * 4 * (1 << 20)  # read and write the 4 MiB carry
    assert 8 * one_pass <= c["bytes"] <= 9.01 * one_pass  # 8 trips, at most one copy of the carry around the loop
    assert c["launches"] >= 8


def test_cost_of_sparse_attention_is_the_listed_blocks(compiler):
    """The kernel reads only the K/V of the listed blocks, not the pool it is handed (plus q, the tables and its
    split-K partial results: f32 [splits, B, Hkv, 16, hd], 12% of the reads here)."""
    b, hkv, hd, bs, k = 4, 8, 128, 16, 64
    args = (spec((b, 32, hd), "bfloat16"), spec((4096, 2, bs, hkv, hd), "bfloat16"), spec((b, 1, k), I32),
            spec((b, 1, k), I32))
    row = compiler(_kernel(sparse_decode_attention.sparse_decode_attention, args, "sparse_decode_attention"))
    listed = b * k * 2 * bs * hkv * hd * 2
    assert listed <= row["cost"]["bytes"] <= listed * 1.25


def test_slot_plan_compiles_to_a_few_kernels_without_sorts(compiler):
    """A sparse layer's slot-cache plan and entry lists (slot_plan.layer_plan, Llama-3.1-8B at 32K x 4: budget 128
    blocks, 246 slots) compile to compare-and-count reductions, not sorts (XLA:GPU: several kernels each) and with
    the state updated in place (no copy of the [SL, R, S, C] table)."""
    b, s, n, c, sl, r, k = 4, 1, 128, 246, 30, 128, 2560
    step = slot_plan.SlotStep(rows=spec((b,), I32), capacity=spec((b,), I32), gpu=spec((b, k), I32),
                              host=spec((b, k), I32), slots=spec((b, c), I32), lengths=spec((b,), I32))
    fn = jax.jit(functools.partial(slot_plan.layer_plan, block_size=16, sink=1, window=4, mode="recall"),
                 donate_argnums=(0, 1))
    row = compiler(program("layer_plan", "kernel", fn, (spec((sl, r, s, c), I32), spec((sl, r, s, c), I32),
                                                        spec((), I32), spec((b, s, n), I32), step, spec((), I32))))
    assert row["status"] == "compiled", row.get("error")
    assert not row["violations"], row["violations"]
    names = [kr["name"] for kr in row["kernels"]]
    assert not [x for x in names if "sort" in x], names
    assert row["cost"]["launches"] <= 24, names  # 21 (33 with sorts, scatters and a per-layer slice of the table)
    table = 4 * sl * r * s * c
    assert row["cost"]["bytes"] < 2 * table  # no copy of a state table (a copy alone reads and writes it: 2x)


@pytest.mark.smoke
@pytest.mark.parametrize("select,rows,lanes", [("normalized_sum", 32, 1), ("headwise", 8, 8)])
def test_fused_selection_and_plan_is_one_kernel_without_spills(compiler, select, rows, lanes):
    """The selection and slot plan of a sparse layer (pallas_kernels/select_plan.py) at the engine's shape for
    Llama-3.1-8B at 32K x 8 (2,560 candidates, budget 128, 246 slots, 30 sparse layers), with the forced middle
    blocks the engine always passes: one Triton kernel, no register spills, the state and the cache (the spare
    fill's block copy) updated in place (no copy of either)."""
    b, k, n, c, sl, r = 8, 2560, 128, 246, 30, 9
    row, table = spec((b,), I32), spec((b, k), I32)
    state = spec((sl, r, lanes, c), I32)
    fn = functools.partial(select_plan.select_plan, budget=n, sink=1, window=4, select=select, scale=0.088,
                           bonus=0.25, block_size=16, interpret=False)
    kept = (spec((b, rows, 5), jnp.float32), spec((b, 5), I32)) if select == "normalized_sum" else None
    kv = spec((32, 7711, 2, 16, 8, 128), jnp.bfloat16)  # (the cache: the spare fill's copy, in place)
    middle = spec((sl, b, lanes, n - 5), I32)
    args = (spec((b, rows, k), jnp.float32), row, state, state, spec((), I32), row, row, table, table,
            spec((b, c), I32), row, spec((), I32), (row, row), spec((), I32), kept, kv, middle)
    got = compiler(program("select_plan", "kernel", jax.jit(fn, donate_argnums=(2, 3, 15)), args,
                           pallas=("select_plan",)))
    assert got["status"] == "compiled", got.get("error")
    assert not got["violations"], got["violations"]
    assert got["cost"]["launches"] == 1, [kr["name"] for kr in got["kernels"]]  # (a copy of a state table: 2)


@pytest.mark.smoke
@pytest.mark.parametrize("per_head,m,hq,f8", [(True, 1, 32, False), (False, 1, 32, False), (True, 2, 40, False),
                                               (True, 1, 32, True), (False, 2, 32, True)])
def test_kept_scores_is_one_kernel_reading_only_the_kept_blocks(compiler, per_head, m, hq, f8):
    """The always-kept blocks' scores (pallas_kernels/kept_scores.py) over a whole cache, flattened (Llama-3.1-8B's
    32 x 7,711 blocks; Qwen3-14B's 40 query heads, a group of 5; a float8 cache, 17 rows a block): one Triton kernel,
    no spills, and reading the listed blocks' K tiles, not the cache it is handed."""
    b, kk = 8, 5
    fn = functools.partial(kept_scores.kept_scores, per_head=per_head, beta=0.5, sub_blocks=m, scale=0.088,
                           interpret=False)
    pool = spec((32 * 7711, 2, 17, 8, 128), kv_quant.STORAGE) if f8 else spec((32 * 7711, 2, 16, 8, 128), jnp.bfloat16)
    args = (spec((b, hq, 128), jnp.bfloat16), pool, spec((b, kk), I32), spec((b, kk), I32), spec((), I32))
    row = _ok(compiler(program("kept_scores", "kernel", jax.jit(fn), args, pallas=("kept_scores",))))
    assert row["cost"]["launches"] == 1, [kr["name"] for kr in row["kernels"]]
    tiles = b * kk * 8 * 16 * (128 + 2 if f8 else 128 * 2)
    extra = b * hq * 128 * 2 + 8192 + (128 * 128 * 4 if f8 else 0)  # q, the lists, the scores (, the rotation)
    assert tiles <= row["cost"]["bytes"] <= tiles + extra


def test_tensor_parallel_steps_compile_with_megatron_all_reduces(target):
    """Two compile-only H200s on a `tp` mesh: Llama-3.1-8B's dense and offloaded decode steps compile, the Pallas
    kernels as Triton kernels per device, with the collectives tensor parallelism should need and nothing else: one
    all-reduce of [B, 1, D] after attention and one after the MLP per layer, SoloHead's [B, K] score sum per sparse
    layer, none inside the attention itself (no KV gathered), no weight gathered (the embedding table included, at
    batch 1)."""
    from bench.aot import tensor_parallel as tp_aot

    report = tp_aot.run(target.config_text, 2, points=(("llama-3.1-8b", 4096, 1),))
    rows = {(p["step"], r["function"]): r for p in report["points"] for r in p["programs"]}
    assert all(r["status"] == "compiled" for r in rows.values()), [r.get("error") for r in rows.values()]
    d = 4096 * 2  # one row of hidden states, bf16
    assert rows["dense", "_decode_layer"]["collectives"] == {"all-reduce": {"ops": 2, "bytes": 2 * d}}
    assert rows["dense", "_decode_layer"]["triton_kernels"] >= 1
    assert rows["offload", "land_attend_finish"]["collectives"] == {"all-reduce": {"ops": 2, "bytes": 2 * d}}
    pre = rows["offload", "sparse_pre"]["collectives"]
    assert set(pre) == {"all-reduce"} and pre["all-reduce"]["ops"] == 1  # the block scores, summed over devices
    assert rows["offload", "attend"]["collectives"] == {}
    # the token's embedding row from a vocabulary-split table: masked and summed (looked up as two rows), never
    # the table gathered
    looked_up = {"ops": 1, "bytes": 2 * d}
    assert rows["dense", "embed"]["collectives"] == {"all-reduce": looked_up}
    # recall ahead's one program per step: the embedding; per sparse layer the score sum, then the two of the layer;
    # two per dense layer; greedy sampling's best logit and its index from each device's share of the vocabulary
    ahead = rows["offload", "ahead_step"]["collectives"]
    sl, dl = 30, 2
    assert ahead == {"all-reduce": {"ops": 3 * sl + 2 * dl + 1, "bytes": sl * pre["all-reduce"]["bytes"]
                                    + 2 * d * (sl + dl) + looked_up["bytes"]},
                     "all-gather": {"ops": 1, "bytes": 2 * (4 + 4)}}


@pytest.mark.smoke
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_float8_tiles_load_and_dequantise_in_a_triton_kernel(target, dtype):
    """What a float8 KV cache needs of Pallas on an H200: a float8 tile loaded, converted to float32, scaled per row
    and used in a dot, compiled as a Triton kernel (no uint8 bitcast workaround needed)."""
    from jax.experimental import pallas as pl

    def kernel(q_ref, x_ref, s_ref, o_ref):
        k = x_ref[...].astype(jnp.float32) * s_ref[...]
        o_ref[...] = jax.lax.dot_general(q_ref[...], k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    def fn(q, x, s):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 64), jnp.float32), interpret=False)(q, x, s)

    args = (target.struct((16, 64), jnp.float32), target.struct((64, 64), dtype), target.struct((64, 1), jnp.float32))
    text = target.compile(target.lower(fn, *args)).as_text()
    assert 'custom_call_target="__gpu$xla.gpu.triton"' in text


@pytest.mark.parametrize("point", ["A", "D"])
def test_the_decode_step_is_one_program_of_at_most_twenty_kernels_a_layer(compiler, target, point):
    """Recall ahead's step as the engine runs it (`sparse_step.ahead_step`: every layer, logits and sampling in one
    program), whole batch, at the GPU suite's point A (8 x 32K, bfloat16 KV) and D (12 x 128K, float8 KV: its
    rotations inside the attention kernel): at most 20 kernels per layer, the attention one of them, no host transfer
    or sync, every weight read once."""
    from bench import predict

    st = predict.system_step("pulseinfer", point, predict.DEFAULT_H2D, target.sharding)
    progs = {c.program.key: c.program for calls in st.sparse.values() for c in calls
             if c.program.function == "ahead_step"}
    # (a request's first step runs the layer-wise programs: compiled at count 0, never per step)
    assert progs and not any(c.program.function in ("ahead_layer", "embed", "logits", "sample_tokens")
                             for calls in st.sparse.values() for c in calls if c.count)
    layers = st.layout.plan.num_layers
    for prog in progs.values():
        row = compiler(prog)
        assert row["status"] == "compiled", row.get("error")
        assert not row["violations"], row["violations"]
        cost = row["cost"]
        assert cost["launches"] <= 20 * layers, [k["name"] for k in row["kernels"]]
        # the sinks and window scored from their bounds, kept current by the scoring kernel: no kernel re-reads keys
        assert "kept_scores" not in " ".join(row["pallas"]) and any("_append" in n for n in row["pallas"])
        # the attention's splits merged inside its kernel, on the driver's counters (no merge fusion, no memset)
        assert any(n.startswith("sparse_decode_attention") and n.endswith("_merged") for n in row["pallas"])
        assert cost["host_syncs"] == cost["transfers"] == 0
        weights = [k for k in cost["top_kernels"] if k["name"].startswith("gemm")]
        assert len(weights) == len({k["name"] for k in weights}) and all(k["count"] == 1 for k in weights)
    # the previous step's recall lands just before it, in a program of its own (its shapes follow the recall's
    # size): one in-place scatter per sparse layer, reading the staging once and writing it once
    lands = [c.program for calls in st.sparse.values() for c in calls if c.program.function == "land_step"]
    assert lands
    for prog in lands:
        row = compiler(prog)
        assert row["status"] == "compiled" and not row["violations"], row.get("error") or row["violations"]
        staging = prog.args[1].staging
        cost = row["cost"]
        assert cost["launches"] == st.layout.plan.sparse_layers and cost["host_syncs"] == cost["transfers"] == 0
        assert cost["bytes"] <= 2 * math.prod(staging.shape) * jnp.dtype(staging.dtype).itemsize, cost["bytes"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_the_attention_call_is_one_kernel_whatever_its_splits(compiler, dtype):
    """With one split the kernel divides by l itself and stores only the G real query rows; with several the last
    program of each (sequence, KV head) merges the splits inside (its arrival counters handed in, donated): either
    way the call is that one kernel, float8's rotations included. Without counters a memset zeroes fresh ones;
    the merge after the kernel (`merge="after"`) adds two kernels."""
    b, hkv, g, hd, bs = 4, 8, 4, 128, 16
    pool = spec((97, 2, kv_quant.block_rows(bs, hd, dtype), hkv, hd), kv_quant.storage_dtype(dtype))
    args = (spec((b, hkv * g, hd), "bfloat16"), pool, spec((b, 1, 64), I32), spec((b, 1, 64), I32))

    def sparse_decode_attention_donating(q, pool, ids, lens, arrivals, **kw):
        return sparse_decode_attention.sparse_decode_attention(q, pool, ids, lens, arrivals, **kw)

    donating = jax.jit(sparse_decode_attention_donating, donate_argnames=("arrivals",),
                       static_argnames=("split_k", "interpret"))
    fn = sparse_decode_attention.sparse_decode_attention
    rows = {k: _ok(compiler(_kernel(fn, args, "sparse_decode_attention", split_k=k))) for k in (1, 2, 4)}
    rows["after"] = _ok(compiler(_kernel(fn, args, "sparse_decode_attention", split_k=2, merge="after")))
    rows["counters"] = _ok(compiler(program("sparse_decode_attention_donating", "kernel", donating,
                                            (*args, spec((b * hkv + 3,), I32)), {"split_k": 4, "interpret": False},
                                            pallas=("sparse_decode_attention",))))
    names = {k: [x["name"] for x in r["kernels"]] for k, r in rows.items()}
    launches = {k: r["cost"]["launches"] for k, r in rows.items()}
    assert launches == {1: 1, 2: 2, 4: 2, "after": 3, "counters": 1}, names
    assert any("_merged" in n for n in rows["counters"]["pallas"]), rows["counters"]["pallas"]
