"""The whole decoder: embedder + a stack of layers whose params are stacked on a leading layer axis.

Params pytree (arrays; `L` = num_layers):
    {"embedder": {"embed": {"embedding": [V, D]}, "final_norm": {"weight": [D]}, "lm_head"?: {"kernel": [D, V]}},
     "layers": {"wq": {"kernel": [L, D, Hq*hd], "bias"?: [L, Hq*hd]}, ..., "attn_norm": {"weight": [L, D]}, ...}}
Stacking lets the dense step scan over layers (one compiled layer body, fast compiles); the layer-wise
drivers use `split_layers` (one pytree per layer, so no call slices weights out of the stack).
A params pytree may instead hold "layers" as a list of L such per-layer pytrees (`unstack_layers`: what a
layer-wise engine keeps, so the weights exist once); every function here accepts both layouts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int
from pulseinfer_jax.models.config import ModelConfig
from pulseinfer_jax.models.llama import AttendFn, DecoderLayer, Embedder
from pulseinfer_jax.models.moe import MoEOptions
from pulseinfer_jax.models.qwen3 import Qwen3DecoderLayer
from pulseinfer_jax.models.qwen3_moe import Qwen3MoeDecoderLayer
from pulseinfer_jax.models.rope import rope_tables

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def split_layers(params: dict) -> list[dict]:
    """The layer weights as one pytree per layer: the list itself for the per-layer layout, else copies sliced
    out of the stacked arrays (a second copy of the layer weights)."""
    layers = params["layers"]
    if isinstance(layers, list):
        return layers
    n = jax.tree.leaves(layers)[0].shape[0]
    return [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(n)]


def head_params(params: dict) -> dict:
    """The params that are not layer weights (embedding, final norm, LM head): what `Transformer.embed` and
    `Transformer.logits` read. Layer-wise drivers pass only these to their embed / logits calls."""
    return {"embedder": params["embedder"]}


def unstack_layers(params: dict) -> dict:
    """A new params dict with "layers" as one pytree per layer (already per-layer: `params` itself). The
    slices are copies: both layouts exist until the caller drops the stacked `params`."""
    if isinstance(params["layers"], list):
        return params
    return {**params, "layers": split_layers(params)}


def stacked_layers(params: dict) -> dict:
    """The layer weights stacked on a leading layer axis (a copy when they are kept per layer)."""
    layers = params["layers"]
    return jax.tree.map(lambda *a: jnp.stack(a), *layers) if isinstance(layers, list) else layers


def resolve_dtype(dtype: str | Any) -> Any:
    """'float32' | 'bfloat16' | 'float16' (or the jnp dtype) -> jnp dtype; anything else is a clear error."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    for v in DTYPES.values():
        if jnp.dtype(dtype) == jnp.dtype(v):
            return v
    raise ValueError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)}")


@dataclasses.dataclass(frozen=True)
class Transformer:
    """Stateless functions over a params pytree; `cfg` and `dtype` are static."""

    cfg: ModelConfig
    dtype: Any = jnp.float32
    moe: MoEOptions = MoEOptions()  # how mixture-of-experts layers compute (ignored by dense models)

    @property
    def layer_module(self) -> DecoderLayer:
        if self.cfg.is_moe:
            return Qwen3MoeDecoderLayer(self.cfg, self.dtype, moe_options=self.moe)
        return (Qwen3DecoderLayer if self.cfg.qk_norm else DecoderLayer)(self.cfg, self.dtype)

    @property
    def embedder(self) -> Embedder:
        return Embedder(self.cfg, self.dtype)

    def init(self, key: Array) -> dict:
        """Random params (normal std 0.02, norms at 1), built inside whatever jit/device context calls it."""
        k_emb, k_layers = self.init_keys(key)
        return {"embedder": self.init_embedder(k_emb), "layers": jax.vmap(self.init_layer)(k_layers)}

    def init_keys(self, key: Array) -> tuple[Array, Array]:
        """(embedder key, one key per layer) of `init`: `init_layer(k_layers[i])` is layer i of `init(key)`, so
        random weights can be built one layer at a time (a 30B model's stacked init would not fit twice)."""
        k_emb, k_layers = jax.random.split(key)
        return k_emb, jax.random.split(k_layers, self.cfg.num_layers)

    def init_embedder(self, key: Array) -> dict:
        c = self.cfg
        emb = self.embedder.init(key, jnp.zeros((1, 1), jnp.int32))["params"]
        emb_logits = self.embedder.init(key, jnp.zeros((1, 1, c.hidden_size), self.dtype),
                                        method=Embedder.logits)["params"]
        return {**emb, **emb_logits}

    def init_layer(self, key: Array) -> dict:
        c = self.cfg
        dummy_x = jnp.zeros((1, 1, c.hidden_size), self.dtype)
        dummy_cs = jnp.zeros((1, 1, c.head_dim // 2), jnp.float32)

        def attend(q, k, v, s):
            return jnp.repeat(v, c.group_size, axis=2), s

        return self.layer_module.init(key, dummy_x, dummy_cs, dummy_cs, attend, None)["params"]

    def embed(self, params: dict, tokens: Int[Array, "b t"]) -> Float[Array, "b t d"]:
        return self.embedder.apply({"params": params["embedder"]}, tokens)

    def logits(self, params: dict, x: Float[Array, "... d"]) -> Float[Array, "... vocab"]:
        return self.embedder.apply({"params": params["embedder"]}, x, method=Embedder.logits)

    def layer(self, layer_params: dict, x: Array, cos: Array, sin: Array, attend: AttendFn,
              state: Any) -> tuple[Array, Any]:
        """One decoder layer with params already sliced to that layer."""
        return self.layer_module.apply({"params": layer_params}, x, cos, sin, attend, state)

    def layer_qkv(self, layer_params: dict, x: Array, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
        """One layer up to attention (q [b,t,Hq,hd], k/v [b,t,Hkv,hd]); for drivers that run attention outside."""
        return self.layer_module.apply({"params": layer_params}, x, cos, sin, method=DecoderLayer.project_qkv)

    def layer_finish(self, layer_params: dict, x: Array, o: Array) -> Array:
        """One layer after attention: x + wo(o), then the MLP block."""
        return self.layer_module.apply({"params": layer_params}, x, o, method=DecoderLayer.finish)

    def layers(
        self,
        params: dict,
        x: Float[Array, "b t d"],
        positions: Int[Array, "b t"],
        attend: Any,
        state: Any,
    ) -> tuple[Float[Array, "b t d"], Any]:
        """Scan all layers. attend(layer_idx, q, k, v, state) -> (o, state); state is the scan carry. With
        per-layer params (a list, see `unstack_layers`) the layers run as an unrolled loop instead (same
        arithmetic; a longer compile)."""
        cos, sin = rope_tables(self.cfg, positions)
        if isinstance(params["layers"], list):
            for i, lp in enumerate(params["layers"]):
                idx = jnp.int32(i)
                x, state = self.layer(lp, x, cos, sin, lambda q, k, v, s, idx=idx: attend(idx, q, k, v, s), state)
            return x, state

        def body(carry, xs):
            h, st = carry
            lp, idx = xs
            h, st = self.layer(lp, h, cos, sin, lambda q, k, v, s: attend(idx, q, k, v, s), st)
            return (h, st), None

        idxs = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
        (x, state), _ = jax.lax.scan(body, (x, state), (params["layers"], idxs))
        return x, state

    def causal_attention(self, q: Float[Array, "b t Hq hd"], k: Float[Array, "b t Hkv hd"],
                         v: Float[Array, "b t Hkv hd"]) -> Float[Array, "b t Hq hd"]:
        """Plain causal GQA attention over the whole sequence: O(t^2) scores in float32, HIGHEST precision."""
        c = self.cfg
        b, t = q.shape[:2]
        causal = jnp.tril(jnp.ones((t, t), bool))
        qg = q.astype(jnp.float32).reshape(b, t, c.num_kv_heads, c.group_size, c.head_dim)
        hi = jax.lax.Precision.HIGHEST
        sc = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k.astype(jnp.float32), precision=hi) * c.head_dim ** -0.5
        p = jax.nn.softmax(jnp.where(causal, sc, -jnp.inf), axis=-1)
        o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32), precision=hi)
        return o.reshape(b, t, c.num_heads, c.head_dim).astype(q.dtype)

    def forward(self, params: dict, tokens: Int[Array, "b t"]) -> Float[Array, "b t vocab"]:
        """Plain causal forward without a cache: O(t^2) scores, for tests and as the oracle."""
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

        def attend(_, q, k, v, s):
            return self.causal_attention(q, k, v), s

        x, _ = self.layers(params, self.embed(params, tokens), positions, attend, None)
        return self.logits(params, x)
