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
                   device: Any = None) -> dict:
    """Build the params pytree from HF-named arrays ([out, in] layout), cast to `dtype`, on `device`.

    `tensors` may be lazy (loaded on access). Raises CheckpointError naming the first missing tensor or
    wrong shape.
    """
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
    layers: dict[str, dict] = {}
    pre = "model.layers.{}."
    for ours, hf in _LAYER_KERNELS.items():
        stack = [get(pre.format(i) + hf + ".weight", shapes[ours]).T for i in range(cfg.num_layers)]
        layers[ours] = {"kernel": put(np.stack(stack))}
    if cfg.attention_bias:
        for ours in ("wq", "wk", "wv"):
            hf = _LAYER_KERNELS[ours]
            stack = [get(pre.format(i) + hf + ".bias", shapes[ours][:1]) for i in range(cfg.num_layers)]
            layers[ours]["bias"] = put(np.stack(stack))
    norms = dict(_LAYER_NORMS)
    if cfg.qk_norm:
        norms.update(_QK_NORMS)
    for ours, hf in norms.items():
        size = cfg.head_dim if ours in _QK_NORMS else cfg.hidden_size
        stack = [get(pre.format(i) + hf + ".weight", (size,)) for i in range(cfg.num_layers)]
        layers[ours] = {"weight": put(np.stack(stack))}

    v, d = cfg.vocab_size, cfg.hidden_size
    emb = {"embed": {"embedding": put(get("model.embed_tokens.weight", (v, d)))},
           "final_norm": {"weight": put(get("model.norm.weight", (d,)))}}
    if not cfg.tie_word_embeddings:
        emb["lm_head"] = {"kernel": put(get("lm_head.weight", (v, d)).T)}
    return {"embedder": emb, "layers": layers}
