"""Engine configuration (frozen, passed explicitly; nothing is read from the environment)."""

from __future__ import annotations

import dataclasses

from models.moe import MoEOptions
from pulseinfer_jax.sparse import BlockScoring

MODES = ("dense", "offload", "auto")
DECODE_ATTENTION = ("auto", "jnp", "pallas")
CHOICES = {
    "selection": ("solohead", "headwise"),
    "solohead": ("normalized_sum", "retrieval_head"),
    "io": ("coalesced", "fragmented"),
    "recall": ("interruptible", "eager", "sync"),
    "offload_placement": ("host", "device"),
    "host_io": ("auto", "xla", "numpy"),
    "layer_loop": ("auto", "scan", "layerwise"),
    "moe_strategy": ("auto", "dense", "gather", "grouped", "grouped-pallas"),
}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    max_batch: int = 32  # requests decoding together
    prefill_chunk: int = 512  # tokens per prefill step (multiple of block_size)
    key_chunk: int = 512  # keys per online-softmax step in prefill attention (multiple of block_size)
    kv_cache_tokens: int | None = None  # GPU KV pool size; None = what the requests need, capped by gpu_kv_budget
    # cap on GPU KV memory (pool + offload metadata), bytes; None = 4 GiB on CPU, 85% of free on GPU. A small
    # value emulates a smaller GPU.
    gpu_kv_budget: int | None = None
    # "dense": all KV on the GPU; "offload": sparse decode with the KV in pinned host memory; "auto": IOAA
    # decides per request (pulseinfer_jax/ioaa.py)
    mode: str = "dense"
    # ---- sparse decode / offloading (modes offload and auto) ----
    budget_tokens: int = 2048  # tokens attended per sparse layer and step (sinks + window + selected blocks)
    selection: str = "solohead"  # one block set per layer for all KV heads, or "headwise" (one per head)
    solohead: str = "normalized_sum"  # SoloHead aggregate, or "retrieval_head" (needs retrieval_heads)
    retrieval_heads: tuple[int, ...] | None = None  # KV head per sparse layer (sparse.calibrate_retrieval_head)
    # block score = q.mid + score_beta * |q|.half of the block's key bounds: 1 = Quest's upper bound, 0 = the
    # midpoint dot product (pallas_kernels/block_scoring.py). 0.5: measured on SmolLM2 (bench/RESULTS.md), KL to
    # dense down 10-40% at every budget, no passkey lost
    score_beta: float = 0.5
    # SoloHead normalized_sum scores and softmaxes each query head on its own (else per KV head on its group's
    # summed bounds): same metadata, KL to dense down 4-17% on SmolLM2 (bench/RESULTS.md), ~20% more recall
    score_per_query_head: bool = True
    # key bounds per 1/m slice of a block (m metadata rows per block: m times the bytes that stay on the GPU and
    # that scoring reads each step); m = 2 cuts the KL to dense a further 8-24% on SmolLM2 (bench/RESULTS.md)
    score_sub_blocks: int = 1
    # SoloHead normalized_sum also scores the sink and window blocks (from their resident keys), so a head whose
    # attention sits there claims less of the middle: KL to dense down 3-15% at 512-2,048 tokens (RESULTS.md)
    score_kept_blocks: bool = True
    # SoloHead normalized_sum ranks a block already in the layer's slot cache as if it held (1 + bonus) x its
    # estimated attention share: a block not resident must beat it by that factor to be recalled (0 = off).
    # 0.25: 15-20% less recall on SmolLM2, KL to dense unchanged at 2,048 tokens, +1-9% at 1,024 (RESULTS.md)
    resident_bonus: float = 0.25
    # how the key bounds are stored on the GPU (read by every scoring step, kept for every block of an offloaded
    # request): "float8_e4m3fn", rounded outward (half of bf16's bytes; KL to dense -5% to +12% on SmolLM2, no
    # passkey lost, bench/RESULTS.md), or "kv" (the KV dtype, exact)
    score_bounds_dtype: str = "float8_e4m3fn"
    # two-level scoring (1 = off): score groups of this many blocks first from their combined bounds, then only the
    # blocks of the best groups (score_coarse_keep x the middle budget's worth): at long contexts a step reads
    # ~1 / group of the metadata instead of all of it (bench/RESULTS.md); host rows are allocated in groups
    score_coarse_group: int = 1
    score_coarse_keep: float = 2.0
    io: str = "coalesced"  # one gathered copy per layer and step, or "fragmented" (one per (block, head))
    # attend resident blocks while recall is in flight; "eager": the same, with that attention queued before the
    # driver reads the layer's plan (pipeline.py); "sync": wait for the recall first (baseline)
    recall: str = "interruptible"
    # offloaded batch split; the driver runs whichever has its data ready. None = 2 on a GPU (a copy engine
    # to hide), 1 elsewhere (measured on CPU: 2 micro-batches cost +25% step time and hide nothing)
    micro_batches: int | None = None
    sink_blocks: int = 1  # first blocks always attended
    window_tokens: int = 64  # recent tokens always attended and kept on the GPU (a multiple of block_size)
    dense_layers: int = 2  # first layers attend densely (their KV stays on the GPU, packed)
    slot_cache_blocks: int | None = None  # recalled-block cache per (request, sparse layer); None = 2x the budget
    host_kv_tokens: int | None = None  # pinned host pool size in tokens; None = what the requests need
    h2d_bytes_per_s: float | None = None  # host-to-device bandwidth for IOAA; None = measured on GPU, 16e9 else
    ioaa_slack: float = 0.8  # fraction of a decode step recall may take (IOAA)
    ioaa_step_time_s: float = 0.02  # decode step time IOAA assumes before it has measured one
    offload_placement: str = "host"  # "device" keeps the KV of sparse requests on the GPU (no I/O; ablation)
    # how the host pool's bytes move (host_offload/host_pool.py): "xla" = pool on pinned_host, XLA host gathers
    # (the fast path); "numpy" = pool in pageable RAM, numpy gathers + plain device_put (portable, slower);
    # "auto" = "xla" after a start-up probe on a GPU, "numpy" with a warning if the probe fails; "xla" elsewhere
    host_io: str = "auto"
    progress: bool | None = None  # progress bar over long prefills; None = only when stderr is a terminal
    progress_min_tokens: int = 2048  # prompts at least this long get a progress bar
    # decode attention: "pallas" (pallas_kernels.sparse_decode_attention, every block listed), "jnp" (XLA), or
    # "auto": Pallas on a GPU, falling back to jnp with a warning if the kernel fails to compile there; jnp
    # elsewhere (off-GPU the kernel runs in Pallas interpret mode: correct but slow, for tests)
    decode_attention: str = "auto"
    # how a dense decode step runs the layers (runner.py): "scan" = one jitted call scanning the stacked
    # weights; "layerwise" = one jitted call per layer on that layer's own weight arrays (what the sparse
    # pipeline does: no per-step weight slicing, one dispatch per layer; the engine then keeps the weights per
    # layer only, LoadedModel.unstack, and prefills layer-wise too); "auto" = layerwise on a GPU (dense and
    # offloaded requests then read weights the same way), scan elsewhere (XLA:CPU: fewer dispatches)
    layer_loop: str = "auto"
    # mixture-of-experts layers (models/moe.py): "dense" = every expert on every token; "gather" = the picked
    # experts' weights gathered per token; "grouped" = (token, expert) pairs sorted into per-expert row tiles,
    # jnp tile loop; "grouped-pallas" = the same tiles through pallas_kernels/grouped_matmul.py (GPU);
    # "auto" = grouped on CPU (fastest at every token count measured), dense / gather by token count on a GPU
    # until the grouped paths are timed there (bench/moe_ffn.py)
    moe_strategy: str = "auto"

    def __post_init__(self) -> None:
        for name in ("block_size", "max_batch", "prefill_chunk", "key_chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        bs = self.block_size
        if self.prefill_chunk % bs or self.key_chunk % bs:
            raise ValueError(f"prefill_chunk={self.prefill_chunk} and key_chunk={self.key_chunk} must be "
                             f"multiples of block_size={bs}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < bs:
            raise ValueError(f"kv_cache_tokens={self.kv_cache_tokens} must be >= block_size={bs}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention={self.decode_attention!r}; use one of {', '.join(DECODE_ATTENTION)}")
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not supported; use one of {', '.join(MODES)}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; use one of {', '.join(allowed)}")
        for name in ("budget_tokens", "micro_batches", "window_tokens"):
            v = getattr(self, name)
            if name == "micro_batches" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        for name in ("sink_blocks", "dense_layers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name}={v!r} must be a non-negative integer")
        if self.mode != "dense":  # sparse knobs matter (and are checked) only when sparse decode can run
            if self.window_tokens % bs:
                raise ValueError(f"window_tokens={self.window_tokens} must be a multiple of block_size={bs} "
                                 "(the window is whole blocks)")
            if self.budget_tokens < (self.sink_blocks + self.window_blocks + 1) * bs:
                raise ValueError(f"budget_tokens={self.budget_tokens} is below sink + window + one selected block "
                                 f"({self.sink_blocks} + {self.window_blocks} + 1 blocks of {bs} = "
                                 f"{(self.sink_blocks + self.window_blocks + 1) * bs} tokens); raise budget_tokens or "
                                 "shrink sink_blocks / window_tokens")
            if self.slot_cache_blocks is not None and self.slot_cache_blocks < self.budget_blocks - self.sink_blocks - \
                    self.window_blocks:
                raise ValueError(f"slot_cache_blocks={self.slot_cache_blocks} must hold at least one step's selection "
                                 f"({self.budget_blocks - self.sink_blocks - self.window_blocks} blocks)")
            if self.solohead == "retrieval_head" and self.retrieval_heads is None:
                raise ValueError("solohead='retrieval_head' needs retrieval_heads (one KV head per sparse layer; see "
                                 "sparse.calibrate_retrieval_head)")
        if self.host_kv_tokens is not None and self.host_kv_tokens < bs:
            raise ValueError(f"host_kv_tokens={self.host_kv_tokens} must be >= block_size={bs}")
        if self.h2d_bytes_per_s is not None and not self.h2d_bytes_per_s > 0:
            raise ValueError(f"h2d_bytes_per_s={self.h2d_bytes_per_s!r} must be > 0")
        self.scoring.check_block_size(bs)  # and the scoring fields themselves (BlockScoring's checks)
        if not 0 < self.ioaa_slack <= 1:
            raise ValueError(f"ioaa_slack={self.ioaa_slack!r} must be in (0, 1]")

    @property
    def scoring(self) -> BlockScoring:
        return BlockScoring(beta=self.score_beta, per_query_head=self.score_per_query_head,
                            sub_blocks=self.score_sub_blocks, kept_blocks=self.score_kept_blocks,
                            resident_bonus=self.resident_bonus, bounds_dtype=self.score_bounds_dtype,
                            coarse_group=self.score_coarse_group, coarse_keep=self.score_coarse_keep)

    @property
    def window_blocks(self) -> int:
        return self.window_tokens // self.block_size

    @property
    def budget_blocks(self) -> int:
        return -(-self.budget_tokens // self.block_size)

    @property
    def slot_blocks(self) -> int:
        middle = self.budget_blocks - self.sink_blocks - self.window_blocks
        return self.slot_cache_blocks if self.slot_cache_blocks is not None else 2 * middle


def resolve_layer_loop(choice: str, platform: str) -> str:
    """The layer loop an engine on `platform` runs for the configured `choice` ("auto": layer-wise on a GPU)."""
    if choice != "auto":
        return choice
    from pallas_kernels.common import GPU_PLATFORMS

    return "layerwise" if platform in GPU_PLATFORMS else "scan"


def weights_layout(choice: str, platform: str) -> str:
    """How `models.loading.load_model` should lay out the layer weights for an engine with this layer loop: one
    pytree per layer for a layer-wise engine (loaded that way, never stacked), stacked for a scan."""
    return "layers" if resolve_layer_loop(choice, platform) == "layerwise" else "stacked"


def moe_options(choice: str, platform: str) -> MoEOptions:
    """The MoE options (models/moe.py) an engine on `platform` runs for the configured `moe_strategy`."""
    if choice == "grouped-pallas":
        return MoEOptions("grouped", "pallas", platform)
    return MoEOptions(choice, "jnp", platform)


def resolve_decode_attention(choice: str, platform: str) -> str:
    """The decode attention an engine on `platform` uses for the configured `choice`."""
    if choice != "auto":
        return choice
    from pallas_kernels.common import GPU_PLATFORMS

    return "pallas" if platform in GPU_PLATFORMS else "jnp"
