"""Engine configuration, grouped by concern (frozen, passed explicitly; nothing is read from the environment).

    EngineConfig                 serving: mode, batch, blocks, GPU memory
      .offload: OffloadConfig    sparse decode with host-offloaded KV: budget, window, sinks, dense layers, pools, IOAA
        .scoring: BlockScoring   how blocks are scored (pulseinfer_jax/selection/policy.py)
        .ablation: OffloadAblation  selection / I/O / recall / placement switches the benchmarks flip
      .backends: Backends        how the work runs on the device ("auto" choices: pulseinfer_jax/backends.py)

Each setting also has a flat name (`budget_tokens`, `score_beta`, ...: `pulseinfer_jax.options`), used by the CLI's
options and the API's keywords: `EngineConfig.of(mode="offload", budget_tokens=1024)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pulseinfer_jax.options import check_choices, option, replace_flat, section
from pulseinfer_jax.selection.policy import BlockScoring

Mode = Literal["dense", "offload", "auto"]
Selection = Literal["solohead", "headwise"]
SoloHeadVariant = Literal["normalized_sum", "retrieval_head"]
IOMode = Literal["coalesced", "fragmented"]
RecallMode = Literal["ahead", "interruptible", "eager", "sync"]
Placement = Literal["host", "device"]
DecodeAttention = Literal["auto", "jnp", "pallas"]
LayerLoop = Literal["auto", "scan", "layerwise"]
HostIO = Literal["auto", "xla", "numpy", "numpy-pinned"]
MoEStrategy = Literal["auto", "dense", "gather", "grouped", "grouped-pallas"]
KVDtype = Literal["auto", "float8_e4m3fn"]  # (kv_quant.KV_DTYPES)


def _positive_int(name: str, v: Any, *, zero_ok: bool = False, none_ok: bool = False) -> None:
    if v is None and none_ok:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < (0 if zero_ok else 1):
        raise ValueError(f"{name}={v!r} must be a {'non-negative' if zero_ok else 'positive'} integer")


@dataclasses.dataclass(frozen=True)
class OffloadAblation:
    """Switches that turn PulseInfer's mechanisms into the baselines they replace (benchmarks and ablations)."""

    selection: Selection = option("solohead", "solohead: one block set per layer for all KV heads; headwise: one per "
                                  "KV head (the per-head baseline)")
    solohead: SoloHeadVariant = option("normalized_sum", "SoloHead aggregate: normalized_sum, or retrieval_head "
                                       "(needs retrieval_heads)")
    retrieval_heads: tuple[int, ...] | None = option(None, "KV head per sparse layer for solohead=retrieval_head "
                                                     "(policy.calibrate_retrieval_head)", cli=False)
    io: IOMode = option("coalesced", "coalesced: one gathered copy per layer and step; fragmented: one copy per "
                        "(block, head)")
    recall: RecallMode = option("ahead", "ahead: a layer's misses are recalled for its next step, the driver never "
                                "waits; same-layer (ablations): interruptible: attend resident blocks while the "
                                "recall is in flight; eager: the same, queued before the plan is read; sync: wait "
                                "for the recall first")
    placement: Placement = option("host", "host: sparse requests' KV in pinned host memory; device: kept on the GPU "
                                  "(no I/O)", flat="offload_placement")

    def __post_init__(self) -> None:
        check_choices(self)
        if self.solohead == "retrieval_head" and self.retrieval_heads is None:
            raise ValueError("solohead='retrieval_head' needs retrieval_heads (one KV head per sparse layer; see "
                             "policy.calibrate_retrieval_head)")


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Sparse decode with the KV offloaded to pinned host memory (modes offload and auto)."""

    budget_tokens: int = option(2048, "tokens attended per sparse layer and step (sinks + window + selected blocks)")
    window_tokens: int = option(64, "recent tokens always attended and kept on the GPU (whole blocks)")
    sink_blocks: int = option(1, "first blocks always attended")
    dense_layers: int = option(2, "first layers that attend densely (their KV stays on the GPU)")
    slot_cache_blocks: int | None = option(None, "recalled-block cache per (request, sparse layer); default 2x the "
                                           "selected blocks")
    host_kv_tokens: int | None = option(None, "pinned host pool size in tokens; default what the requests need")
    micro_batches: int | None = option(None, "offloaded batch split for the same-layer recall modes, the driver "
                                       "runs whichever has its data ready; default 1 (recall ahead: one weight "
                                       "pass), 2 on a GPU with a same-layer recall")
    h2d_bytes_per_s: float | None = option(None, "host-to-device bandwidth IOAA assumes; default measured on a GPU")
    ioaa_slack: float = option(0.8, "fraction of a decode step that recall may take (IOAA)")
    ioaa_step_time_s: float = option(0.02, "decode step time IOAA assumes before it has measured one")
    attention_split_k: int | None = option(None, "splits of the Pallas decode attention over each block list (merged "
                                           "inside the kernel); default per call from the list's length and the "
                                           "batch, 1 to 16", cli=False)
    scoring: BlockScoring = section(BlockScoring)
    ablation: OffloadAblation = section(OffloadAblation)

    def __post_init__(self) -> None:
        for name in ("budget_tokens", "window_tokens"):
            _positive_int(name, getattr(self, name))
        _positive_int("micro_batches", self.micro_batches, none_ok=True)
        if self.ablation.recall == "ahead" and (self.micro_batches or 1) > 1:
            raise ValueError(f"micro_batches={self.micro_batches} splits the batch so that one part computes while "
                             "another waits on its recall; recall='ahead' never waits (one weight pass per step): "
                             "leave micro_batches unset, or pick recall='interruptible'")
        for name in ("sink_blocks", "dense_layers"):
            _positive_int(name, getattr(self, name), zero_ok=True)
        for name in ("slot_cache_blocks", "host_kv_tokens", "attention_split_k"):
            _positive_int(name, getattr(self, name), none_ok=True)
        if self.h2d_bytes_per_s is not None and not self.h2d_bytes_per_s > 0:
            raise ValueError(f"h2d_bytes_per_s={self.h2d_bytes_per_s!r} must be > 0")
        if not 0 < self.ioaa_slack <= 1:
            raise ValueError(f"ioaa_slack={self.ioaa_slack!r} must be in (0, 1]")
        if not self.ioaa_step_time_s > 0:
            raise ValueError(f"ioaa_step_time_s={self.ioaa_step_time_s!r} must be > 0")

    def check_blocks(self, bs: int) -> None:
        """The checks that need the block size (`bs` tokens per block)."""
        if self.window_tokens % bs:
            raise ValueError(f"window_tokens={self.window_tokens} must be a multiple of block_size={bs} "
                             "(the window is whole blocks)")
        window = self.window_tokens // bs
        if self.budget_tokens < (self.sink_blocks + window + 1) * bs:
            raise ValueError(f"budget_tokens={self.budget_tokens} is below sink + window + one selected block "
                             f"({self.sink_blocks} + {window} + 1 blocks of {bs} = "
                             f"{(self.sink_blocks + window + 1) * bs} tokens); raise budget_tokens or "
                             "shrink sink_blocks / window_tokens")
        middle = -(-self.budget_tokens // bs) - self.sink_blocks - window
        if self.slot_cache_blocks is not None and self.slot_cache_blocks < middle:
            raise ValueError(f"slot_cache_blocks={self.slot_cache_blocks} must hold at least one step's selection "
                             f"({middle} blocks)")
        if self.host_kv_tokens is not None and self.host_kv_tokens < bs:
            raise ValueError(f"host_kv_tokens={self.host_kv_tokens} must be >= block_size={bs}")


@dataclasses.dataclass(frozen=True)
class Backends:
    """How the work runs on the device; "auto" is resolved once per engine (pulseinfer_jax/backends.py)."""

    decode_attention: DecodeAttention = option("auto", "pallas (the Pallas kernel), jnp (XLA) or auto (Pallas on a "
                                               "GPU once it passes a start-up check, jnp elsewhere)")
    layer_loop: LayerLoop = option("auto", "scan (one call scanning stacked weights), layerwise (one call per "
                                   "layer) or auto (layerwise on a GPU, scan elsewhere)")
    host_io: HostIO = option("auto", "xla (pool in pinned host memory, XLA host gathers), numpy (pageable RAM, numpy "
                             "gathers; recall ahead gathers on a recall thread), numpy-pinned (numpy, the blocks "
                             "gathered straight into pinned staging: no bounce copy) or auto (on a GPU with recall "
                             "ahead numpy-pinned once it passes a start-up check, else numpy; same-layer recall xla "
                             "once checked; xla off a GPU)")
    moe_strategy: MoEStrategy = option("auto", "mixture-of-experts layers: dense | gather | grouped | grouped-pallas "
                                       "| auto (grouped on CPU, dense / gather by token count on a GPU)")

    def __post_init__(self) -> None:
        check_choices(self)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    mode: Mode = option("dense", "dense: all KV on the GPU; offload: sparse decode with the KV in pinned host "
                        "memory; auto: IOAA decides per request")
    block_size: int = option(16, "tokens per KV block")
    kv_dtype: KVDtype = option("auto", "KV cache storage: auto (the model's dtype) or float8_e4m3fn (float8 values "
                               "with a power-of-two scale per token and KV head: 1.06 bytes per element on the GPU, in "
                               "the host pool and over PCIe)")
    max_batch: int = option(32, "requests decoding together")
    prefill_chunk: int = option(512, "tokens per prefill step (a multiple of block_size)")
    key_chunk: int = option(512, "keys per online-softmax step of prefill attention (a multiple of block_size)")
    kv_cache_tokens: int | None = option(None, "GPU KV pool size in tokens; default what the requests need, capped "
                                         "by gpu_kv_budget")
    gpu_kv_budget: int | None = option(None, "cap on GPU KV bytes (pool + offload metadata); default 4 GiB on CPU, "
                                       "85% of free memory on a GPU. A small value emulates a smaller GPU")
    swap_kv_tokens: int | None = option(None, "host memory for the KV of requests preempted when the GPU pool runs "
                                        "out, in tokens (0: none, their KV is recomputed); default as many as the GPU "
                                        "pool within a quarter of the host's free memory")
    tensor_parallel: int = option(1, "devices that split the model's heads, MLP and experts (a 1-D 'tp' mesh); the "
                                  "model must be loaded for the same number")
    progress: bool | None = option(None, "progress bar over long prefills; default when stderr is a terminal",
                                   cli=False)
    progress_min_tokens: int = option(1024, "prompts at least this long get a progress bar", cli=False)
    offload: OffloadConfig = section(OffloadConfig)
    backends: Backends = section(Backends)

    def __post_init__(self) -> None:
        check_choices(self)
        for name in ("block_size", "max_batch", "prefill_chunk", "key_chunk", "progress_min_tokens", "tensor_parallel"):
            _positive_int(name, getattr(self, name))
        bs = self.block_size
        if self.prefill_chunk % bs or self.key_chunk % bs:
            raise ValueError(f"prefill_chunk={self.prefill_chunk} and key_chunk={self.key_chunk} must be "
                             f"multiples of block_size={bs}")
        _positive_int("swap_kv_tokens", self.swap_kv_tokens, zero_ok=True, none_ok=True)
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < bs:
            raise ValueError(f"kv_cache_tokens={self.kv_cache_tokens} must be >= block_size={bs}")
        if self.gpu_kv_budget is not None:
            _positive_int("gpu_kv_budget", self.gpu_kv_budget)
        self.offload.scoring.check_block_size(bs)  # (in every mode: a bad score_sub_blocks is refused even dense)
        if self.mode != "dense":  # the offload settings matter (and are checked) only when sparse decode can run
            self.offload.check_blocks(bs)

    @classmethod
    def of(cls, **settings: Any) -> EngineConfig:
        """A config from flat setting names: `EngineConfig.of(mode="offload", budget_tokens=1024, recall="sync")`."""
        return replace_flat(cls(), settings)

    def with_settings(self, **settings: Any) -> EngineConfig:
        """This config with the settings named by their flat names replaced."""
        return replace_flat(self, settings)

    def for_context(self, tokens: int) -> EngineConfig:
        """This config with budget_tokens (and slot_cache_blocks) cut to what requests of at most `tokens` tokens
        (prompt + new tokens) can use. A budget that holds every block of the context already attends to all of
        them, as dense decode does; the selection and slot tables are sized by the budget, so a larger one only
        costs time and memory."""
        o, bs = self.offload, self.block_size
        if self.mode == "dense":
            return self
        blocks = max(-(-tokens // bs), o.sink_blocks + self.window_blocks + 1)  # (the smallest budget allowed)
        middle = blocks - o.sink_blocks - self.window_blocks
        settings: dict[str, Any] = {}
        if self.budget_blocks > blocks:
            settings["budget_tokens"] = blocks * bs
        if o.slot_cache_blocks is not None and o.slot_cache_blocks > middle:
            settings["slot_cache_blocks"] = middle
        return self.with_settings(**settings) if settings else self

    @property
    def scoring(self) -> BlockScoring:
        return self.offload.scoring

    @property
    def ablation(self) -> OffloadAblation:
        return self.offload.ablation

    @property
    def window_blocks(self) -> int:
        return self.offload.window_tokens // self.block_size

    @property
    def budget_blocks(self) -> int:
        return -(-self.offload.budget_tokens // self.block_size)

    @property
    def slot_blocks(self) -> int:
        o = self.offload
        middle = self.budget_blocks - o.sink_blocks - self.window_blocks
        return o.slot_cache_blocks if o.slot_cache_blocks is not None else 2 * middle
