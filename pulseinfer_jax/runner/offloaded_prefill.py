"""Layer-segmented prefill of an offloaded prompt: its KV streams to the host pool as it is computed.

Dense prefill runs chunk by chunk, every layer of a chunk before the next one, so the whole prompt's KV of every
layer ends up on the GPU. An offloaded prompt runs layer by layer instead: layer l runs over every chunk of the
prompt (each chunk attends over layer l's KV of the chunks before it and of itself), writing its K/V into the
request's *prefill units* (`SparseKV.prefill_units`: flat units of its own slot blocks, empty until decoding
starts, and of a few extra blocks when those are too few); then layer l is spilled (`SparseDecoder.spill_layer`):

  - a sparse layer: its blocks are written to their host rows (one asynchronous device-to-host copy), their key
    bounds computed, the sinks' and recent window's KV copied into the request's resident blocks;
  - a dense layer (l < dense_layers): every block copied into the request's dense-layer packs;

and layer l + 1 reuses the same units. Between layers the prompt's hidden states stay on the device, one
[1, C, D] array per chunk.

**GPU memory bound.** Beyond the request's steady footprint (resident blocks, slot cache, dense-layer packs: what
admission reserves for decoding anyway), an offloaded prefill holds one layer of the prompt's KV, ceil(n / L) GPU
blocks for an n-block prompt of an L-layer model (the blocks of the shared pool hold every layer's slice), taken
from the request's own slot blocks and, past what their L slices hold, `SparsePlan.scratch_blocks` more, returned
when the prefill ends; plus activations outside the KV pool: the prompt's hidden states (prompt tokens x hidden size
in the model dtype) and one chunk's working set. Dense prefill of the same prompt holds n blocks.

**Arithmetic.** Each (layer, chunk) piece runs `dense.prefill_layer_units`, the layer-wise dense prefill's layer
(`dense.prefill_step_layerwise`) with unit addresses, over the chunks the dense prefill cuts (`chunk_plan`): the
KV written to the host is bit-identical to what the layer-wise dense prefill writes (tests/test_offloaded_prefill.py).
A scan engine's dense prefill compiles all layers into one program, whose f32 rounding may differ in the last bits.

**Work per engine step.** `SegmentedPrefiller.advance` runs at most `num_layers` pieces per call, the work of one
dense prefill chunk, so the running requests keep decoding at their pace while a long prompt prefills.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from pulseinfer_jax.host_offload.placement import SparseKV, SparsePlan
from pulseinfer_jax.kv.blocks import blocks_for, bucket
from pulseinfer_jax.kv.cache import bucket_blocks
from pulseinfer_jax.models.transformer import Transformer
from pulseinfer_jax.runner import dense


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One prefill chunk: `size` tokens (padded, a multiple of the block size) from `start`, `valid` of them real."""

    start: int
    size: int
    valid: int


def chunk_size(remaining: int, prefill_chunk: int, block_size: int) -> int:
    """Padded size of the next prefill chunk when `remaining` prompt tokens are left: whole blocks, bucketed to a
    power of two of blocks (few compiled shapes), at most `prefill_chunk`."""
    return min(prefill_chunk, block_size * bucket(blocks_for(remaining, block_size)))


def chunk_plan(prompt_tokens: int, prefill_chunk: int, block_size: int) -> list[Chunk]:
    """The chunks a prompt is prefilled in (dense prefill cuts the same ones, one per engine step)."""
    out, start = [], 0
    while start < prompt_tokens:
        size = chunk_size(prompt_tokens - start, prefill_chunk, block_size)
        valid = min(size, prompt_tokens - start)
        out.append(Chunk(start, size, valid))
        start += valid
    return out


class SegmentedPrefill:
    """One offloaded prompt's prefill in progress (see the module docstring): the next (layer, chunk) piece to run,
    the prompt's hidden states after the layers done so far, and where its KV goes."""

    def __init__(self, sparse: SparseKV, prompt: list[int], units: np.ndarray, chunks: list[Chunk], num_layers: int):
        self.sparse = sparse
        self.prompt = prompt
        self.units = units  # [n] flat unit of logical block j of the layer being prefilled
        width = bucket_blocks(len(units))
        table = np.zeros(width, np.int32)  # padded with unit 0 (layer 0's null block): never attended
        table[: len(units)] = units
        self.table = jnp.asarray(table)
        self.chunks = chunks
        self.num_layers = num_layers
        self.hidden: list[jax.Array | None] = [None] * len(chunks)  # per chunk [1, C, D], after `layer` layers
        self.layer = 0  # the layer being computed
        self.chunk = 0  # its next chunk

    @property
    def pieces_left(self) -> int:
        return (self.num_layers - self.layer) * len(self.chunks) - self.chunk

    @property
    def done(self) -> bool:
        return self.layer == self.num_layers


class LayerSink(Protocol):
    """Where each completed layer of an offloaded prompt goes (`sparse_decoder.SparseDecoder` is one): the GPU cache's
    block count, the sparse plan, the device, the spill of a layer and the end of the prompt."""

    nb: int
    plan: SparsePlan
    device: jax.Device

    def spill_layer(self, kv: jax.Array, s: SparseKV, layer: int, units: np.ndarray) -> jax.Array: ...

    def prompt_indexed(self, s: SparseKV) -> None: ...


class SegmentedPrefiller:
    """Runs `SegmentedPrefill`s over the engine's cache: the model's layers and the sparse decoder's spills."""

    def __init__(self, model: Transformer, params: dict, layer_params: Callable[[], list[dict]], decoder: LayerSink,
                 *, key_chunk: int, prefill_chunk: int):
        self.model, self.params = model, params
        self._layer_params = layer_params  # asked for on first use (the engine's per-layer weights)
        self.decoder = decoder  # where completed layers go (the sparse decoder)
        self.key_chunk, self.prefill_chunk = key_chunk, prefill_chunk

    def start(self, sparse: SparseKV, prompt: list[int], prefill_blocks: list[int]) -> SegmentedPrefill:
        """The prefill of `prompt` for offloaded request `sparse`, whose prefill units are its slot blocks and
        `prefill_blocks`. Fixes the prompt's block roles (`SparseKV.prefill_done`: nothing is read yet)."""
        d = self.decoder
        units = sparse.prefill_units(prefill_blocks, d.nb, len(prompt))
        sparse.prefill_done(len(prompt))
        chunks = chunk_plan(len(prompt), self.prefill_chunk, d.plan.block_size)
        return SegmentedPrefill(sparse, prompt, units, chunks, d.plan.num_layers)

    def advance(self, kv: jax.Array, job: SegmentedPrefill, max_pieces: int) -> tuple[jax.Array, jax.Array | None]:
        """Run up to `max_pieces` (layer, chunk) pieces of `job`, spilling each layer it completes. Returns (kv, the
        logits [V] of the prompt's last token once the last layer is done, else None)."""
        model, d = self.model, self.decoder
        lps = self._layer_params()
        for _ in range(max_pieces):
            if job.done:
                break
            ch = job.chunks[job.chunk]
            x = job.hidden[job.chunk]
            if x is None:  # layer 0: the chunk's embeddings
                tokens = np.zeros(ch.size, np.int32)
                tokens[: ch.valid] = job.prompt[ch.start: ch.start + ch.valid]
                x = dense.prefill_embed(model, self.params, jnp.asarray(tokens), d.device.platform)
            key_chunk = min(self.key_chunk, ch.size)
            kv, job.hidden[job.chunk] = dense.prefill_layer_units(model, lps[job.layer], kv, x, jnp.int32(ch.start),
                                                                   job.table, key_chunk=key_chunk)
            job.chunk += 1
            if job.chunk == len(job.chunks):  # layer complete: it leaves the GPU before the next one overwrites it
                kv = d.spill_layer(kv, job.sparse, job.layer, job.units)
                job.layer, job.chunk = job.layer + 1, 0
        if not job.done:
            return kv, None
        d.prompt_indexed(job.sparse)
        last = job.chunks[-1]
        logits = dense.prefill_logits(model, self.params, job.hidden[-1], jnp.int32(last.valid))
        job.hidden = []
        return kv, logits
