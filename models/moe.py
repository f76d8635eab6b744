"""Mixture-of-experts feed-forward (Qwen3-MoE): a softmax router picks the top-k SwiGLU experts of each token.

One layer's weights (Hugging Face names: models/weights.py):
  router      [d, E]       router logits = x @ router
  gate_up     [d, E, 2f]   expert e's gate projection (columns :f) and up projection (columns f:)
  down        [E, f, d]
Laid out so that running every expert is two plain matmuls, [n, d] @ [d, E*2f] and [n, E*f] @ [E*f, d], with
no transposed copy of the weights.

Routing follows Hugging Face's Qwen3MoeTopKRouter: logits in the model dtype, softmax in float32, top-k (ties to
the lower expert id), optionally renormalised over the k picked, then cast to the model dtype.

Two ways to compute the same sum, chosen from the static token count n (`moe_strategy`):
  - "dense" (4 * n * k >= E: a decode batch of E/(4k) or more tokens, every prefill chunk): every expert runs on
    every token, the unpicked ones weighted zero. It reads each expert's weights once, which is what decode is
    bound by; it does E/k times the useful FLOPs, which a prefill chunk pays (a grouped-GEMM kernel would not.
    `jax.lax.ragged_dot` is not used: XLA's default GPU lowering rewrites it into a zero-padded dense product,
    the same FLOPs plus a padded copy of the tokens per expert, per the descriptions of openxla/xla#40189 and
    #45998 (cuDNN / Triton grouped-GEMM paths behind flags); unmeasured here).
  - "gather" (fewer tokens, e.g. decode at batch 1-3 on Qwen3-30B-A3B): the n * k picked experts' weights are
    gathered and applied token by token: only the picked experts are read, but each is copied once more.
The switch point is measured, not n * k = E: gathering a picked expert cost about 5x what reading it inside the
dense product did, so dense wins from n * k ~ E/4 on (`bench/moe_ffn.py`, CPU, Qwen3-30B-A3B layer, bf16: at
n = 2 gather 165 vs dense 259 ms, at n = 4 dense 252 vs gather 330 ms; bench/RESULTS.md). A GPU pays the same
extra copy (write + read of each gathered slice), so the same order of switch point is expected; unmeasured.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def route(
    x: Float[Array, "n d"], router: Float[Array, "d E"], top_k: int, normalize: bool,
    precision: jax.lax.Precision | None = None,
) -> tuple[Int[Array, "n k"], Float[Array, "n k"]]:
    """The picked experts of each token (descending router probability) and their weights (model dtype)."""
    logits = jnp.einsum("nd,de->ne", x, router.astype(x.dtype), precision=precision)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weight, idx = jax.lax.top_k(probs, top_k)
    if normalize:
        weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
    return idx, weight.astype(x.dtype)


def moe_strategy(num_tokens: int, top_k: int, num_experts: int) -> str:
    """"dense" once the tokens pick a quarter as many (token, expert) pairs as there are experts, else "gather"
    (the measured switch point: module docstring)."""
    return "dense" if 4 * num_tokens * top_k >= num_experts else "gather"


def experts_ffn(
    x: Float[Array, "n d"], idx: Int[Array, "n k"], weight: Float[Array, "n k"],
    gate_up: Float[Array, "d E 2f"], down: Float[Array, "E f d"], strategy: str | None = None,
    precision: jax.lax.Precision | None = None,
) -> Float[Array, "n d"]:
    """sum_j weight[n, j] * down_e(silu(gate_e(x_n)) * up_e(x_n)) with e = idx[n, j] (see the module docstring)."""
    n, k = idx.shape
    num_experts, f = down.shape[0], down.shape[1]
    strategy = strategy or moe_strategy(n, k, num_experts)
    if strategy == "dense":
        h = jnp.einsum("nd,def->nef", x, gate_up, precision=precision)  # [n, E, 2f]
        act = nn.silu(h[..., :f]) * h[..., f:]  # [n, E, f]
        combine = jnp.sum(jax.nn.one_hot(idx, num_experts, dtype=x.dtype) * weight[..., None], axis=1)  # [n, E]
        return jnp.einsum("nef,efd->nd", act * combine[..., None], down, precision=precision)
    if strategy == "gather":
        h = jnp.einsum("nd,dnkf->nkf", x, jnp.take(gate_up, idx, axis=1), precision=precision)  # [n, k, 2f]
        act = nn.silu(h[..., :f]) * h[..., f:]  # [n, k, f]
        return jnp.einsum("nkf,nkfd->nd", act * weight[..., None], down[idx], precision=precision)
    raise ValueError(f"strategy={strategy!r} must be 'dense', 'gather' or None (chosen from the token count)")


def moe_ffn_reference(
    x: Float[Array, "n d"], router: Float[Array, "d E"], gate_up: Float[Array, "d E 2f"],
    down: Float[Array, "E f d"], top_k: int, normalize: bool,
) -> Float[Array, "n d"]:
    """Plain loop over experts and tokens' picks as Hugging Face writes it (float32, HIGHEST): the oracle."""
    hi = jax.lax.Precision.HIGHEST
    x32 = x.astype(jnp.float32)
    idx, weight = route(x32, router.astype(jnp.float32), top_k, normalize, hi)
    f = down.shape[1]
    out = jnp.zeros_like(x32)
    for e in range(down.shape[0]):
        h = jnp.dot(x32, gate_up[:, e].astype(jnp.float32), precision=hi)
        y = jnp.dot(nn.silu(h[:, :f]) * h[:, f:], down[e].astype(jnp.float32), precision=hi)  # [n, d]
        w_e = jnp.sum(jnp.where(idx == e, weight, 0.0), axis=1)  # [n]: the token's weight of e (0: not picked)
        out = out + y * w_e[:, None]
    return out


class MoEFeedForward(nn.Module):
    """Router + experts of one layer. Params: router [d, E], gate_up [d, E, 2f], down [E, f, d]."""

    num_experts: int
    top_k: int
    width: int  # f: each expert's intermediate size
    normalize: bool
    dtype: Any = jnp.float32
    precision: jax.lax.Precision | None = None

    @nn.compact
    def __call__(self, h: Float[Array, "b t d"]) -> Float[Array, "b t d"]:
        b, t, d = h.shape
        init = nn.initializers.normal(0.02)
        router = self.param("router", init, (d, self.num_experts), self.dtype)
        gate_up = self.param("gate_up", init, (d, self.num_experts, 2 * self.width), self.dtype)
        down = self.param("down", init, (self.num_experts, self.width, d), self.dtype)
        x = h.reshape(b * t, d)
        idx, weight = route(x, router, self.top_k, self.normalize, self.precision)
        return experts_ffn(x, idx, weight, gate_up, down, precision=self.precision).reshape(b, t, d)
