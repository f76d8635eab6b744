"""What `./run.sh compile-gpu` compiles: every GPU program of the engine at the shapes it makes them, plus the
Pallas kernels at their benchmarks' shapes, the start-up probes, and planted programs the compiler must reject.

Models (random weights, bf16, as Specs: no weights are built): Llama-3.1-8B, Qwen3-14B, Qwen3-30B-A3B (the 128K
presets, YaRN, for 128K contexts). Points: batch 1, 8, 64 x context 4K, 32K, 128K; dense decode where the KV fits
the GPU (layer-wise, Pallas attention: the GPU default), one prompt's prefill per context, offloaded decode at
32K and 128K with a 2,048-token budget (1,024 and 4,096 at batch 8 / 32K), each at a typical recall (a quarter
of the budget missing, the IOAA prior) and the largest. The throughput bench's systems (every ablation) at its
two GPU points (bench/gpu_suite.sh: 32K x 8 and 128K x 4 on Llama-3.1-8B), and the measured H200 dense rows' exact
configuration (scan + jnp attention, bench/dense_decode.py's shapes) for the cost model's calibration.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from pulseinfer_jax.models.config import ModelConfig
from pulseinfer_jax.models.presets import PRESETS
from pulseinfer_jax.pallas_kernels import (
    block_scoring,
    grouped_matmul,
    kept_scores,
    select_plan,
    sparse_decode_attention,
)

from bench import gather_scatter
from bench.aot import catalogue as cat
from bench.aot.programs import PLACED, Call, Program, program, spec
from pulseinfer_jax.config import EngineConfig
from pulseinfer_jax.kv import quant as kv_quant
from pulseinfer_jax.kv.blocks import blocks_for, bucket

I32 = jnp.int32
BF16 = jnp.bfloat16
HBM_FOR_KV = 0.85  # the engine's default cap: 85% of the free device memory (after the weights)
CLIENT_MEMORY = 0.75  # of the GPU's memory, what jax's client allocates by default (XLA_PYTHON_CLIENT_MEM_FRACTION)
NEW_TOKENS = 256  # tokens each request may still generate (reserved by the scheduler)
MODELS = {"llama-3.1-8b": "llama-3.1-8b", "qwen3-14b": "qwen3-14b-128k", "qwen3-30b-a3b": "qwen3-30b-a3b-128k"}
BATCHES = (1, 8, 64)
CONTEXTS = (4096, 32768, 131072)
# one switch off the default each (EngineConfig fields, or the backends a GPU engine resolves), compiled at
# Llama-3.1-8B 32K x 8, budget 2,048: every program kind an engine can be configured to run
ABLATIONS = {
    "headwise": (dict(selection="headwise"), {}),
    "fragmented": (dict(io="fragmented"), {}),
    "per-head-offloading": (dict(selection="headwise", io="fragmented", recall="sync", micro_batches=1), {}),
    "sync": (dict(recall="sync", micro_batches=1), {}),
    "eager": (dict(recall="eager"), {}),
    "same-layer": (dict(recall="interruptible"), {}),  # the plan read in the layer, two micro-batches
    "one-micro-batch": (dict(recall="interruptible", micro_batches=1), {}),
    "min-reuse": (dict(slot_cache_blocks=123), {}),  # one step's selection: 128 - 1 sink - 4 window blocks
    "device-placement": (dict(offload_placement="device"), {}),
    "sub-blocks-2": (dict(score_sub_blocks=2), {}),
    "two-level": (dict(score_coarse_group=16, score_coarse_keep=4.0), {}),
    "bounds-kv": (dict(score_bounds_dtype="kv"), {}),
    "numpy-io": ({}, {"host_io": "numpy"}),
    "jnp-attention": ({}, {"attention": "jnp"}),
    "kv-float8": (dict(kv_dtype="float8_e4m3fn"), {}),  # float8 KV: half the bytes per block, its scales inside
}
ABLATION_POINT = (32768, 8, 2048)  # context, batch, budget
# the switches that change an offloaded prompt's prefill (placement, key bounds, host I/O); the others' is the default's
PREFILL_ABLATIONS = ("device-placement", "sub-blocks-2", "two-level", "bounds-kv", "numpy-io", "kv-float8")


@dataclasses.dataclass(frozen=True)
class Suite:
    """The programs (deduplicated by key) and, per named step, its calls (bench/predict.py composes them)."""

    programs: dict[str, Program]
    steps: dict[str, list[Call]]

    def add(self, name: str, calls: list[Call]) -> None:
        for c in calls:
            self.programs.setdefault(c.program.key, c.program)
        self.steps[name] = [Call(self.programs[c.program.key], c.count) for c in calls]


def model_config(name: str, context: int) -> ModelConfig:
    preset = MODELS.get(name, name) if context > 40960 else name
    return ModelConfig.from_hf_dict(PRESETS[preset], name=preset)


def engine(name: str, context: int, config: EngineConfig, **backends) -> cat.EngineShapes:
    return cat.EngineShapes.of(model_config(name, context), BF16, config, **backends)


def ablation(name: str, context: int, config: EngineConfig, **backends) -> cat.EngineShapes:
    """An engine off the default configuration (its programs' spills are reported, not failures)."""
    return engine(name, context, config, default=False, **backends)


def prompt_for(cfg: ModelConfig, context: int, new: int = NEW_TOKENS) -> int:
    """The prompt length that leaves `new` tokens below the model's maximum positions."""
    return min(context, cfg.max_position_embeddings - new)


def kv_cap(cfg: ModelConfig, hbm: int) -> int:
    """The GPU bytes an engine gives its KV (pool + offload metadata) on a GPU of `hbm` bytes
    holding the bf16 weights: 85% of what jax's client has left (Engine._kv_byte_cap)."""
    return int(HBM_FOR_KV * (CLIENT_MEMORY * hbm - 2 * cfg.num_parameters()))


def dense_fits(cfg: ModelConfig, batch: int, tokens: int, hbm: int) -> bool:
    """Whether `batch` dense requests of `tokens` tokens fit the GPU next to the weights (else the engine would
    queue some of them: not a dense point)."""
    return batch * tokens * cfg.kv_bytes_per_token(2) <= kv_cap(cfg, hbm)


def offload_layout(es: cat.EngineShapes, prompts: list[int], hbm: int, new: int = NEW_TOKENS) -> cat.SparseLayout:
    """`prompts` submitted together and offloaded, pools sized under an H200's KV cap (`kv_cap`); as many as fit
    there (the admission would let the rest wait)."""
    cap = kv_cap(es.model.cfg, hbm)
    for n in range(len(prompts), 0, -1):
        try:
            return cat.SparseLayout.of(es, prompts, new, offloaded=list(range(n)), cap_bytes=cap)
        except ValueError:
            continue
    raise ValueError(f"not one {prompts[0]}-token request of {es.name} fits offloaded in {cap} bytes")


def offload_step(es: cat.EngineShapes, prompts: list[int], recall: int, *, shardings, hbm: int,
                 micro_batches: int = 2) -> list[Call]:
    """One decode step of `prompts` offloaded (as many as fit an H200), at `recall` misses per layer."""
    layout = offload_layout(es, prompts, hbm)
    return cat.sparse_decode(es, layout, recall, shardings=shardings, micro_batches=micro_batches)


def gpu_micro_batches(config: EngineConfig) -> int:
    """The micro-batches a GPU engine of `config` splits its offloaded batch into (backends.plan_backends)."""
    from pulseinfer_jax.backends import plan_backends

    return plan_backends(config, "gpu").micro_batches


def typical_recall(es: cat.EngineShapes, batch: int, micro_batches: int) -> tuple[int, int]:
    """(typical, largest) misses per sparse layer and micro-batch: a quarter of the middle budget (IOAA's prior
    miss fraction) and all of it."""
    cfg = es.config
    middle = cfg.budget_blocks - cfg.offload.sink_blocks - cfg.window_blocks
    lanes = es.model.cfg.num_kv_heads if cfg.ablation.selection == "headwise" else 1
    per_mb = -(-batch // max(1, min(micro_batches, batch)))
    return max(1, per_mb * lanes * middle // 4), per_mb * lanes * middle


def engine_points(suite: Suite, *, shardings, hbm: int, quick: bool = False) -> None:
    """Default-configuration steps of every model at every (batch, context) bucket."""
    models = ["llama-3.1-8b"] if quick else list(MODELS)
    prefilled: set[tuple[str, int]] = set()  # (model, context) whose offloaded prefill is in
    batches = (1, 8) if quick else BATCHES
    contexts = (4096, 32768) if quick else CONTEXTS
    for name in models:
        for ctx in contexts:
            base = EngineConfig.of(max_batch=max(BATCHES), budget_tokens=2048)
            es = engine(name, ctx, base)
            prompt = prompt_for(es.model.cfg, ctx)
            suite.add(f"{name}/prefill/{ctx}", cat.prefill(es, prompt, blocks_for(prompt + NEW_TOKENS, 16)))
            for b in batches:
                if dense_fits(es.model.cfg, b, prompt + NEW_TOKENS, hbm):
                    suite.add(f"{name}/dense/{ctx}x{b}", cat.dense_decode(es, [prompt] * b, NEW_TOKENS))
                if ctx < 32768:
                    continue
                budgets = (1024, 2048, 4096) if (b == 8 and ctx == 32768) else (2048,)
                for budget in budgets:
                    sparse = engine(name, ctx, EngineConfig.of(mode="offload", max_batch=max(BATCHES),
                                                            budget_tokens=budget))
                    typical, largest = typical_recall(sparse, b, gpu_micro_batches(sparse.config))
                    layout = offload_layout(sparse, [prompt] * b, hbm)
                    for recall in ((typical, largest) if b == 8 else (typical,)):
                        suite.add(f"{name}/offload/{ctx}x{b}/budget{budget}/recall{recall}",
                                  cat.sparse_decode(sparse, layout, recall, shardings=shardings,
                                                    micro_batches=gpu_micro_batches(sparse.config)))
                    suite.add(f"{name}/offload/{ctx}x{b}/budget{budget}/alloc",
                              cat.allocations(sparse, shardings, layout))
                    if (name, ctx) not in prefilled:  # (other layouts change only the pool's size)
                        prefilled.add((name, ctx))
                        suite.add(f"{name}/offload/{ctx}x{b}/budget{budget}/prefill",
                                  cat.offloaded_prefill(sparse, layout, prompt, shardings=shardings))


def ablation_points(suite: Suite, *, shardings, hbm: int, quick: bool = False) -> None:
    """Every ABLATIONS switch at ABLATION_POINT (offloaded decode; the prompt's prefill where the switch changes it),
    plus the dense step's other
    layer loop and attention, and the mixture-of-experts model's grouped expert kernels."""
    ctx, b, budget = ABLATION_POINT
    names = ["per-head-offloading", "numpy-io"] if quick else list(ABLATIONS)
    for name in names:
        over, backends = ABLATIONS[name]
        cfg = EngineConfig.of(mode="offload", max_batch=max(BATCHES), budget_tokens=budget, **over)
        es = ablation("llama-3.1-8b", ctx, cfg, **backends)
        mbs = gpu_micro_batches(cfg)
        typical, _ = typical_recall(es, b, mbs)
        layout = offload_layout(es, [ctx] * b, hbm)
        suite.add(f"ablation/{name}/offload/{ctx}x{b}",
                  cat.sparse_decode(es, layout, typical, shardings=shardings, micro_batches=mbs))
        if name in PREFILL_ABLATIONS:
            suite.add(f"ablation/{name}/prefill/{ctx}", cat.offloaded_prefill(es, layout, ctx, shardings=shardings))
    # IOAA's mixed placements (mode auto, the default: engine): 4 dense-placed 4K requests in the offloaded
    # requests' layer pass, and their own step (an offloaded request's first step)
    mixed = engine("llama-3.1-8b", ctx, EngineConfig.of(mode="auto", max_batch=max(BATCHES), budget_tokens=budget))
    placed = [4096] * 4
    suite.add(f"mixed/offload+dense/{ctx}x{b}+{len(placed)}",
              cat.sparse_decode(mixed, offload_layout(mixed, [ctx] * b, hbm), typical_recall(mixed, b, 1)[0],
                                shardings=shardings, micro_batches=1, placed=placed)
              + [Call(c.program, 0.0) for c in cat.dense_decode(mixed, placed, NEW_TOKENS)])
    f8 = ablation("llama-3.1-8b", ctx, EngineConfig.of(kv_dtype="float8_e4m3fn"))  # the dense step over float8 KV
    suite.add(f"ablation/kv-float8/dense/{ctx}x{b}", cat.dense_decode(f8, [ctx] * b, NEW_TOKENS))
    # a preempted dense request's swap out and back (bfloat16 and float8 KV), in a cache of the whole batch
    for es in (engine("llama-3.1-8b", ctx, EngineConfig()), f8):
        per = blocks_for(ctx + NEW_TOKENS, es.config.block_size)
        suite.add(f"preemption/swap-{jnp.dtype(es.kv_dtype).name}/{ctx}", cat.swap_programs(es, b * per + 1, per))
    # a preempted offloaded request's swap (its steady GPU blocks; bfloat16 and float8 KV), in the offloaded
    # batch's cache
    off = EngineConfig.of(mode="offload", max_batch=max(BATCHES), budget_tokens=budget)
    for es in (engine("llama-3.1-8b", ctx, off), ablation("llama-3.1-8b", ctx, off.with_settings(
            kv_dtype="float8_e4m3fn"))):
        layout = offload_layout(es, [ctx] * b, hbm)
        suite.add(f"preemption/swap-offload-{jnp.dtype(es.kv_dtype).name}/{ctx}x{b}",
                  cat.swap_programs(es, layout.num_gpu_blocks, layout.plan.gpu_blocks(ctx + NEW_TOKENS), "offload"))
    for loop, att in (("scan", "pallas"), ("scan", "jnp"), ("layerwise", "jnp")):
        es = ablation("llama-3.1-8b", ctx, EngineConfig(), attention=att, layer_loop=loop)
        suite.add(f"ablation/dense-{loop}-{att}/{ctx}x{b}", cat.dense_decode(es, [ctx] * b, NEW_TOKENS))
        if not quick:
            suite.add(f"ablation/prefill-{loop}-{att}/{ctx}",
                      cat.prefill(es, ctx, blocks_for(ctx + NEW_TOKENS, 16)))
    if not quick:
        for strategy in ("grouped-pallas", "grouped", "dense", "gather"):
            es = ablation("qwen3-30b-a3b", ctx, EngineConfig.of(moe_strategy=strategy))
            suite.add(f"ablation/moe-{strategy}/dense/{ctx}x{b}", cat.dense_decode(es, [ctx] * b, NEW_TOKENS))
            suite.add(f"ablation/moe-{strategy}/prefill/{ctx}", cat.prefill(es, 4096, blocks_for(4096 + 256, 16)))


def calibration_points(suite: Suite) -> None:
    """bench/dense_decode.py's measured H200 configuration (bench/results/gpu_h200_run1): scan over stacked
    weights, jnp attention, 8 timed steps, its KV pool and tables (ctx + steps + 1 tokens per sequence)."""
    for ctx, b in ((4096, 1), (4096, 8), (4096, 32), (4096, 64), (32768, 1), (32768, 8)):
        es = ablation("llama-3.1-8b", ctx, EngineConfig(), attention="jnp", layer_loop="scan")
        per_seq = blocks_for(ctx + 9, 16)
        calls = cat.dense_decode(es, [ctx] * b, per_seq * 16 - ctx, num_blocks=b * per_seq + 1,
                                 table_width=bucket(per_seq), group="calibration")
        suite.add(f"calibration/{ctx}x{b}", calls)


# ---- kernels alone -------------------------------------------------------------------------------
def kernel_cases(suite: Suite, quick: bool = False) -> None:
    """Each Pallas kernel at bench/kernels.py's Llama-3.1-8B shapes (Hq 32, Hkv 8, hd 128, bs 16, bf16) and the
    grouped matmul at Qwen3-30B-A3B's expert shapes; the sparse decode attention also over a float8 cache (values
    and bfloat16 scales, bs + 1 rows: kv_dtype="float8_e4m3fn") at the 2,048-token budget."""
    hq, hkv, hd, bs = 32, 8, 128, 16
    f8 = jnp.float8_e4m3fn
    batches = (1, 16) if quick else (1, 4, 16, 64)
    for budget in ((2048,) if quick else (1024, 2048, 4096)):
        k = budget // bs
        for b in batches:
            nb = b * k + 1
            for rows, mode in ((1, "solohead"), (hkv, "headwise")):
                for kv, label in ((BF16, ""), (kv_quant.STORAGE, " float8")) if budget == 2048 else ((BF16, ""),):
                    pool = spec((nb, 2, kv_quant.block_rows(bs, hd, kv), hkv, hd), kv)
                    args = (spec((b, hq, hd), BF16), pool, spec((b, rows, k), I32), spec((b, rows, k), I32))
                    _kernel(suite, "sparse_decode_attention", sparse_decode_attention.sparse_decode_attention, args,
                            f"{mode} budget {budget} B {b}{label}", default=kv == BF16)
    # (label, per query head, sub-blocks, bounds dtype); the engine's default: per query head, float8, one row
    variants = [("per KV head", False, 1, BF16), ("per head", True, 1, BF16), ("per head sub2", True, 2, BF16),
                ("per head f8", True, 1, f8), ("per head sub2 f8", True, 2, f8), ("per KV head f8", False, 1, f8)]
    for ctx in ((32768,) if quick else (32768, 131072)):
        kc = ctx // bs
        for b in batches:
            for label, per_head, m, dt in variants:
                nb = b * kc + 1
                meta = spec((nb * m, hkv, hd), dt)
                args = (spec((b, hq, hd), BF16), meta, meta, spec((b, kc), I32))
                _kernel(suite, "block_scores", block_scoring.block_scores, args, f"{label} ctx {ctx} B {b}",
                        default=label in ("per head f8", "per KV head f8"), per_head=per_head, sub_blocks=m, beta=0.5)
    # the fused selection + slot plan at the engine's budgets (128 / 256 blocks, slot caches of about 2x), SoloHead
    # normalized_sum over per-query-head scores and headwise over per-KV-head ones
    for ctx in ((32768,) if quick else (32768, 131072)):
        kc = ctx // bs
        for b in ((8,) if quick else (1, 8, 24)):
            for budget, cap in ((128, 246), (256, 502)):
                for select, rows, lanes in (("normalized_sum", hq, 1), ("headwise", hkv, hkv)):
                    state = spec((32, b + 1, lanes, cap), I32)
                    row, table = spec((b,), I32), spec((b, kc), I32)
                    args = (spec((b, rows, kc), jnp.float32), row, state, state, spec((), I32), row, row, table,
                            table, spec((b, cap), I32), row, spec((), I32), (row, row), spec((), I32), None, None,
                            spec((32, b, lanes, budget - 5), I32))  # (the forced middle blocks: always passed)
                    _kernel(suite, "select_plan", select_plan.select_plan, args,
                            f"{select} budget {budget} ctx {ctx} B {b}", default=select == "normalized_sum",
                            budget=budget, sink=1, window=4, select=select, scale=0.088, bonus=0.25, block_size=bs)
    # the always-kept blocks' scores from their keys (1 sink + 4 window blocks), per query head as the engine scores
    for b in ((8,) if quick else (1, 8, 24)):
        args = (spec((b, hq, hd), BF16), spec((32 * 7711, 2, bs, hkv, hd), BF16), spec((b, 5), I32), spec((b, 5), I32),
                spec((), I32))
        _kernel(suite, "kept_scores", kept_scores.kept_scores, args, f"5 kept blocks B {b}", default=True,
                per_head=True, beta=0.5, sub_blocks=1, scale=0.088)
    pool = spec((16384, 2, bs, hkv, hd), BF16)
    for n in ((512,) if quick else (64, 512, 4096)):
        cache = spec((2 * n, 2, bs, hkv, hd), BF16)
        idx = spec((n,), I32)
        units = spec((n * hkv,), I32)
        _kernel(suite, "gather_blocks", gather_scatter.gather_blocks, (pool, idx), f"{n} blocks")
        _kernel(suite, "scatter_blocks", gather_scatter.scatter_blocks, (cache, idx, spec((n, 2, bs, hkv, hd), BF16)),
                f"{n} blocks")
        _kernel(suite, "gather_block_heads", gather_scatter.gather_block_heads, (pool, units, units),
                f"{n * hkv} units")
        _kernel(suite, "scatter_block_heads", gather_scatter.scatter_block_heads,
                (cache, units, units, spec((n * hkv, 2, bs, hd), BF16)), f"{n * hkv} units")
    f8_rows = kv_quant.block_rows(bs, hd, kv_quant.STORAGE)  # a float8 cache's blocks (bytes, scales included)
    f8_pool, f8_cache, n = spec((16384, 2, f8_rows, hkv, hd), kv_quant.STORAGE), spec((1024, 2, f8_rows, hkv, hd),
                                                                                    kv_quant.STORAGE), 512
    _kernel(suite, "gather_blocks", gather_scatter.gather_blocks, (f8_pool, spec((n,), I32)), f"{n} blocks float8")
    _kernel(suite, "scatter_blocks", gather_scatter.scatter_blocks,
            (f8_cache, spec((n,), I32), spec((n, 2, f8_rows, hkv, hd), kv_quant.STORAGE)), f"{n} blocks float8")
    d, e, f = 2048, 128, 768  # Qwen3-30B-A3B: hidden, experts, expert width
    for tile, tiles, dt in ((16, 68, BF16), (64, 40, BF16), (128, 24, BF16), (128, 24, jnp.float32)):
        tg = spec((tiles,), I32)
        _kernel(suite, "grouped_matmul", grouped_matmul.grouped_matmul,
                (spec((tiles * tile, d), dt), spec((d, e, 2 * f), dt), tg),
                f"gate_up tile {tile} {jnp.dtype(dt).name}", tile_m=tile, expert_axis=1)
        _kernel(suite, "grouped_matmul", grouped_matmul.grouped_matmul,
                (spec((tiles * tile, f), dt), spec((e, f, d), dt), tg),
                f"down tile {tile} {jnp.dtype(dt).name}", tile_m=tile, expert_axis=0)


def _kernel(suite: Suite, function: str, fn, args: tuple, case: str, default: bool = False, **statics) -> None:
    """A kernel alone; `default`: a configuration the engine picks by default (a spill there fails the check)."""
    p = program(function, "kernel", fn, args, {**statics, "interpret": False}, note=case, default=default,
                pallas=(function,))
    suite.add(f"kernel/{function}/{case}", [Call(p)])


def planted(suite: Suite) -> None:
    """Programs the compiler must reject: the sparse decode kernel forced to 64 blocks (1,024 tokens) per step,
    past the public function's bound, needs ~550 KB of shared memory per block (the H200 has 227 KiB)."""
    q, pool = spec((8, 8, 16, 128), BF16), spec((4097, 2, 16, 8, 128), BF16)
    ids = spec((8, 1, 512), I32)
    call = functools.partial(sparse_decode_attention._sparse_decode_call, scale=0.088, split_k=1,
                             blocks_per_step=64, num_warps=8, num_stages=2, interpret=False)
    p = program("_sparse_decode_call", "planted", jax.jit(call), (q, pool, ids, ids), must_reject=True,
                note="shared memory over the limit")
    suite.add("planted/shared_memory", [Call(p)])


def probes(suite: Suite, *, shardings) -> None:
    """The engine's start-up probes on a GPU (offload.probe_pallas, models.moe.probe_grouped_kernel,
    host_pool.probe_host_io for the xla and the numpy backends) at their own tiny shapes."""
    from pulseinfer_jax.selection.policy import BlockScoring

    sc = BlockScoring()
    q, ids = spec((1, 4, 64), BF16), spec((1, 1, 2), I32)
    calls = [Call(program("sparse_decode_attention", "probe", sparse_decode_attention.sparse_decode_attention,
                          (q, spec((4, 2, kv_quant.block_rows(16, 64, kv), 2, 64), kv), ids, ids)))
             for kv in (BF16, kv_quant.STORAGE)]  # the model's dtype, and a float8 cache's bytes (kv_dtype)
    many = spec((2, 1, 8), I32)  # four splits merged inside the kernel, on a counter buffer
    calls += [Call(program("sparse_decode_attention", "probe", sparse_decode_attention.sparse_decode_attention,
                           (spec((2, 4, 64), BF16), spec((4, 2, kv_quant.block_rows(16, 64, kv), 2, 64), kv),
                            many, many, spec((4,), I32)), {"split_k": 4, "blocks_per_step": 1}))
              for kv in (BF16, kv_quant.STORAGE)]
    meta = spec((4 * sc.sub_blocks, 2, 64), sc.metadata_dtype(BF16))
    for per_head in sorted({False, sc.per_query_head}):
        calls.append(Call(program("block_scores", "probe", block_scoring.block_scores,
                                  (q, meta, meta, spec((1, 2), I32)),
                                  {"per_head": per_head, "beta": sc.beta, "sub_blocks": sc.sub_blocks})))
    x, tiles = spec((32, 64), BF16), spec((2,), I32)
    for axis, shape in ((0, (2, 64, 32)), (1, (64, 2, 32))):
        calls.append(Call(program("grouped_matmul", "probe", grouped_matmul.grouped_matmul,
                                  (x, spec(shape, BF16), tiles), {"tile_m": 16, "expert_axis": axis})))
    for hd, hkv in ((128, 8), (128, 4), (64, 3)):  # the models' block shapes: Llama / Qwen3-14B, Qwen3-30B, SmolLM2
        calls += host_io_probe(hkv, hd, shardings)
    suite.add("probes", calls)


def host_io_probe(hkv: int, hd: int, shardings, dtype=BF16, block_size: int = 16) -> list[Call]:
    """host_pool.probe_host_io's programs for blocks of `hkv` heads of `hd`, `block_size` tokens in `dtype` (the
    cache's storage dtype: float8's bytes take their scale rows)."""
    from pulseinfer_jax.host_offload import numpy_io, xla_io

    host, dev = shardings("pinned_host"), shardings("device")
    write, stage_blocks, stage_units, fragment, write_units = xla_io.transfers(host, dev, 1)
    rows = kv_quant.block_rows(block_size, hd, dtype)
    pool = spec((1, 4, 2, rows, hkv, hd), dtype, "pinned_host")
    kv = spec((2, 4, 2, rows, hkv, hd), dtype)
    v2, h = spec((2,), I32), "pinned_host"
    return [Call(program("write_back", "probe", write, (pool, kv, v2, v2, spec((), I32)))),
            # two blocks, then one at a time (a reused staging buffer must not show)
            *(Call(program("stage_blocks_outer", "probe", stage_blocks,
                           (pool, spec((), I32, h), spec((n,), I32, PLACED)))) for n in (2, 1)),
            Call(program("stage_units_outer", "probe", stage_units,
                         (pool, spec((), I32, h), spec((2, 2), I32, PLACED)))),
            Call(program("fragment", "probe", fragment, (pool, spec((), I32), spec((1,), I32), spec((1,), I32)))),
            Call(program("write_back_units", "probe", write_units, (pool, kv, v2, spec((), I32), v2, spec((), I32)))),
            # the numpy backends' device halves ("numpy", and "numpy-pinned": probed on a GPU with recall ahead)
            Call(program("<lambda>", "probe", numpy_io._device_gather(1), (kv, v2), tag="device_gather")),
            Call(program("_unit_gather", "probe", numpy_io._unit_gather, (kv, v2)))]


def build(*, shardings, hbm: int, quick: bool = False) -> Suite:
    """The whole suite (`quick`: a small subset, for tests). `shardings(memory_kind)` gives the compile target's
    shardings ("device" / "pinned_host"), which the host I/O programs are jitted with."""
    suite = Suite({}, {})
    kernel_cases(suite, quick)
    planted(suite)
    probes(suite, shardings=shardings)
    if not quick:
        calibration_points(suite)
    engine_points(suite, shardings=shardings, hbm=hbm, quick=quick)
    ablation_points(suite, shardings=shardings, hbm=hbm, quick=quick)
    return suite


__all__ = ["ABLATIONS", "MODELS", "Suite", "build", "bucket"]
