"""Llama-family decoder in Flax (Llama 2/3/3.1, Mistral, Qwen2/2.5 with q/k/v bias, SmolLM2).

GQA attention, RoPE, RMSNorm, SwiGLU MLP. The layer does not own a KV cache: it hands the rotated
q/k/v to an `attend` callable supplied by the engine (dense paged, prefill, later sparse/offloaded),
which writes K/V wherever the engine keeps them and returns the attention output plus whatever state
it threads through the layer loop. This keeps one model implementation for every cache policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int
from pulseinfer_jax.models.config import ModelConfig
from pulseinfer_jax.models.rope import apply_rope
from pulseinfer_jax.pallas_kernels.common import matmul_precision

# attend(q [B,T,Hq,hd], k [B,T,Hkv,hd], v [B,T,Hkv,hd], state) -> (o [B,T,Hq,hd], state)
AttendFn = Callable[[Array, Array, Array, Any], tuple[Array, Any]]


class RMSNorm(nn.Module):
    """y = weight * x / rms(x); statistics in float32 as Hugging Face does."""

    eps: float
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: Float[Array, "... d"]) -> Float[Array, "... d"]:
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return w * y.astype(x.dtype)


def _dense(features: int, bias: bool, dtype: Any, name: str) -> nn.Dense:
    return nn.Dense(features, use_bias=bias, dtype=dtype, param_dtype=dtype, name=name,
                    kernel_init=nn.initializers.normal(0.02), precision=matmul_precision(dtype))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)); x + mlp(norm(x)). Params: wq/wk/wv/wo, w_gate/w_up/w_down (the MLP:
    `setup_mlp` / `mlp`, which Qwen3-MoE replaces)."""

    cfg: ModelConfig
    dtype: Any = jnp.float32

    def setup(self) -> None:
        c = self.cfg
        self.attn_norm = RMSNorm(c.rms_norm_eps, self.dtype)
        self.wq = _dense(c.q_dim, c.attention_bias, self.dtype, "wq")
        self.wk = _dense(c.kv_dim, c.attention_bias, self.dtype, "wk")
        self.wv = _dense(c.kv_dim, c.attention_bias, self.dtype, "wv")
        self.wo = _dense(c.hidden_size, False, self.dtype, "wo")
        self.mlp_norm = RMSNorm(c.rms_norm_eps, self.dtype)
        self.setup_mlp()
        self.setup_qk_norm()

    def setup_mlp(self) -> None:
        """The feed-forward block's weights: SwiGLU here; routed experts in Qwen3-MoE."""
        c = self.cfg
        self.w_gate = _dense(c.intermediate_size, False, self.dtype, "w_gate")
        self.w_up = _dense(c.intermediate_size, False, self.dtype, "w_up")
        self.w_down = _dense(c.hidden_size, False, self.dtype, "w_down")

    def mlp(self, h: Float[Array, "b t d"]) -> Float[Array, "b t d"]:
        return self.w_down(nn.silu(self.w_gate(h)) * self.w_up(h))

    def setup_qk_norm(self) -> None:
        """Hook for families that normalise q and k per head (Qwen3)."""

    def qk_norm(self, q: Array, k: Array) -> tuple[Array, Array]:
        return q, k

    def __call__(
        self,
        x: Float[Array, "b t d"],
        cos: Float[Array, "b t half"],
        sin: Float[Array, "b t half"],
        attend: AttendFn,
        state: Any,
    ) -> tuple[Float[Array, "b t d"], Any]:
        q, k, v = self.project_qkv(x, cos, sin)
        o, state = attend(q, k, v, state)
        return self.finish(x, o), state

    def project_qkv(
        self, x: Float[Array, "b t d"], cos: Float[Array, "b t half"], sin: Float[Array, "b t half"]
    ) -> tuple[Float[Array, "b t Hq hd"], Float[Array, "b t Hkv hd"], Float[Array, "b t Hkv hd"]]:
        """The layer up to attention: norm, q/k/v projections, (q/k norm), RoPE."""
        c = self.cfg
        b, t, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).reshape(b, t, c.num_heads, c.head_dim)
        k = self.wk(h).reshape(b, t, c.num_kv_heads, c.head_dim)
        v = self.wv(h).reshape(b, t, c.num_kv_heads, c.head_dim)
        q, k = self.qk_norm(q, k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, x: Float[Array, "b t d"], o: Float[Array, "b t Hq hd"]) -> Float[Array, "b t d"]:
        """The layer after attention: output projection + residual, then the MLP block + residual."""
        c = self.cfg
        b, t, _ = x.shape
        x = x + self.wo(o.reshape(b, t, c.q_dim).astype(x.dtype))
        return x + self.mlp(self.mlp_norm(x))


class Embedder(nn.Module):
    """Token embedding and (tied or untied) LM head."""

    cfg: ModelConfig
    dtype: Any = jnp.float32

    def setup(self) -> None:
        c = self.cfg
        self.embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=self.dtype, param_dtype=self.dtype,
                              embedding_init=nn.initializers.normal(0.02))
        self.final_norm = RMSNorm(c.rms_norm_eps, self.dtype)
        if not c.tie_word_embeddings:
            self.lm_head = _dense(c.vocab_size, False, self.dtype, "lm_head")

    def __call__(self, tokens: Int[Array, "..."]) -> Float[Array, "... d"]:
        # one token is looked up as two rows: for one row XLA's SPMD partitioner gathers a vocabulary-split table
        # whole (1 GB for Llama-3.1-8B on each device); for two or more it masks and all-reduces the rows
        flat = tokens.reshape(-1)
        ids = jnp.concatenate([flat, flat]) if flat.shape[0] == 1 else flat
        rows = jnp.take(self.embed.embedding.astype(self.dtype), ids, axis=0)
        return rows[: flat.shape[0]].reshape(*tokens.shape, -1)

    def logits(self, x: Float[Array, "... d"]) -> Float[Array, "... vocab"]:
        """float32 logits of the final-normed hidden states."""
        h = self.final_norm(x)
        if self.cfg.tie_word_embeddings:
            emb = self.embed.embedding.astype(h.dtype)
            return jnp.einsum("...d,vd->...v", h, emb, precision=matmul_precision(self.dtype)).astype(jnp.float32)
        return self.lm_head(h).astype(jnp.float32)
