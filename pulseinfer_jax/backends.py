"""Every "auto" backend choice, resolved once per engine, with the reason for each.

`plan_backends(config, platform, ...)` is the pure rule (the ahead-of-time check compiles what it says);
`resolve_backends(config, device, model)` applies it to a real device and, on a GPU, first runs each unverified
fast path once at tiny shapes against its jnp reference (Pallas attention and block scoring, float8 key bounds,
pinned-host transfers, the grouped-GEMM kernel): a path that fails or disagrees is replaced by the safe one, and
the reason says so. The engine logs `ResolvedBackends.summary()` once and reports `as_dict()` in every request's
stats.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pulseinfer_jax.config import EngineConfig
from pulseinfer_jax.kv.quant import pack_blocks, resolve_kv_dtype, storage_dtype
from pulseinfer_jax.models.moe import MoEOptions
from pulseinfer_jax.selection.policy import BlockScoring

log = logging.getLogger("pulseinfer_jax")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")  # device platforms (and lowering platforms) that are a GPU


@dataclasses.dataclass(frozen=True)
class ResolvedBackends:
    """What an engine runs: each config "auto" replaced by a concrete choice, and why."""

    platform: str  # "gpu" on any GPU platform, else the device's platform
    kv_dtype: str  # the KV cache's format: the model's dtype, or "float8_e4m3fn" (kv/quant.py; stored as bytes)
    decode_attention: str  # dense decode: "jnp" | "pallas"
    layer_loop: str  # "scan" | "layerwise"
    moe: MoEOptions | None  # None: the model has no experts
    sparse_attention: str | None  # the sparse pipeline's attention (None in mode "dense")
    scoring: BlockScoring | None  # block scoring, key-bounds dtype after any fallback (None in mode "dense")
    host_io: str | None  # host KV pool transfers: "xla" | "numpy" (None in mode "dense")
    micro_batches: int | None  # offloaded batch split (None in mode "dense")
    reasons: tuple[str, ...] = ()

    @property
    def moe_strategy(self) -> str | None:
        if self.moe is None:
            return None
        grouped_pallas = self.moe.strategy == "grouped" and self.moe.grouped_kernel == "pallas"
        return "grouped-pallas" if grouped_pallas else self.moe.strategy

    @property
    def weights_layout(self) -> str:
        """How `models.loading.load_model` should lay out the layer weights: per layer for a layer-wise engine
        (never stacked), stacked for a scan."""
        return "layers" if self.layer_loop == "layerwise" else "stacked"

    def as_dict(self) -> dict[str, Any]:
        out = {"kv_dtype": self.kv_dtype, "decode_attention": self.decode_attention, "layer_loop": self.layer_loop}
        if self.moe is not None:
            out["moe_strategy"] = self.moe_strategy
        if self.sparse_attention is not None:
            out.update(sparse_attention=self.sparse_attention, score_bounds_dtype=self.scoring.bounds_dtype,
                       host_io=self.host_io, micro_batches=self.micro_batches)
        return out

    def summary(self) -> str:
        chosen = ", ".join(f"{k}={v}" for k, v in self.as_dict().items())
        return f"backends on {self.platform}: {chosen} ({'; '.join(self.reasons)})"


def plan_backends(config: EngineConfig, platform: str, *, is_moe: bool = False, model_dtype="float32"
                  ) -> ResolvedBackends:
    """The rule, without probes: on a GPU the fast paths (Pallas, layer-wise, pinned host, 2 micro-batches), elsewhere
    the ones XLA:CPU runs best (Pallas would run in interpret mode there: correct, slow, for tests). The KV cache is
    stored in `model_dtype` unless `config.kv_dtype` asks for float8."""
    b, gpu = config.backends, platform in GPU_PLATFORMS
    plat = "gpu" if gpu else platform
    kv_dtype = resolve_kv_dtype(config.kv_dtype, model_dtype)
    why: list[str] = [f"kv_dtype {kv_dtype}: " + ("the model's" if config.kv_dtype == "auto" else "as configured")]

    def auto(name: str, choice: str, on_gpu: str, off_gpu: str, note: str) -> str:
        if choice != "auto":
            why.append(f"{name} as configured")
            return choice
        why.append(f"{name} auto: {note}")
        return on_gpu if gpu else off_gpu

    attention = auto("decode_attention", b.decode_attention, "pallas", "jnp",
                     "Pallas on a GPU" if gpu else "jnp off a GPU (Pallas would run interpreted)")
    loop = auto("layer_loop", b.layer_loop, "layerwise", "scan",
                "one call per layer on a GPU" if gpu else "one scanned call (fewer dispatches on XLA:CPU)")
    moe = None
    if is_moe:
        strategy = b.moe_strategy
        if strategy == "auto":
            why.append("moe_strategy auto: " + ("dense / gather by token count" if gpu else "grouped (fastest on CPU)"))
        moe = MoEOptions("grouped", "pallas", plat) if strategy == "grouped-pallas" else MoEOptions(strategy, "jnp",
                                                                                                     plat)
    sparse = scoring = host_io = mbs = None
    if config.mode != "dense":
        sparse, scoring = attention, config.offload.scoring
        # on a GPU with recall ahead the numpy pool: its gather is host code, run on the recall thread while the GPU
        # computes; the XLA host gather starts only after every GPU program queued before it and holds the later
        # ones until it ends (XLA's HostExecute thunks), so it cannot overlap a step
        ahead = config.offload.ablation.recall == "ahead"
        host_io = auto("host_io", b.host_io, "numpy-pinned" if ahead else "xla", "xla",
                       ("pageable pool gathered on the recall thread into pinned staging, overlapping the step (an "
                        "XLA host gather would wait for the GPU's queued work)" if ahead else "pinned-host pool")
                       if gpu else "pinned-host pool (memory kinds emulated)")
        mbs = config.offload.micro_batches
        if mbs is None:
            mbs = 2 if gpu and not ahead else 1
            why.append(f"micro_batches {mbs}: " + ("recall ahead, one weight pass" if ahead else
                                                   "a copy engine to hide" if gpu else "nothing to overlap off a GPU"))
    return ResolvedBackends(plat, kv_dtype, attention, loop, moe, sparse, scoring, host_io, mbs, tuple(why))


def resolve_backends(config: EngineConfig, device: jax.Device, model: Any) -> ResolvedBackends:
    """`plan_backends` for `device`, with each "auto" fast path on a GPU checked once against its reference first
    (`model`: a `LoadedModel`; its dtype and KV geometry shape the checks). Logs the summary line."""
    r = plan_backends(config, device.platform, is_moe=model.cfg.is_moe, model_dtype=model.dtype)
    if r.platform == "gpu":
        r = _probe(config, device, model, r)
    log.info(r.summary())
    return r


def _probe(config: EngineConfig, device: jax.Device, model: Any, r: ResolvedBackends) -> ResolvedBackends:
    b, why, dtype = config.backends, list(r.reasons), model.dtype
    attention, sparse, scoring, host_io, moe = r.decode_attention, r.sparse_attention, r.scoring, r.host_io, r.moe
    if b.decode_attention == "auto":
        err = probe_pallas(device, dtype, scoring, kv_dtype=r.kv_dtype)  # (dense mode: no scoring to check)
        if err is not None and scoring is not None and scoring.bounds_dtype != "kv":
            exact = dataclasses.replace(scoring, bounds_dtype="kv")
            if probe_pallas(device, dtype, exact, kv_dtype=r.kv_dtype) is None:
                why.append(f"score_bounds_dtype kv: the Pallas scoring failed on {scoring.bounds_dtype} bounds ({err})")
                err, scoring = None, exact
        if err is not None:
            why.append(f"decode_attention jnp: the Pallas kernels failed their check ({err})")
            attention, sparse = "jnp", ("jnp" if sparse is not None else None)
    if host_io in ("xla", "numpy-pinned") and b.host_io == "auto":
        from pulseinfer_jax.host_offload.host_pool import checked_host_io

        c, tried = model.cfg, host_io
        host_io, err = checked_host_io(tried, device, on_gpu=True, block_size=config.block_size,
                                       num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                       dtype=storage_dtype(r.kv_dtype))
        if err is not None:
            why.append(f"host_io numpy: {tried}'s pinned-host transfers failed their check ({err}); pageable RAM "
                       "through PJRT's bounce buffer, slower")
    if moe is not None and moe.grouped_kernel == "pallas":
        from pulseinfer_jax.models.moe import probe_grouped_kernel

        err = probe_grouped_kernel(device, dtype)
        if err is not None:
            why.append(f"moe_strategy grouped: the grouped-GEMM Pallas kernel failed ({err}); jnp tile loop")
            moe = dataclasses.replace(moe, grouped_kernel="jnp")
    for line in why[len(r.reasons):]:  # each fallback also as a warning the caller sees
        warnings.warn(f"{line}; the safe path runs instead", RuntimeWarning, stacklevel=4)
    return dataclasses.replace(r, decode_attention=attention, sparse_attention=sparse, scoring=scoring,
                               host_io=host_io, moe=moe, reasons=tuple(why))


def probe_pallas(device: jax.Device, dtype=None, scoring: BlockScoring | None = BlockScoring(), *,
                 kv_dtype=None, interpret: bool = False) -> str | None:
    """Run the sparse decode attention (one split, and four merged inside the kernel through its atomics, twice on
    one counter buffer) and block-scoring kernels once on `device` at tiny shapes in the model dtype
    `dtype` (default bfloat16) over a cache of `kv_dtype` (default `dtype`; float8: values and their scales) with the
    engine's block scoring (key bounds in its metadata dtype; per query head and per KV
    head; its beta and sub-blocks; None: the attention only), each against its jnp reference. None if they run and
    agree, else what failed.
    (`interpret`: run the kernels interpreted, to test the check off a GPU.)"""
    import pulseinfer_jax.pallas_kernels.block_scoring as bsc
    import pulseinfer_jax.pallas_kernels.sparse_decode_attention as sda

    dtype = jnp.dtype(dtype or jnp.bfloat16)
    rng = np.random.default_rng(0)
    try:
        with jax.default_device(device):
            q = jnp.asarray(rng.standard_normal((2, 4, 64)), dtype)
            pool = pack_blocks(jnp.asarray(rng.standard_normal((4, 2, 16, 2, 64)), dtype), kv_dtype or dtype)
            ids = jnp.array([[[1, 2]], [[3, 1]]], jnp.int32)
            lens = jnp.array([[[16, 9]], [[16, 16]]], jnp.int32)
            got = sda.sparse_decode_attention(q, pool, ids, lens, interpret=interpret)[0]
            want = sda.sparse_decode_attention_reference(q, pool, ids, lens)[0]
            if not np.allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2):
                return "sparse_decode_attention disagrees with its jnp reference"
            # four splits merged inside the kernel (cross-program atomics), twice on one counter buffer
            many = jnp.asarray(rng.integers(0, 4, (2, 1, 8)), jnp.int32)
            lens = jnp.asarray(rng.integers(0, 17, (2, 1, 8)), jnp.int32)
            want = sda.sparse_decode_attention_reference(q, pool, many, lens)[0]
            counters = jnp.zeros((4,), jnp.int32)
            for _ in range(2):
                got, _, _, counters = sda.sparse_decode_attention(q, pool, many, lens, counters, split_k=4,
                                                                  blocks_per_step=1, interpret=interpret)
                if not np.allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=3e-2):
                    return "sparse_decode_attention's merge inside the kernel disagrees with its jnp reference"
            if np.any(np.asarray(counters)):
                return "sparse_decode_attention's merge inside left its arrival counters set"
            if scoring is None:
                return None
            meta_dtype = scoring.metadata_dtype(dtype)
            lo = jnp.asarray(rng.standard_normal((4 * scoring.sub_blocks, 2, 64)), meta_dtype)
            hi = jnp.asarray(np.asarray(lo, np.float32) + 1.0, meta_dtype)
            for per_head in {False, scoring.per_query_head}:
                kw = dict(per_head=per_head, beta=scoring.beta, sub_blocks=scoring.sub_blocks)
                got = bsc.block_scores(q, lo, hi, ids[:, 0], interpret=interpret, **kw)
                want = bsc.block_scores_reference(q, lo, hi, ids[:, 0], **kw)
                if not np.allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=5e-2, rtol=2e-2):
                    return f"block_scores (per_head={per_head}) disagrees with its jnp reference"
    except Exception as e:  # noqa: BLE001 - any lowering / compile / runtime error of the kernels
        return f"{type(e).__name__}: {str(e)[:300]}"
    return None
