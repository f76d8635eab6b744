"""How a model's weights split over the `tp` mesh axis, and KV heads replicated where devices outnumber them.

`WeightPlacement.put(path, array)` is what the loaders call for every weight (models/weights.py, models/loading.py):
it puts a host array straight into its shards (each device receives only its slice; a checkpoint never exists whole
on a device), after replicating the KV heads when `tensor_parallel` exceeds them. Megatron's split, by the leaf's
name (`partition_spec`):
    wq / wk / wv kernel [.., D, heads * hd] and bias: by column (heads)    wo kernel [.., Hq * hd, D]: by row
    w_gate / w_up kernel [.., D, F]: by column                              w_down kernel [.., F, D]: by row
    moe gate_up [.., D, E, 2f] and down [.., E, f, D]: by expert (expert parallel)
    embed.embedding [V, D] and lm_head.kernel [D, V]: by vocabulary if tensor_parallel divides V, else replicated
    norms, q/k norms, the router: replicated
Models with fewer KV heads than devices get each KV head repeated `kv_repeat` times (as vLLM does): the engine's
config has `tensor_parallel` KV heads, every device one, the arithmetic unchanged (each query head still reads its own
KV head's K and V); the KV cache grows by `kv_repeat`, which `describe` reports.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from pulseinfer_jax.models.config import ModelConfig

from pulseinfer_jax.parallel.layout import TP, DeviceLayout

COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")  # split on their output features (last axis)
ROW = ("wo", "w_down")  # split on their input features (axis -2)
KV = ("wk", "wv")


def kv_repeat(cfg: ModelConfig, tp: int) -> int:
    """How many times each KV head is repeated so that `tp` devices split them evenly (1: none); a clear error when
    the model cannot be split over `tp` devices."""
    if tp == 1:
        return 1
    problems = []
    if cfg.num_heads % tp:
        problems.append(f"its {cfg.num_heads} attention heads")
    if cfg.is_moe and cfg.num_experts % tp:
        problems.append(f"its {cfg.num_experts} experts")
    if not cfg.is_moe and cfg.intermediate_size % tp:
        problems.append(f"its MLP width {cfg.intermediate_size}")
    hkv = cfg.num_kv_heads
    if hkv % tp and tp % hkv:
        problems.append(f"its {hkv} KV heads (neither divisible by {tp} nor dividing it)")
    if problems:
        raise ValueError(f"tensor_parallel={tp} cannot split {cfg.name or cfg.model_type}: {tp} does not divide "
                         f"{', '.join(problems)}; choose a tensor_parallel that divides them")
    return 1 if hkv % tp == 0 else tp // hkv


def partition_spec(path: tuple[str, ...], ndim: int, tp: int, vocab: int) -> PartitionSpec:
    """The split of the weight at `path` (its names in the params pytree) of `ndim` axes (see the module docstring)."""
    spec: list[str | None] = [None] * ndim
    names = set(path)
    if names & set(COLUMN):
        spec[-1] = TP
    elif names & set(ROW):
        spec[-2] = TP
    elif "gate_up" in names:
        spec[-2] = TP
    elif "down" in names:
        spec[-3] = TP
    elif "embedding" in names and vocab % tp == 0:
        spec[0] = TP
    elif "lm_head" in names and vocab % tp == 0:
        spec[-1] = TP
    return PartitionSpec(*spec)


def repeat_kv_heads(arr: Any, repeat: int, head_dim: int) -> Any:
    """A k / v projection's kernel or bias ([.., Hkv * hd]) with each head's columns repeated `repeat` times,
    consecutively (head h becomes heads h * repeat .. h * repeat + repeat - 1): numpy in, numpy out; jax in, jax out."""
    xp = np if isinstance(arr, np.ndarray) else jnp
    *lead, cols = arr.shape
    heads = cols // head_dim
    out = xp.repeat(arr.reshape(*lead, heads, head_dim), repeat, axis=-2)
    return out.reshape(*lead, heads * repeat * head_dim)


def path_names(path) -> tuple[str, ...]:
    """A pytree path (dict keys, list indices, dataclass fields) as the names `partition_spec` reads."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


@dataclasses.dataclass(frozen=True)
class WeightPlacement:
    """Where each weight of a model goes (`put`), for a checkpoint whose config is `source_cfg`."""

    devices: DeviceLayout
    source_cfg: ModelConfig

    @property
    def tp(self) -> int:
        return self.devices.tp

    @property
    def kv_repeat(self) -> int:
        return kv_repeat(self.source_cfg, self.tp)

    @property
    def cfg(self) -> ModelConfig:
        """The config the engine runs: the checkpoint's, with `tensor_parallel` KV heads when they were repeated."""
        r = self.kv_repeat
        c = self.source_cfg
        return c if r == 1 else dataclasses.replace(c, num_kv_heads=c.num_kv_heads * r)

    def sharding(self, path: tuple[str, ...], ndim: int) -> jax.sharding.Sharding:
        return self.devices.spec(partition_spec(path, ndim, self.tp, self.source_cfg.vocab_size))

    def prepare(self, path: tuple[str, ...], arr: Any) -> Any:
        """The array as the engine's config lays it out (KV heads repeated where they are)."""
        if self.kv_repeat > 1 and set(path) & set(KV):
            return repeat_kv_heads(arr, self.kv_repeat, self.source_cfg.head_dim)
        return arr

    def put(self, path: tuple[str, ...], arr: Any) -> jax.Array:
        """Host (or device) array -> its shards on the devices."""
        arr = self.prepare(path, arr)
        return jax.device_put(arr, self.sharding(path, arr.ndim))

    def shardings(self, params: Any) -> Any:
        """The sharding of every leaf of a params pytree laid out for the engine's config."""
        return jax.tree_util.tree_map_with_path(lambda p, a: self.sharding(path_names(p), a.ndim), params)

    def source_shardings(self, params: Any) -> Any:
        """`shardings` for a params pytree of the checkpoint's config (before `place_tree`): the k / v projections
        replicated when their heads are to be repeated (fewer heads than devices)."""
        def one(p, a):
            names = path_names(p)
            if self.kv_repeat > 1 and set(names) & set(KV):
                return self.devices.replicated()
            return self.sharding(names, a.ndim)

        return jax.tree_util.tree_map_with_path(one, params)

    def place_tree(self, params: Any) -> Any:
        """A params pytree of the checkpoint's config (e.g. random weights) laid out for the engine: KV heads
        repeated, every leaf in its shards (one jitted program: nothing gathered on one device)."""
        def prepare(p):
            return jax.tree_util.tree_map_with_path(lambda q, a: self.prepare(path_names(q), a), p)

        return jax.jit(prepare, out_shardings=self.shardings(jax.eval_shape(prepare, params)))(params)

    def describe(self) -> str:
        c = self.source_cfg
        rep = (f"; each of the {c.num_kv_heads} KV heads repeated {self.kv_repeat}x (KV cache {self.kv_repeat}x "
               "larger)" if self.kv_repeat > 1 else "")
        return f"{self.devices.describe()}: {c.num_heads // self.tp} attention heads per device{rep}"


def check_sharded(params: Any, placement: WeightPlacement) -> list[str]:
    """The leaves whose sharding is not what `placement` says (tests: nothing that should be split is replicated)."""
    bad = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        want = placement.sharding(path_names(path), leaf.ndim)
        if not leaf.sharding.is_equivalent_to(want, leaf.ndim):
            bad.append(f"{'/'.join(path_names(path))}: {leaf.sharding} (want {want})")
    return bad
