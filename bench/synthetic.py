"""Synthetic long contexts for throughput runs: a prompt's KV is filled with random values instead of prefilled.

Prefilling 128K-token prompts of an 8B model costs minutes of GPU time per request; decode cost does not depend on
the KV's values, so the throughput bench writes random N(0, 1) K and V straight into the request's prefill blocks
(every layer, one jitted call) and then takes the engine's normal path: a dense request decodes from them; an
offloaded one gets random KV layer by layer in its prefill units, each layer spilled to its host rows (metadata,
dense-layer packs, resident blocks) exactly as the layer-segmented prefill spills it. What synthetic KV does NOT
give is realistic selection: random keys make every block look alike, so which blocks a step selects (and so the
slot-cache hit rate) is arbitrary; results say "synthetic KV", and `bench/traces.py` replays a real model's
selections on top when asked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int

from pulseinfer_jax.engine.core import Engine
from pulseinfer_jax.kv.blocks import bucket
from pulseinfer_jax.request import Request


@functools.partial(jax.jit, donate_argnums=0)
def fill_random_kv(
    kv: Float[Array, "L NB 2 bs Hkv hd"],
    table: Int[Array, " n"],  # GPU blocks to fill (padding entries = 0, the null block)
    key: jax.Array,
) -> Float[Array, "L NB 2 bs Hkv hd"]:
    """Random N(0, 1) K/V into blocks `table` of every layer, one layer at a time (bounded temporaries)."""

    def body(layer, kv):
        vals = jax.random.normal(jax.random.fold_in(key, layer), (table.shape[0],) + kv.shape[2:], jnp.float32)
        return kv.at[layer, table].set(vals.astype(kv.dtype))

    return lax.fori_loop(0, kv.shape[0], body, kv)


@functools.partial(jax.jit, donate_argnums=0)
def fill_random_units(
    kv: Float[Array, "L NB 2 bs Hkv hd"],
    units: Int[Array, " n"],  # flat units (layer * NB + block) to fill (padding entries = 0, layer 0's null block)
    key: jax.Array,
) -> Float[Array, "L NB 2 bs Hkv hd"]:
    """Random N(0, 1) K/V into flat units `units` (one layer of an offloaded prompt, runner/offloaded_prefill.py)."""
    vals = jax.random.normal(key, (units.shape[0],) + kv.shape[2:], jnp.float32)
    return kv.at[units // kv.shape[1], units % kv.shape[1]].set(vals.astype(kv.dtype))


class SyntheticKVEngine(Engine):
    """An Engine whose prefill writes random KV for the whole prompt in one step (see the module docstring);
    the first generated token is token 0. Everything after prefill is the engine's own code."""

    def _prefill_compute(self, req: Request, blocks: list[int]) -> tuple[int, jax.Array]:
        table = np.zeros(bucket(len(blocks)), np.int32)
        table[: len(blocks)] = blocks
        self.kv = fill_random_kv(self.kv, jnp.asarray(table), jax.random.key(req.index))
        return len(req.prompt) - req.prefilled, jnp.zeros(self.model.cfg.vocab_size, jnp.float32)

    def _prefill_segments(self, req: Request) -> tuple[float, jax.Array]:
        job = self.prefiller.start(req.sparse, req.prompt, self.scheduler.placer.prefill_blocks(req))
        units = np.zeros(bucket(len(job.units)), np.int32)
        units[: len(job.units)] = job.units
        for layer in range(job.num_layers):
            key = jax.random.fold_in(jax.random.key(req.index), layer)
            self.kv = fill_random_units(self.kv, jnp.asarray(units), key)
            self.kv = self.sparse.spill_layer(self.kv, req.sparse, layer, job.units)
        self.sparse.prompt_indexed(req.sparse)
        req.prefilled = len(req.prompt)
        return float(len(req.prompt)), jnp.zeros(self.model.cfg.vocab_size, jnp.float32)
