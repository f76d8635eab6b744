"""Engine configuration (frozen, passed explicitly; nothing is read from the environment)."""

from __future__ import annotations

import dataclasses

MODES = ("dense",)  # "offload" and "auto" arrive with the host-offload issue
DECODE_ATTENTION = ("auto", "jnp", "pallas")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    max_batch: int = 32  # requests decoding together
    prefill_chunk: int = 512  # tokens per prefill step (multiple of block_size)
    key_chunk: int = 512  # keys per online-softmax step in prefill attention (multiple of block_size)
    kv_cache_tokens: int | None = None  # KV pool size; None = what the requests need, capped by kv_cache_bytes
    kv_cache_bytes: int | None = None  # cap for the automatic size; None = 4 GiB on CPU, 85% of free on GPU
    mode: str = "dense"
    progress: bool | None = None  # progress bar over long prefills; None = only when stderr is a terminal
    progress_min_tokens: int = 2048  # prompts at least this long get a progress bar
    # decode attention: "pallas" (pallas_kernels.sparse_decode_attention, every block listed), "jnp" (XLA), or
    # "auto": Pallas on a GPU, falling back to jnp with a warning if the kernel fails to compile there; jnp
    # elsewhere (off-GPU the kernel runs in Pallas interpret mode: correct but slow, for tests)
    decode_attention: str = "auto"

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


def resolve_decode_attention(choice: str, platform: str) -> str:
    """The decode attention an engine on `platform` uses for the configured `choice`."""
    if choice != "auto":
        return choice
    from pallas_kernels.common import GPU_PLATFORMS

    return "pallas" if platform in GPU_PLATFORMS else "jnp"
