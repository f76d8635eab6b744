"""Every "auto" backend choice, resolved once per engine, with the reason for each.

`plan_backends(config, platform, ...)` is the pure rule (the ahead-of-time check compiles what it says);
`resolve_backends(config, device, model)` applies it to a real device, first running each fast path it picked once
at tiny shapes against its reference (`startup_checks`; the host transfers on every platform, the kernels and the
landing on a GPU): an "auto" path that fails or disagrees is replaced by the safe one and the reason says so; an
explicit choice that fails raises `FastPathError`. The engine logs `ResolvedBackends.summary()` once (with what the
checks cost) and reports `as_dict()` in every request's stats (`fallbacks` where one happened).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from typing import Any

import jax

from pulseinfer_jax.config import EngineConfig
from pulseinfer_jax.kv.quant import resolve_kv_dtype, storage_dtype
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
    fallbacks: tuple[tuple[str, str], ...] = ()  # (option, why): "auto" fast paths replaced after a failed check
    check_seconds: float | None = None  # what the start-up checks cost (None: none ran)

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
        if self.fallbacks:
            out["fallbacks"] = {option: why for option, why in self.fallbacks}
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
    """`plan_backends` for `device`, with each fast path it picked checked once on the device first (`model`: a
    `LoadedModel`; its dtype and KV geometry shape the checks): the host transfers on every platform (what the
    installed jax accepts differs between versions), and on a GPU every kernel and program of the offloaded step
    (`startup_checks`). An "auto" path that fails falls back to the safe one, said in the reasons, in `fallbacks`
    and as a warning; a path the config names explicitly that fails raises `FastPathError`. Logs the summary."""
    r = plan_backends(config, device.platform, is_moe=model.cfg.is_moe, model_dtype=model.dtype)
    r = _probe(config, device, model, r)
    log.info(r.summary())
    return r


class FastPathError(RuntimeError):
    """A fast path the config chose explicitly failed its start-up check on this device."""


def _explicit_failure(option: str, value: str, device: Any, err: str, instead: str) -> FastPathError:
    return FastPathError(f"{option}={value!r} failed its start-up check on {device.platform} ({err}); set {option}="
                         f"{instead!r}, or 'auto' to fall back to the safe path on its own")


def _probe(config: EngineConfig, device: jax.Device, model: Any, r: ResolvedBackends) -> ResolvedBackends:
    b, why, dtype = config.backends, list(r.reasons), model.dtype
    attention, sparse, scoring, host_io, moe = r.decode_attention, r.sparse_attention, r.scoring, r.host_io, r.moe
    fallbacks: list[tuple[str, str]] = []
    timed: list[tuple[str, float]] = []
    gpu = r.platform == "gpu"

    def timed_check(name: str, fn, *args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        timed.append((name, time.perf_counter() - t0))
        return out

    if gpu and attention == "pallas":
        err = timed_check("pallas kernels", probe_pallas, device, dtype, scoring, kv_dtype=r.kv_dtype)
        if err is not None and scoring is not None and scoring.bounds_dtype != "kv":
            exact = dataclasses.replace(scoring, bounds_dtype="kv")
            if timed_check("pallas kernels, exact bounds", probe_pallas, device, dtype, exact,
                           kv_dtype=r.kv_dtype) is None:
                why.append(f"score_bounds_dtype kv: the Pallas scoring failed on {scoring.bounds_dtype} bounds ({err})")
                fallbacks.append(("score_bounds_dtype", err))
                err, scoring = None, exact
        if err is not None:
            if b.decode_attention != "auto":
                raise _explicit_failure("decode_attention", b.decode_attention, device, err, "jnp")
            why.append(f"decode_attention jnp: the Pallas kernels failed their check ({err})")
            fallbacks.append(("decode_attention", err))
            attention, sparse = "jnp", ("jnp" if sparse is not None else None)
    if gpu and sparse is not None:
        from pulseinfer_jax.startup_checks import check_landing

        err = timed_check("landing", check_landing, device, r.kv_dtype)
        if err is not None:
            raise FastPathError(f"the offloaded step's landing of recalled blocks failed its start-up check on "
                                f"{device.platform} ({err}); offloading cannot run on this device: use mode='dense'")
    if host_io is not None and host_io != "numpy":
        from pulseinfer_jax.host_offload.host_pool import checked_host_io

        c, tried = model.cfg, host_io
        host_io, err = timed_check("host_io", checked_host_io, tried, device, on_gpu=gpu,
                                   block_size=config.block_size, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                                   dtype=storage_dtype(r.kv_dtype))
        if err is not None:
            if b.host_io != "auto":
                raise _explicit_failure("host_io", b.host_io, device, err, "numpy")
            why.append(f"host_io numpy: {tried}'s pinned-host transfers failed their check ({err}); pageable RAM "
                       "through PJRT's bounce buffer, slower")
            fallbacks.append(("host_io", err))
    if gpu and moe is not None and moe.grouped_kernel == "pallas":
        from pulseinfer_jax.models.moe import probe_grouped_kernel

        err = timed_check("grouped gemm", probe_grouped_kernel, device, dtype)
        if err is not None:
            if b.moe_strategy != "auto":
                raise _explicit_failure("moe_strategy", b.moe_strategy, device, err, "grouped")
            why.append(f"moe_strategy grouped: the grouped-GEMM Pallas kernel failed ({err}); jnp tile loop")
            fallbacks.append(("moe_strategy", err))
            moe = dataclasses.replace(moe, grouped_kernel="jnp")
    for line in why[len(r.reasons):]:  # each fallback also as a warning the caller sees
        warnings.warn(f"{line}; the safe path runs instead", RuntimeWarning, stacklevel=4)
    if timed:
        why.append("start-up checks " + ", ".join(f"{n} {s:.2f} s" for n, s in timed)
                   + f" ({sum(s for _, s in timed):.2f} s in all)")
    return dataclasses.replace(r, decode_attention=attention, sparse_attention=sparse, scoring=scoring,
                               host_io=host_io, moe=moe, reasons=tuple(why), fallbacks=tuple(fallbacks),
                               check_seconds=sum(s for _, s in timed) if timed else None)


def probe_pallas(device: jax.Device, dtype=None, scoring: BlockScoring | None = BlockScoring(), *,
                 kv_dtype=None, interpret: bool = False) -> str | None:
    """The Pallas kernels an engine runs, each once on `device` at tiny shapes in the model dtype `dtype` (default
    bfloat16) over a cache of `kv_dtype` (default `dtype`) against its reference (`startup_checks`): the decode
    attention at every split count the engine picks; with the engine's block `scoring` (None: dense, the attention
    only) the scoring kernels and the fused selection + slot plan. None if all run and agree, else what failed first.
    (`interpret`: run the kernels interpreted, to test the check off a GPU.)"""
    from pulseinfer_jax import startup_checks as sc

    err = sc.check_attention(device, dtype, kv_dtype, interpret=interpret)
    if err is None and scoring is not None:
        err = sc.check_scoring(device, dtype, scoring, kv_dtype, interpret=interpret)
        if err is None:
            err = sc.check_select_plan(device, interpret=interpret)
    return err
