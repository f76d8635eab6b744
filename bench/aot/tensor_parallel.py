"""Tensor-parallel decode steps compiled for N compile-only H200s (no GPU): the collectives XLA chose, their bytes.

The CUDA plugin's compile-only topology offers several devices (`topology="1x1xN"`: one host with N GPUs; "1xNx1"
is N hosts of one GPU). On a 1-D `tp` mesh of them, each program of a decode step (the catalogue's, built the way the
engine builds them) is lowered with its arguments sharded as a tensor-parallel engine holds them
(`parallel/layout.py`): layer weights by `WeightPlacement`, the KV cache, staging buffers and key bounds by KV head,
queries and attention partials by head, the rest replicated. The optimised HLO then says which collectives XLA
inserted (all-reduce after attention and after the MLP, SoloHead's score sum, ...) and their bytes (the executable's
`cost_analysis()` is None on a compile-only target, and `Lowered.cost_analysis()` needs a real backend). Per step =
per program x its calls per step.

    ./run.sh gpu-python -m bench.aot.tensor_parallel --tp 8 --out bench/results/h200x8_tp_compile.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import pathlib
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh
from pulseinfer_jax.models.config import ModelConfig
from pulseinfer_jax.models.presets import PRESETS
from pulseinfer_jax.models.sharding import WeightPlacement, path_names

from bench.aot import catalogue as cat
from bench.aot import hlo
from bench.aot import suite as suite_mod
from bench.aot.programs import Call, Program, Spec, _is_spec
from bench.aot.target import H200, GpuLimits, use_cpu_backend
from pulseinfer_jax.config import EngineConfig
from pulseinfer_jax.parallel.layout import TP, DeviceLayout

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
HEAD_SPLIT = ("kv", "staging", "bounds")  # arguments split on their KV-head axis (the second to last)
Q_SPLIT = ("q", "early")  # arguments split on their head axis (axis 1)
PARAMS = ("lp", "params", "head", "layer_params")  # weights: split by `WeightPlacement`
POINTS = (("llama-3.1-70b", 32768, 8), ("qwen3-235b-a22b", 32768, 8))  # (preset, context, batch)
BUDGET = 2048

def tp_layout(config_text: str, tp: int) -> DeviceLayout:
    """A `tp` mesh of N compile-only GPUs of the target (one host)."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=config_text, topology=f"1x1x{tp}")
    devices = tuple(topo.devices[:tp])
    return DeviceLayout(devices, Mesh(np.array(devices), (TP,), axis_types=(AxisType.Auto,)))


def abstract_args(p: Program, layout: DeviceLayout, place: WeightPlacement) -> tuple:
    """`p`'s arguments as ShapeDtypeStructs sharded as a tensor-parallel engine holds them (module docstring)."""
    fn = getattr(p.fn, "__wrapped__", p.fn)
    names = list(inspect.signature(fn).parameters)

    def struct(arg_name: str, path, s: Spec) -> jax.ShapeDtypeStruct:
        if arg_name in PARAMS:
            sharding = place.sharding(path_names(path), len(s.shape))
        elif (arg_name in HEAD_SPLIT or set(path_names(path)) & set(HEAD_SPLIT)) and len(s.shape) >= 3:
            sharding = layout.kv_heads(len(s.shape))
        elif arg_name in Q_SPLIT and len(s.shape) >= 2:
            sharding = layout.split(len(s.shape), 1)
        elif arg_name == "arrivals":  # the attention's split-merge counters: a share per device
            sharding = layout.split(1, 0)
        else:
            sharding = layout.replicated()
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)

    out = []
    for name, arg in zip(names, p.args, strict=False):
        out.append(jax.tree_util.tree_map_with_path(lambda path, s, n=name: struct(n, path, s) if isinstance(s, Spec)
                                                    else s, arg, is_leaf=_is_spec))
    return tuple(out)


def collectives(text: str) -> dict[str, dict[str, int]]:
    """Collective ops of an optimised HLO module (every computation): per kind, how many and the bytes of their
    results (an async `-start`'s shape lists its operands first: only the results count)."""
    out: dict[str, dict[str, int]] = {}
    for comp in hlo.parse_module(text).values():
        for ins in comp.instructions.values():
            kind = ins.opcode.removesuffix("-start")
            if kind not in COLLECTIVES:
                continue
            arrays = ins.shape[len(ins.operands):] if ins.opcode.endswith("-start") else ins.shape
            row = out.setdefault(kind, {"ops": 0, "bytes": 0})
            row["ops"] += 1
            row["bytes"] += sum(a.bytes for a in arrays)
    return out


def compile_call(c: Call, layout: DeviceLayout, place: WeightPlacement) -> dict:
    p = c.program
    row: dict[str, Any] = {"key": p.key, "function": p.function, "count": c.count}
    jitted = p.fn if hasattr(p.fn, "lower") else jax.jit(p.fn)
    t0 = time.perf_counter()
    try:
        with jax.set_mesh(layout.mesh):
            compiled = jitted.lower(*abstract_args(p, layout, place), **p.statics).compile()
    except Exception as e:  # noqa: BLE001 - a program XLA rejects is a finding, reported with its reason
        row.update(status="rejected", error=f"{type(e).__name__}: {str(e).splitlines()[0][:400]}")
        return row
    # (cost_analysis() is None for a compile-only target's executable: the bytes come from the optimised HLO)
    text = compiled.as_text()
    triton = text.count('custom_call_target="__gpu$xla.gpu.triton"')
    row.update(status="compiled", compile_s=round(time.perf_counter() - t0, 2), collectives=collectives(text),
               triton_kernels=triton)
    if p.pallas and not triton:  # a Pallas kernel left in interpret mode would compile too, as a loop of XLA ops
        row.update(status="rejected", error=f"no Triton kernel for {', '.join(p.pallas)} (interpret mode?)")
    return row


def steps(preset: str, context: int, batch: int, layout: DeviceLayout, hbm: int) -> tuple[dict[str, list[Call]], dict]:
    """A dense and an offloaded decode step (budget BUDGET, typical recall) of `batch` requests of `context` tokens,
    and what that recall copies per step to each device (its heads of every missing block)."""
    source = ModelConfig.from_hf_dict(PRESETS[preset], name=preset)
    place = WeightPlacement(layout, source)
    cfg = place.cfg
    out = {}
    dense = cat.EngineShapes.of(cfg, jnp.bfloat16, EngineConfig.of(max_batch=64))
    prompt = suite_mod.prompt_for(cfg, context)
    out["dense"] = cat.dense_decode(dense, [prompt] * batch, suite_mod.NEW_TOKENS)
    sparse = cat.EngineShapes.of(cfg, jnp.bfloat16, EngineConfig.of(mode="offload", max_batch=64,
                                                                    budget_tokens=BUDGET))
    mbs = suite_mod.gpu_micro_batches(sparse.config)
    typical, _ = suite_mod.typical_recall(sparse, batch, mbs)
    sparse_layout = suite_mod.offload_layout(sparse, [prompt] * batch, hbm)
    # the model-step programs (the host I/O programs are per device, parallel/layout: shard_map of one device's)
    out["offload"] = [c for c in cat.sparse_decode(sparse, sparse_layout, typical, micro_batches=mbs)
                      if c.program.group != "host_io"]
    micro = min(mbs, batch)
    block = 2 * sparse.config.block_size * cfg.num_kv_heads * cfg.head_dim * 2 // layout.tp  # one device's heads, bf16
    recall = {"misses_per_layer_and_micro_batch": typical, "sparse_layers": sparse_layout.plan.sparse_layers,
              "micro_batches": micro, "bytes_per_step_per_device": typical * sparse_layout.plan.sparse_layers * micro
              * block}
    return out, recall


def run(config_text: str, tp: int, points=POINTS) -> dict:
    limits = GpuLimits.parse(config_text)
    layout = tp_layout(config_text, tp)
    report: dict[str, Any] = {"tp": tp, "device": limits.name, "points": []}
    for preset, context, batch in points:
        place = WeightPlacement(layout, ModelConfig.from_hf_dict(PRESETS[preset], name=preset))
        calls_by_kind, recall = steps(preset, context, batch, layout, limits.device_memory * tp)
        for kind, calls in calls_by_kind.items():
            rows = [compile_call(c, layout, place) for c in calls]
            per_step: dict[str, dict[str, float]] = {}
            for r in rows:
                for k, v in r.get("collectives", {}).items():
                    agg = per_step.setdefault(k, {"ops": 0.0, "bytes": 0.0})
                    agg["ops"] += v["ops"] * r["count"]
                    agg["bytes"] += v["bytes"] * r["count"]
            point = {"model": preset, "context": context, "batch": batch, "step": kind,
                     "kv_repeat": place.kv_repeat, "programs": rows, "collectives_per_step": per_step,
                     "rejected": [r["key"] for r in rows if r["status"] != "compiled"]}
            if kind == "offload":
                point["recall"] = recall
            report["points"].append(point)
            print(f"{preset} {kind} {context}x{batch}: {len(rows)} programs, {len(point['rejected'])} rejected, "
                  f"collectives/step {per_step}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(H200), help="GpuTargetConfigProto text (default: the project's H200)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--out", default="bench/results/h200x8_tp_compile.json")
    a = ap.parse_args(argv)
    use_cpu_backend()
    t0 = time.perf_counter()
    report = run(pathlib.Path(a.target).read_text(), a.tp)
    import datetime

    report = {"date": datetime.date.today().isoformat(),
              "command": "python -m bench.aot.tensor_parallel " + " ".join(argv or sys.argv[1:]),
              "machine": {"jax_backend": "compile-only", "jax_version": jax.__version__,
                          "note": f"compiled for {a.tp} x {report['device']} without one; nothing executed"},
              "wall_s": round(time.perf_counter() - t0, 1), **report}
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    bad = [k for p in report["points"] for k in p["rejected"]]
    print(f"-> {out}; {len(bad)} rejected")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

