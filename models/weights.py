"""Map Hugging Face parameter names/layouts onto the stacked Flax params pytree of `models.transformer`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig

# our layer param path -> HF suffix under `model.layers.{i}.`; kernels are transposed [out,in] -> [in,out].
_LAYER_KERNELS = {
    "wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
    "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj",
}
_LAYER_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_QK_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


class CheckpointError(ValueError):
    """A checkpoint is missing tensors, has wrong shapes, or is corrupt."""


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, f = cfg.hidden_size, cfg.intermediate_size
    return {"wq": (cfg.q_dim, d), "wk": (cfg.kv_dim, d), "wv": (cfg.kv_dim, d), "wo": (d, cfg.q_dim),
            "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)}


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, Any], dtype: Any, source: str = "checkpoint",
                   device: Any = None, layout: str = "stacked") -> dict:
    """Build the params pytree from HF-named arrays ([out, in] layout), cast to `dtype`, on `device`.

    `tensors` may be lazy (loaded on access). layout "stacked": each layer weight stacked on a leading layer axis;
    "layers": "layers" is a list of one pytree per layer (`models.transformer.unstack_layers`), put on the device
    layer by layer (never stacked there). Raises CheckpointError naming the first missing tensor or wrong shape.
    """
    if layout not in ("stacked", "layers"):
        raise ValueError(f"layout={layout!r} must be 'stacked' or 'layers'")
    np_dtype = jnp.dtype(dtype)

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in tensors:
            raise CheckpointError(f"{source} lacks tensor {name!r} (truncated, or not a {cfg.model_type} model?)")
        arr = np.asarray(tensors[name])
        if tuple(arr.shape) != shape:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, expected {shape}")
        return arr

    def put(arr: np.ndarray) -> jax.Array:
        return jax.device_put(arr.astype(np_dtype), device)

    shapes = _expected_shapes(cfg)
    norms = dict(_LAYER_NORMS)
    if cfg.qk_norm:
        norms.update(_QK_NORMS)
    # (our weight, leaf, HF suffix, HF shape, transpose) of every per-layer tensor
    specs = [(ours, "kernel", hf + ".weight", shapes[ours], True) for ours, hf in _LAYER_KERNELS.items()]
    if cfg.attention_bias:
        specs += [(ours, "bias", _LAYER_KERNELS[ours] + ".bias", shapes[ours][:1], False)
                  for ours in ("wq", "wk", "wv")]
    specs += [(ours, "weight", hf + ".weight", (cfg.head_dim if ours in _QK_NORMS else cfg.hidden_size,), False)
              for ours, hf in norms.items()]

    def host(i: int, spec: tuple) -> np.ndarray:
        _, _, suffix, shape, transpose = spec
        a = get(f"model.layers.{i}.{suffix}", shape)
        return a.T if transpose else a

    if layout == "layers":
        layers: Any = []
        for i in range(cfg.num_layers):
            lp: dict[str, dict] = {}
            for spec in specs:
                lp.setdefault(spec[0], {})[spec[1]] = put(host(i, spec))
            layers.append(lp)
    else:  # one tensor kind at a time over all layers: the host holds one stacked weight, not the whole model
        layers = {}
        for spec in specs:
            layers.setdefault(spec[0], {})[spec[1]] = put(np.stack([host(i, spec) for i in range(cfg.num_layers)]))

    v, d = cfg.vocab_size, cfg.hidden_size
    emb = {"embed": {"embedding": put(get("model.embed_tokens.weight", (v, d)))},
           "final_norm": {"weight": put(get("model.norm.weight", (d,)))}}
    if not cfg.tie_word_embeddings:
        emb["lm_head"] = {"kernel": put(get("lm_head.weight", (v, d)).T)}
    return {"embedder": emb, "layers": layers}
