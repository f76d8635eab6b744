"""Map Hugging Face parameter names/layouts onto the stacked Flax params pytree of `models.transformer`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from pulseinfer_jax.models.config import ModelConfig
from pulseinfer_jax.models.sharding import WeightPlacement

# our layer param path -> HF suffix under `model.layers.{i}.`; kernels are transposed [out,in] -> [in,out].
_LAYER_KERNELS = {
    "wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
    "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj",
}
_LAYER_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_QK_NORMS = {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
_MLP_KERNELS = ("w_gate", "w_up", "w_down")  # replaced by the experts in a mixture-of-experts model


class CheckpointError(ValueError):
    """A checkpoint is missing tensors, has wrong shapes, or is corrupt."""


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d, f = cfg.hidden_size, cfg.intermediate_size
    return {"wq": (cfg.q_dim, d), "wk": (cfg.kv_dim, d), "wv": (cfg.kv_dim, d), "wo": (d, cfg.q_dim),
            "w_gate": (f, d), "w_up": (f, d), "w_down": (d, f)}


def params_from_hf(cfg: ModelConfig, tensors: Mapping[str, Any], dtype: Any, source: str = "checkpoint",
                   device: Any = None, layout: str = "stacked", placement: WeightPlacement | None = None) -> dict:
    """Build the params pytree from HF-named arrays ([out, in] layout), cast to `dtype`, on `device`.

    `tensors` may be lazy (loaded on access). layout "stacked": each layer weight stacked on a leading layer axis;
    "layers": "layers" is a list of one pytree per layer (`models.transformer.unstack_layers`), put on the device
    layer by layer (never stacked there). With `placement` (tensor parallelism, parallel/weights.py) each weight goes
    straight into its shards on the mesh instead of onto `device`. Raises CheckpointError naming the first missing
    tensor or wrong shape.
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

    def put(arr: np.ndarray, *path: str) -> jax.Array:
        arr = arr.astype(np_dtype, copy=False)
        return jax.device_put(arr, device) if placement is None else placement.put(path, arr)

    def stacked(host: Callable[[int], np.ndarray]) -> np.ndarray:
        """[L, ...] in the model dtype, filled layer by layer: the host holds the stacked array plus one layer in
        the checkpoint's dtype (np.stack + astype would hold it twice, 2x a 30B model's experts for a GGUF's
        float32 dequantisation)."""
        first = host(0)
        out = np.empty((cfg.num_layers, *first.shape), np_dtype)
        out[0] = first
        for i in range(1, cfg.num_layers):
            out[i] = host(i)
        return out

    shapes = _expected_shapes(cfg)
    norms = dict(_LAYER_NORMS)
    if cfg.qk_norm:
        norms.update(_QK_NORMS)
    kernels = {k: v for k, v in _LAYER_KERNELS.items() if not (cfg.is_moe and k in _MLP_KERNELS)}

    def kernel(suffix: str, shape: tuple[int, ...]) -> Callable[[int], np.ndarray]:
        return lambda i: get(f"model.layers.{i}.{suffix}", shape).T

    def plain(suffix: str, shape: tuple[int, ...]) -> Callable[[int], np.ndarray]:
        return lambda i: get(f"model.layers.{i}.{suffix}", shape)

    # (our weight, leaf, layer index -> host array in our layout) of every per-layer tensor
    specs = [(ours, "kernel", kernel(hf + ".weight", shapes[ours])) for ours, hf in kernels.items()]
    if cfg.attention_bias:
        specs += [(ours, "bias", plain(_LAYER_KERNELS[ours] + ".bias", shapes[ours][:1]))
                  for ours in ("wq", "wk", "wv")]
    specs += [(ours, "weight", plain(hf + ".weight", (cfg.head_dim if ours in _QK_NORMS else cfg.hidden_size,)))
              for ours, hf in norms.items()]
    if cfg.is_moe:
        specs += _moe_specs(cfg, tensors, get)

    if layout == "layers":
        layers: Any = []
        for i in range(cfg.num_layers):
            lp: dict[str, dict] = {}
            for ours, leaf, host in specs:
                lp.setdefault(ours, {})[leaf] = put(host(i), ours, leaf)
            layers.append(lp)
    elif placement is None:  # one tensor kind at a time over all layers: the host holds one stacked weight at most
        layers = {}
        for ours, leaf, host in specs:
            layers.setdefault(ours, {})[leaf] = put(stacked(host), ours, leaf)
    else:  # tensor parallel: each device's shard of a stacked weight built on its own (1 / tp of it on the host)
        layers = {}
        for ours, leaf, host in specs:
            layers.setdefault(ours, {})[leaf] = _stacked_shards(lambda i, h=host: h(i).astype(np_dtype, copy=False),
                                                                cfg.num_layers, (ours, leaf), placement)

    v, d = cfg.vocab_size, cfg.hidden_size
    emb = {"embed": {"embedding": put(get("model.embed_tokens.weight", (v, d)), "embed", "embedding")},
           "final_norm": {"weight": put(get("model.norm.weight", (d,)), "final_norm", "weight")}}
    if not cfg.tie_word_embeddings:
        emb["lm_head"] = {"kernel": put(get("lm_head.weight", (v, d)).T, "lm_head", "kernel")}
    return {"embedder": emb, "layers": layers}


def _stacked_shards(host: Callable[[int], np.ndarray], num_layers: int, path: tuple[str, ...],
                    placement: WeightPlacement) -> jax.Array:
    """A weight stacked over `num_layers` layers, laid out by `placement`, made shard by shard: each device's shard
    [L, local...] is filled layer by layer from `host(i)` (the checkpoint's layer, memory-mapped or lazily read), so the
    host never holds more than one device's shard of it."""
    first = placement.prepare(path, host(0))
    shape = (num_layers, *first.shape)
    sharding = placement.sharding(path, len(shape))

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        layers = range(*index[0].indices(num_layers))
        rest = index[1:]
        out = np.empty((len(layers), *first[rest].shape), first.dtype)
        for j, i in enumerate(layers):
            out[j] = (first if i == 0 else placement.prepare(path, host(i)))[rest]
        return out

    return jax.make_array_from_callback(shape, sharding, shard)


def _moe_specs(cfg: ModelConfig, tensors: Mapping[str, Any],
               get: Callable[[str, tuple[int, ...]], np.ndarray]) -> list[tuple[str, str, Callable]]:
    """The experts of every layer (models/moe.py layout) from either checkpoint spelling: one tensor per expert
    and projection (`mlp.experts.{e}.gate_proj.weight` [f, d] ..., what the released Qwen3-MoE checkpoints hold
    and transformers saves) or transformers 5's fused `mlp.experts.gate_up_proj` [E, 2f, d] / `down_proj` [E, d, f]."""
    d, e_n, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size

    def fused(i: int) -> bool:
        return f"model.layers.{i}.mlp.experts.gate_up_proj" in tensors

    def router(i: int) -> np.ndarray:
        return get(f"model.layers.{i}.mlp.gate.weight", (e_n, d)).T  # [d, E]

    def gate_up(i: int) -> np.ndarray:  # [d, E, 2f]
        pre = f"model.layers.{i}.mlp.experts"
        if fused(i):
            return get(f"{pre}.gate_up_proj", (e_n, 2 * f, d)).transpose(2, 0, 1)
        out = None
        for e in range(e_n):
            g, u = (get(f"{pre}.{e}.{w}_proj.weight", (f, d)) for w in ("gate", "up"))
            if out is None:  # in the checkpoint's dtype: a float32 copy of a bf16 layer would be twice the size
                out = np.empty((d, e_n, 2 * f), g.dtype)
            out[:, e, :f], out[:, e, f:] = g.T, u.T
        return out

    def down(i: int) -> np.ndarray:  # [E, f, d]
        pre = f"model.layers.{i}.mlp.experts"
        if fused(i):
            return get(f"{pre}.down_proj", (e_n, d, f)).transpose(0, 2, 1)
        return np.stack([get(f"{pre}.{e}.down_proj.weight", (d, f)).T for e in range(e_n)])

    return [("moe", "router", router), ("moe", "gate_up", gate_up), ("moe", "down", down)]
