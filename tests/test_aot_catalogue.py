"""The ahead-of-time catalogue (bench/aot/catalogue.py) covers every program the engine compiles.

A tiny engine runs on CPU in the GPU's default configurations (layer-wise dense decode with the Pallas attention in
interpret mode; offloaded decode with SoloHead, coalesced recall, two micro-batches, pinned-host I/O) and in the
others (scan, jnp, headwise, fragmented, sync, eager, numpy I/O, mixture of experts) while jax logs every
compile; each program of the project it compiled (name and argument types) must be one the catalogue's builders
produce for the same requests. Every run preempts a request once (its KV through the swap space and back, dense or
offloaded), so programs that run only on a preemption are checked too. So a new jitted call in the engine, or a
change of its arguments' shapes, fails here until the compile check knows it.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import re

import jax
import numpy as np
import pytest
from pulseinfer_jax.models.loading import load_model

from bench.aot import catalogue as cat
from bench.aot.suite import host_io_probe
from pulseinfer_jax import EngineConfig, SamplingParams
from pulseinfer_jax.backends import plan_backends
from pulseinfer_jax.engine.core import Engine
from pulseinfer_jax.kv.blocks import blocks_for

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROMPTS = [150, 141]  # 10 and 9 blocks of 16: tables stay 16 wide while 8 tokens are generated
NEW = 8


def project_functions() -> set[str]:
    """Names of the functions defined in the project's packages (what a jitted engine program is called)."""
    names = {"<lambda>"}
    for pkg in ("pulseinfer_jax", "models", "pallas_kernels", "host_offload"):
        for f in (ROOT / pkg).rglob("*.py"):
            names |= set(re.findall(r"^\s*def (\w+)\(", f.read_text(), re.M))
    return names


class CompileLog(logging.Handler):
    """(function, argument avals) of every compile jax logs (jax_log_compiles)."""

    def __init__(self):
        super().__init__()
        self.seen: set[tuple[str, tuple[str, ...]]] = set()

    def emit(self, record: logging.LogRecord) -> None:
        m = re.match(r"Compiling jit\((.*?)\) with global shapes and types \((.*)\)\. Argument mapping",
                     record.getMessage(), re.S)
        if m:
            self.seen.add((m.group(1), tuple(re.findall(r"ShapedArray\(([a-z0-9_]+(?:<host>)?\[[0-9,]*\])",
                                                         m.group(2)))))


def engine_compiles(model, config: EngineConfig, prompts: list[int]) -> set:
    log = CompileLog()
    logger = logging.getLogger("jax")
    logger.addHandler(log)
    old = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        jax.clear_caches()  # programs compiled by earlier tests would not log again
        eng = Engine(model, config)
        rng = np.random.default_rng(0)
        reqs = [eng.make_request(i, rng.integers(1, model.cfg.vocab_size, n).tolist(),
                                 SamplingParams(max_new_tokens=NEW, ignore_eos=True)) for i, n in enumerate(prompts)]
        eng.ensure_pool(reqs)  # (Engine.run, with the youngest request preempted once every request decodes)
        for r in reqs:
            eng.submit(r)
        while eng.busy:
            running = eng.scheduler.running
            if not eng.scheduler.preemptions and len(running) == len(reqs) and min(len(r.output) for r in reqs) > 1:
                assert eng.scheduler.preempt(max(running, key=lambda r: r.index))
            for _ in eng.step():
                pass
        eng.check_drained()
        assert eng.scheduler.preempted_swap == 1, "no request went through the swap space"
    finally:
        jax.config.update("jax_log_compiles", old)
        logger.removeHandler(log)
    names = project_functions()
    return {s for s in log.seen if s[0] in names}


def uncovered(got: set, want: set) -> list:
    """The engine's compiles no catalogue program matches: same function, and the logged argument types a
    subsequence of the program's (jax prunes the arguments a program does not use from what it compiles)."""
    by_name: dict[str, list[tuple[str, ...]]] = {}
    for name, avals in want:
        by_name.setdefault(name, []).append(avals)

    def sub(short: tuple, long: tuple) -> bool:
        it = iter(long)
        return all(any(a == b for b in it) for a in short)

    return sorted(s for s in got if not any(sub(s[1], full) for full in by_name.get(s[0], [])))


def shardings(kind: str | None):
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)


def expected(model, config: EngineConfig, prompts: list[int]) -> set:
    """Every signature the catalogue's builders give for these requests: dense or offloaded decode at each batch
    the engine passes through (the first request alone, then all), every recall and write-back size up to the
    largest, the prefills (layer by layer for offloaded prompts, with each layer's spill), a request's swap out and
    back (a dense request's blocks, or an offloaded one's steady GPU blocks) and the allocations."""
    platform = "cpu"
    r = plan_backends(config, platform, is_moe=model.cfg.is_moe)
    es = cat.EngineShapes.of(model.cfg, model.dtype, config, attention=r.decode_attention, layer_loop=r.layer_loop,
                             host_io=r.host_io or "xla", platform=platform)
    calls = []
    if config.mode == "dense":
        nb = sum(blocks_for(n + NEW, config.block_size) for n in prompts) + 1
        for k in range(1, len(prompts) + 1):
            calls += cat.dense_decode(es, prompts[:k], NEW, num_blocks=nb)
        for n in prompts:
            calls += cat.prefill(es, n, blocks_for(n + NEW, config.block_size), num_blocks=nb)
            for t in range(n + 1, n + NEW + 1):  # (a dense request's table grows as it decodes)
                calls += cat.swap_programs(es, nb, blocks_for(t, config.block_size))
        calls += cat.allocations(es, shardings, num_blocks=nb)
    else:
        mbs = config.offload.micro_batches or 1
        layout = cat.SparseLayout.of(es, prompts, NEW)
        most = len(prompts) * config.budget_blocks * model.cfg.num_kv_heads
        for k in range(1, len(prompts) + 1):
            part = cat.SparseLayout.of(es, prompts, NEW, offloaded=list(range(k)))
            recalls = [0] + [1 << i for i in range(most.bit_length() + 1)]
            for r in recalls:
                calls += cat.sparse_decode(es, part, r, shardings=shardings, micro_batches=mbs)
            for n in range(1, k + 1):
                calls += [cat.Call(p) for p in cat.write_back_programs(es, layout, n, shardings("pinned_host"),
                                                                       shardings("device"))]
                calls.append(cat.Call(cat.refresh_meta_program(es, layout, n * layout.plan.sparse_layers)))
        for n in prompts:
            calls += cat.offloaded_prefill(es, layout, n, shardings=shardings)
            calls += cat.swap_programs(es, layout.num_gpu_blocks, layout.plan.gpu_blocks(n + NEW), "offload")
        calls += cat.allocations(es, shardings, layout)
        if es.host_io != "numpy":  # the host transfers' start-up check (once per process off a GPU)
            calls += host_io_probe(model.cfg.num_kv_heads, model.cfg.head_dim, shardings, es.kv_dtype,
                                   config.block_size)
    return {c.program.signature for c in calls}


OFFLOAD = dict(mode="offload", budget_tokens=64, window_tokens=16, dense_layers=1, max_batch=4)
CONFIGS = {
    "dense-gpu-default": dict(layer_loop="layerwise", decode_attention="pallas"),
    "dense-cpu-default": dict(),
    "offload-gpu-default": dict(OFFLOAD, decode_attention="pallas"),  # recall ahead, one micro-batch
    "offload-same-layer": dict(OFFLOAD, decode_attention="pallas", recall="interruptible", micro_batches=2),
    "offload-headwise-fragmented-sync": dict(OFFLOAD, selection="headwise", io="fragmented", recall="sync"),
    "offload-eager-numpy-io": dict(OFFLOAD, recall="eager", host_io="numpy", micro_batches=2),
    "offload-fragmented-solohead": dict(OFFLOAD, io="fragmented", layer_loop="layerwise"),
    "offload-device-placement": dict(OFFLOAD, offload_placement="device"),
    "offload-float8-kv": dict(OFFLOAD, kv_dtype="float8_e4m3fn", decode_attention="pallas"),
}


@pytest.fixture(scope="module")
def tiny_model():
    return load_model("random:tiny-llama", dtype="float32")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_catalogue_covers_what_the_engine_compiles(tiny_model, name):
    config = EngineConfig.of(**CONFIGS[name], progress=False)
    model = tiny_model
    if config.backends.layer_loop == "layerwise":
        model = dataclasses.replace(model)  # the engine unstacks a layer-wise model in place: keep the fixture's
    got = engine_compiles(model, config, PROMPTS)
    assert len(got) >= 4, f"the compile log caught too little ({got}): is jax_log_compiles' message still parsed?"
    missing = uncovered(got, expected(model, config, PROMPTS))
    assert not missing, "the engine compiled programs the catalogue lacks:\n" + "\n".join(map(str, missing))


def test_catalogue_covers_a_mixture_of_experts_engine():
    model = load_model("random:tiny-qwen3-moe", dtype="float32")
    config = EngineConfig.of(progress=False)
    got = engine_compiles(model, config, PROMPTS)
    missing = uncovered(got, expected(model, config, PROMPTS))
    assert not missing, "the engine compiled programs the catalogue lacks:\n" + "\n".join(map(str, missing))


def test_the_check_fails_on_a_program_the_catalogue_lacks(tiny_model):
    """The comparison has teeth: without the prefill builder's programs, the engine's prefill is reported; without the
    swap builder's, the preemption's swap out and back."""
    config = EngineConfig.of(progress=False)
    got = engine_compiles(tiny_model, config, PROMPTS)
    es = cat.EngineShapes.of(tiny_model.cfg, tiny_model.dtype, config, attention="jnp", layer_loop="scan",
                             platform="cpu")
    nb = sum(blocks_for(p + NEW, 16) for p in PROMPTS) + 1
    prefill = {s for n in PROMPTS for s in (c.program.signature for c in cat.prefill(es, n, blocks_for(n + NEW, 16),
                                                                                     num_blocks=nb))}
    swap = {c.program.signature for n in range(1, nb) for c in cat.swap_programs(es, nb, n)}
    assert not uncovered(got, expected(tiny_model, config, PROMPTS))
    missing = uncovered(got, expected(tiny_model, config, PROMPTS) - prefill)
    assert any(name.startswith("_prefill") for name, _ in missing), missing
    missing = uncovered(got, expected(tiny_model, config, PROMPTS) - swap)
    assert {name for name, _ in missing} == {"_gather", "_scatter"}, missing
