"""Module paths of earlier releases, answered with where their contents live now (a clear ImportError instead of
"No module named ..."). Installed on `sys.meta_path` by the package's `__init__`, after every real finder."""

from __future__ import annotations

import importlib.abc

MOVED = {
    "scheduler": "pulseinfer_jax.sched.scheduler (Request and Status: pulseinfer_jax.request)",
    "ioaa": "pulseinfer_jax.sched.admission",
    "offload": "pulseinfer_jax.sched.pools (pool sizing) and pulseinfer_jax.sched.placer (OffloadPlacer)",
    "attention": "pulseinfer_jax.runner.paged_attention",
    "pipeline": "pulseinfer_jax.runner.sparse_decoder",
    "layer_ops": "pulseinfer_jax.runner.sparse_layer",
    "layer_inputs": "pulseinfer_jax.runner.sparse_inputs",
    "step_inputs": "pulseinfer_jax.runner.sparse_inputs",
    "segmented_prefill": "pulseinfer_jax.runner.offloaded_prefill",
    "sampling": "pulseinfer_jax.request (SamplingParams) and pulseinfer_jax.runner.sampling (the sampler)",
    "sparse": "pulseinfer_jax.selection.policy",
    "kept_scores": "pulseinfer_jax.selection.kept_blocks",
    "slot_plan": "pulseinfer_jax.selection.slot_plan",
    "selector": "pulseinfer_jax.selection.hooks",
    "kv_cache": "pulseinfer_jax.kv.cache",
    "kv_quant": "pulseinfer_jax.kv.quant",
    "compile_clock": "pulseinfer_jax.engine.compile_clock",
    "aot": "bench.aot in the source repository (a development tool, not installed; ./run.sh compile-gpu runs it)",
    "host_offload.blocks": "pulseinfer_jax.kv.blocks",
    "host_offload.slot_cache": "pulseinfer_jax.selection.slot_table",
    "parallel.weights": "pulseinfer_jax.models.sharding",
    "pallas_kernels.gather_scatter": "bench.gather_scatter in the source repository (used by the benchmarks only)",
}


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Raises ModuleNotFoundError naming the new place of a module that moved; finds nothing else."""

    def find_spec(self, fullname: str, path=None, target=None):
        head, _, rest = fullname.partition(".")
        if head != "pulseinfer_jax" or not rest:
            return None
        old = next((m for m in MOVED if rest == m or rest.startswith(m + ".")), None)
        if old is None:
            return None
        raise ModuleNotFoundError(f"{fullname} moved: it is now {MOVED[old]}", name=fullname)


def install(meta_path: list) -> None:
    """Append the finder once (after the real ones, so it only answers for names nothing else finds)."""
    if not any(isinstance(f, MovedModuleFinder) for f in meta_path):
        meta_path.append(MovedModuleFinder())
