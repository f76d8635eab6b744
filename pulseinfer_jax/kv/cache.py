"""Paged KV cache: layout, block allocator, per-request block tables.

Layout (one array for all layers):

    kv: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
             layer     block    K|V    token        head        feature

One block of one layer, `kv[l, b]`, is a single contiguous run of 2 * block_size * Hkv * head_dim
elements holding every KV head's K and V for `block_size` consecutive tokens of one request. That is
the unit that later moves between GPU and pinned host memory in one transfer (SoloHead recall);
`kv[l, b, :, :, h]` (two strided [block_size, head_dim] tiles) is the per-(block, head) unit of the
headwise baseline. Token-major inside a block makes a gathered run of blocks a plain
[tokens, Hkv * head_dim] matrix (no transpose before the attention matmuls) and lets prefill write a
chunk's [tokens, Hkv, head_dim] K/V without reordering.

Block 0 is the *null block*: never allocated, the target of padded writes (inactive batch rows,
the unused tail of a prefill chunk's table) and of padded block-table entries, which attention masks
by sequence length. Real data therefore never aliases garbage writes.

Token t of a request lives in block `table[t // block_size]`, slot `t % block_size`.

With `kv_dtype="float8_e4m3fn"` the cache holds bytes (uint8) and a block's K and V each have r = ceil(2 block_size /
head_dim) more rows, holding every (token, head)'s bfloat16 scale (kv/quant.py): `kv: [L, NB, 2, block_size + r, Hkv,
hd]`, one contiguous run per block as before (at block size 16, head_dim 64 or 128: 1 + 1 / 16 bytes per element).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pulseinfer_jax.kv.blocks import bucket
from pulseinfer_jax.kv.quant import block_rows, layer_block_bytes


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    num_layers: int
    num_blocks: int  # including the null block
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: jnp.dtype  # storage: the model's dtype, or uint8: float8 values and their scales (kv/quant.py)

    @property
    def rows(self) -> int:
        """Rows of a block's K (and V) in storage: block_size, plus float8's scale rows."""
        return block_rows(self.block_size, self.head_dim, self.dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_blocks, 2, self.rows, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers (K and V, every head, scales included)."""
        return self.num_layers * layer_block_bytes(self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def allocate(self, where: jax.Device | jax.sharding.Sharding | None = None) -> jax.Array:
        """Zero-filled cache array made on device `where` (or in sharding `where`: tensor parallelism splits it by
        KV head) and committed there, as the donating step functions' outputs are: an uncommitted first cache would
        give every step function one more compile (measured)."""
        if not isinstance(where, jax.sharding.Sharding):
            where = jax.sharding.SingleDeviceSharding(where or jax.devices()[0])
        return device_zeros_program(self.shape, self.dtype, where)()


def device_zeros_program(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding):
    """The jitted allocation of zeros in device memory, committed to `sharding`. The put inside gives the result's
    type that memory space (out_shardings alone leaves it typed by its default, and the first call of each program
    it meets would compile once more for it)."""
    return jax.jit(lambda: jax.device_put(jnp.zeros(shape, dtype), jax.memory.Space.Device), out_shardings=sharding)


TABLE_STEPS = 4  # block-table widths per doubling past 64 blocks


def bucket_blocks(n: int) -> int:
    """Padded width of a block table of n blocks: a power of two up to 64, then the next multiple of a quarter of
    the power of two at or below n (at most 25% padding; 4 widths, so 4 compiles, per doubling of the context).
    Power-of-two tables padded a 4,097-token context to 8,192: the jnp attention read, and the selection scored,
    twice what the sequence holds (ahead-of-time cost on an H200, bench/RESULTS.md)."""
    n = max(n, 1)
    if n <= 64:
        return bucket(n)
    step = (1 << (n.bit_length() - 1)) // TABLE_STEPS
    return -(-n // step) * step
