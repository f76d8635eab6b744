"""Model configuration: one frozen dataclass for every supported decoder family.

`ModelConfig.from_hf_dict` reads a Hugging Face `config.json` dict in either spelling that real
checkpoints use: the older `rope_theta` + `rope_scaling`, or transformers 5's `rope_parameters`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

# model_type -> family implemented in models/. Llama, Mistral, Qwen2 and SmolLM2 (a Llama) share one
# implementation; Qwen3 adds q/k RMSNorm and an explicit head_dim; Qwen3-MoE replaces the MLP with routed experts.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or option this engine does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1 style frequency-dependent RoPE scaling (`rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (`rope_type == "yarn"`, e.g. Qwen3 at 128K): frequencies interpolated by `factor` below
    a ramp between beta_slow and beta_fast rotations over the original context, extrapolated above it, and
    cos/sin scaled by `attention_factor` (Hugging Face's `_compute_yarn_parameters`)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # None = 0.1 * ln(factor) + 1 (or the mscale ratio when given)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def cos_sin_scale(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim)
        return get_mscale(self.factor)

    def inv_freq(self, theta: float, dim: int) -> np.ndarray:
        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # as Hugging Face: no zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolate = 1 - ramp  # 1 = keep the original frequency (high frequencies), 0 = interpolate by factor
        pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        return (1 / (self.factor * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | YarnScaling | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    # Mixture of experts (Qwen3-MoE): every layer's MLP is `num_experts` SwiGLU experts of width
    # `moe_intermediate_size`; a router picks `num_experts_per_tok` per token (0 experts: a dense MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the picked experts' router probabilities to sum to 1

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type={self.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "max_position_embeddings"):
            if int(getattr(self, field)) < 1:
                raise ValueError(f"{field}={getattr(self, field)} must be >= 1 (corrupt config?)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size >= 1):
            raise ValueError(f"a mixture of experts needs 1 <= num_experts_per_tok ({self.num_experts_per_tok}) <= "
                             f"num_experts ({self.num_experts}) and moe_intermediate_size >= 1 "
                             f"({self.moe_intermediate_size}): corrupt config?")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        return 2 * self.num_layers * self.kv_dim * dtype_bytes

    def num_parameters(self, active: bool = False) -> int:
        """Weights of the model; `active`: only those one token reads (a mixture of experts: its k experts)."""
        d, f, layers = self.hidden_size, self.intermediate_size, self.num_layers
        attn = d * self.q_dim + 2 * d * self.kv_dim + self.q_dim * d
        if self.attention_bias:
            attn += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        picked = self.num_experts_per_tok if active else self.num_experts
        mlp = (picked * 3 * d * self.moe_intermediate_size + d * self.num_experts if self.is_moe else 3 * d * f)
        per_layer = attn + mlp + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return layers * per_layer + embed + d

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies, float64 [head_dim // 2], with llama3 / YaRN scaling applied if configured."""
        exponents = np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim
        inv = 1.0 / (self.rope_theta ** exponents)
        s = self.rope_scaling
        if s is None:
            return inv
        if isinstance(s, YarnScaling):
            return s.inv_freq(self.rope_theta, self.head_dim)
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)

    @property
    def rope_cos_sin_scale(self) -> float:
        """Factor on RoPE's cos and sin (YaRN's attention factor; 1 otherwise)."""
        return self.rope_scaling.cos_sin_scale() if isinstance(self.rope_scaling, YarnScaling) else 1.0

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "") -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict (either rope spelling)."""
        model_type = d.get("model_type")
        if model_type is None:
            raise UnsupportedModelError(f"config of {name or 'model'} has no 'model_type'; is it a decoder LM config?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type={model_type!r} ({name}) is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            hidden = int(d["hidden_size"])
            heads = int(d["num_attention_heads"])
            layers = int(d["num_hidden_layers"])
            inter = int(d["intermediate_size"])
            vocab = int(d["vocab_size"])
        except KeyError as e:
            raise ValueError(f"config of {name or 'model'} lacks required key {e.args[0]!r}") from None
        head_dim = d.get("head_dim") or hidden // heads
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported (only SwiGLU/silu)")
        rope = d.get("rope_parameters") or {}
        spec = rope or (d.get("rope_scaling") or {})
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        rope_type = spec.get("rope_type", spec.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(spec["factor"]),
                low_freq_factor=float(spec["low_freq_factor"]),
                high_freq_factor=float(spec["high_freq_factor"]),
                original_max_position_embeddings=int(spec["original_max_position_embeddings"]),
            )
        elif rope_type == "yarn":
            opt = {k: spec[k] for k in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")
                   if spec.get(k) is not None}
            original = spec.get("original_max_position_embeddings") or d.get("max_position_embeddings", 4096)
            factor = spec.get("factor")
            if factor is None:
                factor = int(d.get("max_position_embeddings", 4096)) / int(original)
            scaling = YarnScaling(factor=float(factor), original_max_position_embeddings=int(original),
                                  truncate=bool(spec.get("truncate", True)), **{k: float(v) for k, v in opt.items()})
        elif rope_type != "default":
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (supported: default, llama3, "
                                        "yarn)")
        window = d.get("sliding_window")
        max_pos = int(d.get("max_position_embeddings", 4096))
        if model_type in ("mistral", "qwen2", "qwen3", "qwen3_moe") and window and d.get("use_sliding_window", True):
            if int(window) < max_pos:
                # Full attention up to the window is exact; past it we would silently differ.
                max_pos = int(window)
        moe = _moe_fields(d, model_type, name)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            **moe,
        )


def _moe_fields(d: dict[str, Any], model_type: str, name: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE config.json (`num_experts`, spelled `num_local_experts` by
    transformers 5.2x); only every-layer-sparse models are implemented (Qwen3-30B-A3B, Qwen3-235B-A22B)."""
    if model_type != "qwen3_moe":
        return {}
    experts = d.get("num_experts", d.get("num_local_experts"))
    try:
        fields = {"num_experts": int(experts), "num_experts_per_tok": int(d["num_experts_per_tok"]),
                  "moe_intermediate_size": int(d["moe_intermediate_size"]),
                  "norm_topk_prob": bool(d.get("norm_topk_prob", False))}
    except (KeyError, TypeError) as e:
        raise ValueError(f"qwen3_moe config of {name or 'model'} lacks num_experts / num_experts_per_tok / "
                         f"moe_intermediate_size ({e})") from None
    step, dense_layers = int(d.get("decoder_sparse_step", 1)), list(d.get("mlp_only_layers") or [])
    if step != 1 or dense_layers:
        raise UnsupportedModelError(
            f"{name or 'model'}: qwen3_moe with dense MLP layers (decoder_sparse_step={step}, mlp_only_layers="
            f"{dense_layers}) is not supported; only models whose every layer is a mixture of experts are")
    return fields
