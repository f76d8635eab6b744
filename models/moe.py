"""Mixture-of-experts feed-forward (Qwen3-MoE): a softmax router picks the top-k SwiGLU experts of each token.

One layer's weights (Hugging Face names: models/weights.py):
  router      [d, E]       router logits = x @ router
  gate_up     [d, E, 2f]   expert e's gate projection (columns :f) and up projection (columns f:)
  down        [E, f, d]
Laid out so that running every expert is two plain matmuls, [n, d] @ [d, E*2f] and [n, E*f] @ [E*f, d], with
no transposed copy of the weights.

Routing follows Hugging Face's Qwen3MoeTopKRouter: logits in the model dtype, softmax in float32, top-k (ties to
the lower expert id), optionally renormalised over the k picked, then cast to the model dtype.

Three ways to compute the same sum (`experts_ffn`; `MoEOptions` / `moe_strategy` choose per call from the static
token count n and the platform):
  - "dense": every expert runs on every token, the unpicked ones weighted zero. It reads each expert's weights
    once, which is what decode is bound by, but does E/k times the useful FLOPs (16x on Qwen3-30B-A3B).
  - "gather": the n * k picked experts' weights are gathered and applied token by token: only the picked experts
    are read, but each is copied once more.
  - "grouped": the n * k (token, pick) pairs are sorted by expert and each expert's run padded to whole tiles
    (`grouped_layout`); each tile is one [T, d] @ [d, 2f] and one [T, f] @ [f, d] matmul with its expert's weights
    read in place (pallas_kernels/grouped_matmul.py: the jnp tile loop, or the Pallas kernel for a GPU). It does
    the useful FLOPs plus at most one partial tile per picked expert, and reads each picked expert once per tile.
    T grows with the rows per expert (`grouped_tile_m`, 16..128).
Measured on CPU (`bench/moe_ffn.py`, one Qwen3-30B-A3B layer, bf16, bench/RESULTS.md): grouped is the fastest
at every token count from 1 to 4096, 7x gather at one token and 14x dense at 4,096, so "auto" is grouped on
CPU. On a GPU the jnp tile loop is one dependent step per tile (launch-bound at decode) and the Pallas kernel
has not run there yet, so "auto" keeps the measured-on-CPU dense / gather switch (gather while 4 * n * k < E:
gathering a picked expert cost ~5x reading it inside the dense product) until bench/moe_ffn.py has timed
"grouped-pallas" on a GPU (bench/gpu_sweep.sh). `jax.lax.ragged_dot` is not used: on CPU it took 12x dense's time
(n = 256), and XLA's default GPU lowering rewrites it into a zero-padded dense product (openxla/xla#40189,
#45998).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int
from pulseinfer_jax.pallas_kernels.common import next_pow2
from pulseinfer_jax.pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference

from pulseinfer_jax.parallel.kernels import tp_size
from pulseinfer_jax.parallel.layout import TP, split_spec

GROUPED_KERNELS = ("jnp", "pallas")
MOE_STRATEGIES = ("auto", "dense", "gather", "grouped")


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


def moe_strategy(num_tokens: int, top_k: int, num_experts: int, platform: str) -> str:
    """The measured choice (module docstring): "grouped" on CPU at every token count; on a GPU, until the
    grouped paths are timed there, "dense" once the tokens pick a quarter as many (token, expert) pairs as
    there are experts, else "gather"."""
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"platform={platform!r} must be 'cpu' or 'gpu'")
    if platform == "cpu":
        return "grouped"
    return "dense" if 4 * num_tokens * top_k >= num_experts else "gather"


@dataclasses.dataclass(frozen=True)
class MoEOptions:
    """How a model's MoE layers compute (static, hashable: part of the jitted model).

    strategy: "auto" (`moe_strategy` from the token count and `platform`), or one of "dense", "gather",
    "grouped" for every call. grouped_kernel: "jnp" (lax.map over tiles) or "pallas"
    (pallas_kernels.grouped_matmul, for a GPU). platform: the device platform "auto" decides for; None = JAX's
    default backend when traced (engines pass their device's platform)."""

    strategy: str = "auto"
    grouped_kernel: str = "jnp"
    platform: str | None = None

    def __post_init__(self) -> None:
        if self.strategy not in MOE_STRATEGIES:
            raise ValueError(f"MoE strategy={self.strategy!r}; use one of {', '.join(MOE_STRATEGIES)}")
        if self.grouped_kernel not in GROUPED_KERNELS:
            raise ValueError(f"grouped_kernel={self.grouped_kernel!r}; use one of {', '.join(GROUPED_KERNELS)}")

    def resolve(self, num_tokens: int, top_k: int, num_experts: int) -> str:
        if self.strategy != "auto":
            return self.strategy
        platform = self.platform or jax.default_backend()  # ("gpu" on any GPU: pulseinfer_jax.backends)
        return moe_strategy(num_tokens, top_k, num_experts, "gpu" if platform == "gpu" else "cpu")


def probe_grouped_kernel(device: jax.Device, dtype: Any) -> str | None:
    """Compile and run the grouped-GEMM Pallas kernel once on tiny shapes in `dtype`, both weight layouts, on
    `device`; None if fine, else the error text (engines fall back to the jnp tile loop on it)."""
    try:
        with jax.default_device(device):
            x = jnp.ones((32, 64), dtype)
            tiles = jnp.array([1, -1], jnp.int32)
            for axis, shape in ((0, (2, 64, 32)), (1, (64, 2, 32))):
                jax.block_until_ready(grouped_matmul(x, jnp.ones(shape, dtype), tiles, tile_m=16, expert_axis=axis))
    except Exception as e:  # noqa: BLE001 - any lowering / compile error
        return f"{type(e).__name__}: {str(e)[:300]}"
    return None


def grouped_tile_m(num_pairs: int, num_experts: int) -> int:
    """Rows per tile of the grouped strategy: the power of two nearest above the mean rows per expert,
    between 16 (the GPU kernel's smallest dot) and 128."""
    return min(128, max(16, next_pow2(-(-num_pairs // num_experts))))


def grouped_tiles(num_pairs: int, num_experts: int, tile_m: int) -> int:
    """The static tile count of `grouped_layout`: the pairs' whole tiles plus at most one partial tile per picked
    expert."""
    return -(-num_pairs // tile_m) + min(num_experts, num_pairs)


def grouped_layout(
    idx: Int[Array, "n k"], num_experts: int, tile_m: int
) -> tuple[Int[Array, " R"], Int[Array, " nk"], Int[Array, " tiles"]]:
    """The (token, pick) pairs sorted by expert, each expert's run padded to whole tiles of `tile_m` rows.

    Returns (pair_of_row [R]: flat pair index n*k + j held by each padded row, -1 for padding;
    row_of_pair [n*k]: the row each pair landed in; tile_group [tiles]: each tile's expert, -1 for the unused
    tiles at the end). R = tiles * tile_m with tiles = `grouped_tiles` = ceil(n*k / tile_m) + min(E, n*k): every
    picked expert adds at most one partial tile, so the static size always fits."""
    n, k = idx.shape
    pairs = n * k
    tiles = grouped_tiles(pairs, num_experts, tile_m)
    flat = idx.reshape(pairs).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)  # [nk] pairs by expert, ties in pair order
    counts = jnp.bincount(flat, length=num_experts)  # [E]
    padded = -(-counts // tile_m) * tile_m  # [E] rows of each expert's run
    padded_end = jnp.cumsum(padded)  # [E]
    sorted_e = flat[order]  # [nk]
    rank = jnp.arange(pairs, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[sorted_e]  # place in its run
    dest = (padded_end - padded)[sorted_e] + rank  # [nk] padded row of the i-th sorted pair
    pair_of_row = jnp.full((tiles * tile_m,), -1, jnp.int32).at[dest].set(order.astype(jnp.int32))
    row_of_pair = jnp.zeros((pairs,), jnp.int32).at[order].set(dest.astype(jnp.int32))
    start = jnp.arange(tiles, dtype=jnp.int32) * tile_m  # [tiles]
    group = jnp.searchsorted(padded_end, start, side="right").astype(jnp.int32)
    tile_group = jnp.where(start < padded_end[-1], group, -1)
    return pair_of_row, row_of_pair, tile_group


def experts_ffn(
    x: Float[Array, "n d"], idx: Int[Array, "n k"], weight: Float[Array, "n k"],
    gate_up: Float[Array, "d E 2f"], down: Float[Array, "E f d"], strategy: str | None = None,
    precision: jax.lax.Precision | None = None, grouped_kernel: str = "jnp",
) -> Float[Array, "n d"]:
    """sum_j weight[n, j] * down_e(silu(gate_e(x_n)) * up_e(x_n)) with e = idx[n, j] (see the module docstring).
    `grouped_kernel`: "jnp" (lax.map over tiles) or "pallas" (pallas_kernels.grouped_matmul) for "grouped"."""
    n, k = idx.shape
    num_experts, f = down.shape[0], down.shape[1]
    strategy = strategy or MoEOptions().resolve(n, k, num_experts)
    if strategy == "dense":
        h = jnp.einsum("nd,def->nef", x, gate_up, precision=precision)  # [n, E, 2f]
        act = nn.silu(h[..., :f]) * h[..., f:]  # [n, E, f]
        combine = jnp.sum(jax.nn.one_hot(idx, num_experts, dtype=x.dtype) * weight[..., None], axis=1)  # [n, E]
        return jnp.einsum("nef,efd->nd", act * combine[..., None], down, precision=precision)
    if strategy == "gather":
        h = jnp.einsum("nd,dnkf->nkf", x, jnp.take(gate_up, idx, axis=1), precision=precision)  # [n, k, 2f]
        act = nn.silu(h[..., :f]) * h[..., f:]  # [n, k, f]
        return jnp.einsum("nkf,nkfd->nd", act * weight[..., None], down[idx], precision=precision)
    if strategy == "grouped":
        if grouped_kernel not in GROUPED_KERNELS:
            raise ValueError(f"grouped_kernel={grouped_kernel!r}; use one of {', '.join(GROUPED_KERNELS)}")
        tile_m = grouped_tile_m(n * k, num_experts)
        pair_of_row, row_of_pair, tile_group = grouped_layout(idx, num_experts, tile_m)
        valid = pair_of_row >= 0  # [R]
        safe = jnp.maximum(pair_of_row, 0)
        rows = jnp.where(valid[:, None], x[safe // k], 0).astype(x.dtype)  # [R, d] each pair's token
        row_w = jnp.where(valid, weight.reshape(n * k)[safe], 0).astype(x.dtype)  # [R]
        if grouped_kernel == "pallas":
            mm = functools.partial(grouped_matmul, tile_m=tile_m)
        else:
            mm = functools.partial(grouped_matmul_reference, tile_m=tile_m)
        h = mm(rows, gate_up, tile_group, expert_axis=1)  # [R, 2f]
        act = (nn.silu(h[:, :f]) * h[:, f:] * row_w[:, None]).astype(x.dtype)  # [R, f]
        y = mm(act, down, tile_group, expert_axis=0)  # [R, d]
        return jnp.sum(y[row_of_pair].reshape(n, k, -1).astype(jnp.float32), axis=1).astype(x.dtype)
    raise ValueError(f"strategy={strategy!r} must be 'dense', 'gather', 'grouped' or None (chosen from the "
                     "token count)")


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
    options: MoEOptions = MoEOptions()

    @nn.compact
    def __call__(self, h: Float[Array, "b t d"]) -> Float[Array, "b t d"]:
        b, t, d = h.shape
        init = nn.initializers.normal(0.02)
        router = self.param("router", init, (d, self.num_experts), self.dtype)
        gate_up = self.param("gate_up", init, (d, self.num_experts, 2 * self.width), self.dtype)
        down = self.param("down", init, (self.num_experts, self.width, d), self.dtype)
        x = h.reshape(b * t, d)
        idx, weight = route(x, router, self.top_k, self.normalize, self.precision)
        strategy = self.options.resolve(b * t, self.top_k, self.num_experts)
        ffn = functools.partial(experts_ffn, strategy=strategy, precision=self.precision,
                                grouped_kernel=self.options.grouped_kernel)
        if tp_size() > 1:
            return expert_parallel(ffn, x, idx, weight, gate_up, down).reshape(b, t, d)
        return ffn(x, idx, weight, gate_up, down).reshape(b, t, d)


def expert_parallel(ffn, x: Float[Array, "n d"], idx: Int[Array, "n k"], weight: Float[Array, "n k"],
                    gate_up: Float[Array, "d E 2f"], down: Float[Array, "E f d"]) -> Float[Array, "n d"]:
    """`ffn(x, idx, weight, gate_up, down)` with the experts split over the `tp` mesh axis (expert parallel): each
    device runs its own experts on the (replicated) tokens, the picks of other devices' experts weighted zero, and
    one all-reduce sums the devices' parts."""
    def local(x, idx, weight, gate_up, down):
        e_local = down.shape[0]
        first = jax.lax.axis_index(TP) * e_local
        mine = (idx >= first) & (idx < first + e_local)
        y = ffn(x, jnp.where(mine, idx - first, 0), jnp.where(mine, weight, jnp.zeros((), weight.dtype)), gate_up,
                down)
        return jax.lax.psum(y, TP)

    return jax.shard_map(local, in_specs=(P(), P(), P(), split_spec(3, 1), split_spec(3, 0)), out_specs=P(),
                         check_vma=False)(x, idx, weight, gate_up, down)
