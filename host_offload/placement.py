"""Where each KV block of a sparse request lives, and what the GPU keeps for it (bookkeeping, no device code).

A *sparse* request decodes with block selection. Its placement is either
  - "host" (offloaded, PulseInfer's mode): every logical block has a row in the pinned host pool holding its
    sparse layers; the GPU keeps only
      * resident blocks: the sink block(s) and the recent window (the last `window` logical blocks, the partial
        one included) plus one spare for the block that starts next; new tokens are written here;
      * the slot cache: `slot_blocks` GPU blocks whose layer-l slices hold the blocks layer l recalled
        (SoloHead: slot i = a whole block; headwise: column h of slot i = head h of a block, one LRU lane
        per head); the slot caches on the device say which (pulseinfer_jax/selection/slot_plan.py);
      * dense-layer packs: the first `dense_layers` layers attend densely, so every logical block's KV of those
        layers stays on the GPU, packed `L // dense_layers` blocks to one GPU block: logical block j, dense
        layer d -> z = j * dense_layers + d -> GPU block packs[z // L], layer slice z % L (flat unit
        (z % L) * NB + packs[z // L]). That costs dense_layers / L of a dense request's KV and no PCIe;
      * the key metadata (min/max per block, head, feature) of every sparse layer, in rows indexed by the
        block's host row (kept by the engine, not here).
    When a block leaves the window it is written back to its host row (asynchronously) and its GPU block becomes
    the spare; its metadata is complete already (each key joined it as it was written, in the scoring kernel).
    The prompt is prefilled layer by layer (pulseinfer_jax/runner/offloaded_prefill.py): all chunks of layer l write
    their K/V into *prefill units* (flat units of the request's own slot blocks, every layer slice of them, empty
    until decoding starts, plus `scratch_blocks` more GPU blocks when the slots hold fewer than one layer of the
    prompt), then layer l is spilled: sparse layers to the host rows (with their key metadata), dense layers into
    the packs, the resident blocks copied into the request's own blocks; layer l + 1 reuses the same units. So the
    GPU never holds more than one layer of the prompt beyond the steady footprint, and admission reserves only the
    steady footprint (resident + slots + packs) plus those few scratch blocks, returned when the prefill ends: this
    is what lets IOAA offload a request whose dense KV does not fit, and a prompt be longer than the GPU holds.
  - "device" (sparse attention without offloading; an ablation and the test oracle for the I/O path): every
    block stays on the GPU like a dense request, selection and attention are the same, nothing is recalled.
    Host rows are still allocated: they index the metadata rows.

Dense requests (no selection) do not use this module.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jaxtyping import Int

from pulseinfer_jax.kv.blocks import blocks_for


@dataclasses.dataclass(frozen=True)
class SparsePlan:
    """Static shape of sparse requests in one engine."""

    num_layers: int
    dense_layers: int
    block_size: int
    num_kv_heads: int
    sink_blocks: int
    window_blocks: int
    budget_blocks: int
    slot_blocks: int  # slot cache capacity per (sparse layer, lane), in blocks
    selection: str  # "solohead" | "headwise"
    placement: str  # "host" | "device"

    def __post_init__(self) -> None:
        if self.placement not in ("host", "device"):
            raise ValueError(f"placement={self.placement!r} must be 'host' or 'device'")
        if self.selection not in ("solohead", "headwise"):
            raise ValueError(f"selection={self.selection!r} must be 'solohead' or 'headwise'")
        if not 0 <= self.dense_layers < self.num_layers:
            raise ValueError(f"dense_layers={self.dense_layers} must be in [0, num_layers={self.num_layers}): at "
                             "least one layer must be sparse")
        if self.window_blocks < 1:
            raise ValueError("the recent window must hold at least the block being written (window >= block_size)")
        if self.middle_blocks < 1:
            raise ValueError(f"budget of {self.budget_blocks} blocks leaves nothing to select after "
                             f"{self.sink_blocks} sink + {self.window_blocks} window blocks; raise budget_tokens "
                             "or shrink sink_blocks/window_tokens")
        if self.slot_blocks < self.middle_blocks:
            raise ValueError(f"slot_cache_blocks={self.slot_blocks} is below the {self.middle_blocks} middle blocks a "
                             "step may select; raise it (or leave it unset)")

    @property
    def lanes(self) -> int:
        return 1 if self.selection == "solohead" else self.num_kv_heads

    @property
    def middle_blocks(self) -> int:
        return self.budget_blocks - self.sink_blocks - self.window_blocks

    @property
    def sparse_layers(self) -> int:
        return self.num_layers - self.dense_layers

    @property
    def resident_blocks(self) -> int:
        return self.sink_blocks + self.window_blocks + 1

    def slots_for(self, n_blocks: int) -> int:
        """Slot cache size of a request of `n_blocks` blocks: it never selects more middle blocks than it has."""
        return max(1, min(self.slot_blocks, n_blocks - self.sink_blocks - self.window_blocks))

    def pack_blocks(self, n_blocks: int) -> int:
        return -(-n_blocks * self.dense_layers // self.num_layers)

    def scratch_blocks(self, prompt_tokens: int, total_tokens: int) -> int:
        """GPU blocks a host-placed request holds beyond `gpu_blocks` while its prompt prefills: the prefill units
        (one layer of the prompt, a unit per logical block) that its own slot blocks' L layer slices cannot hold."""
        if self.placement == "device":
            return 0
        units = blocks_for(prompt_tokens, self.block_size)
        have = self.slots_for(blocks_for(total_tokens, self.block_size)) * self.num_layers
        return -(-max(0, units - have) // self.num_layers)

    def gpu_blocks(self, total_tokens: int) -> int:
        """GPU blocks a request of prompt + max new tokens = `total_tokens` owns after its prefill (while it
        prefills, `scratch_blocks` more)."""
        n = blocks_for(total_tokens, self.block_size)
        if self.placement == "device":
            return n
        return self.resident_blocks + self.slots_for(n) + self.pack_blocks(n)


@dataclasses.dataclass
class SparseCounters:
    """I/O of one request, summed over its decode steps (all sparse layers)."""

    recall_bytes: int = 0
    recall_transfers: int = 0  # host-to-device copies that carried some of this request's blocks
    recalled_blocks: int = 0  # selection entries recalled (SoloHead: layer-blocks; headwise: (layer-block, head))
    reused_blocks: int = 0  # selected middle entries found in the slot cache
    recall_wait_s: float = 0.0
    written_back_blocks: int = 0
    last_step_recall_bytes: int = 0  # the latest decode step's recall (IOAA's observation)


class SparseKV:
    """Block roles of one sparse request; see the module docstring. Owns no memory: the engine allocates the
    GPU blocks and host rows and hands them in; `free_after_prefill` says which GPU blocks to give back."""

    def __init__(self, plan: SparsePlan, owner: int, total_tokens: int, gpu_blocks: list[int], host_rows: list[int],
                 slot_row: int = 0):
        n_max = blocks_for(total_tokens, plan.block_size)
        if len(gpu_blocks) != plan.gpu_blocks(total_tokens) or len(host_rows) != n_max:
            raise ValueError(f"request {owner}: got {len(gpu_blocks)} GPU blocks / {len(host_rows)} host rows, "
                             f"needs {plan.gpu_blocks(total_tokens)} / {n_max}")
        self.plan = plan
        self.owner = owner
        self.host_rows = list(host_rows)  # logical block -> host row (and metadata row)
        self.host_row_arr = np.asarray(host_rows, np.int32)  # the same as an array (the decode step's lookups)
        self.counters = SparseCounters()
        self.num_blocks = 0  # logical blocks holding tokens (set by prefill_done / advance)
        self.tokens = 0  # tokens written or being written (the prompt's, then each decode step's length)
        self.gpu_of: dict[int, int] = {}  # resident logical block -> GPU block
        self.gpu_arr = np.full(n_max, -1, np.int32)  # the same as an array: GPU block of logical j, -1 = not resident
        self.spare: list[int] = []
        # (logical block, GPU block) of the block that last left the window: its GPU block is the spare, intact until
        # the next block starts (a step-ahead recall fills a miss on it from there)
        self.leaving: tuple[int, int] | None = None
        self.table: list[int] = []  # device placement: the request's GPU blocks (logical block j in table[j])
        slots = plan.slots_for(n_max)
        # the slot caches of every sparse layer and lane live on the device, one table row per request
        # (selection/slot_plan.py; the engine hands out the rows). Device placement keeps them as bookkeeping
        # only (no slot blocks, nothing recalled), so that it selects exactly what host placement does (the
        # resident-block bonus reads them)
        self.slot_capacity = slots
        self.slot_row = slot_row
        self.slot_fresh = True  # the decoder frees the row's slots before the first step
        if plan.placement == "device":
            self.table = list(gpu_blocks)
            self.slot_blocks: list[int] = []
            self.packs: list[int] = []
        else:
            r = plan.resident_blocks
            self.spare = list(gpu_blocks[:r])  # resident blocks, assigned at prefill_done
            self.slot_blocks = list(gpu_blocks[r:r + slots])
            self.packs = list(gpu_blocks[r + slots:])
        self.slot_block_arr = np.asarray(self.slot_blocks, np.int32)  # GPU block of slot i
        self._pack_arr = np.asarray(self.packs, np.int32)

    # ---- prefill -------------------------------------------------------------------------------
    def prefill_table(self) -> list[int]:
        """Device placement: the GPU blocks the prompt is prefilled into (its own, as a dense request's)."""
        if self.plan.placement != "device":
            raise ValueError(f"request {self.owner}: host-placed prompts prefill layer by layer (prefill_units)")
        return self.table

    def prefill_units(self, scratch: list[int], num_gpu_blocks: int, prompt_tokens: int) -> np.ndarray:
        """Host placement: the flat unit (layer * NB + block) holding logical block j of the layer being prefilled,
        j < blocks of the prompt: every layer slice of the slot blocks, then of `scratch` (the request's extra
        prefill blocks, `SparsePlan.scratch_blocks` of them). Nothing else is written there before decoding starts."""
        n = blocks_for(prompt_tokens, self.plan.block_size)
        blocks = np.asarray(self.slot_blocks + list(scratch), np.int64)
        units = (np.arange(self.plan.num_layers)[None, :] * num_gpu_blocks + blocks[:, None]).reshape(-1)
        if len(units) < n:
            raise ValueError(f"request {self.owner}: a {prompt_tokens}-token prompt needs {n} prefill units, its "
                             f"{len(blocks)} slot and scratch blocks hold {len(units)}")
        return units[:n].astype(np.int32)

    def prefill_done(self, prompt_tokens: int) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """The prompt's blocks take their roles: returns (logical blocks to write to their host rows, logical blocks
        whose key bounds to compute (all of them: decoding keeps them current from there, `block_len` tokens each),
        (logical block, own GPU block) of the resident blocks, which take a copy of the prompt's KV there). Host
        placement calls it before the prefill (runner/offloaded_prefill.py spills each layer as it is computed);
        nothing here reads the KV."""
        p = self.plan
        n = blocks_for(prompt_tokens, p.block_size)
        self.num_blocks, self.tokens = n, prompt_tokens
        if p.placement == "device":
            self.gpu_of = dict(enumerate(self.table))
            self.gpu_arr[: len(self.table)] = self.table
            return [], list(range(n)), []
        keep = [j for j in range(n) if j < p.sink_blocks or j >= n - p.window_blocks]
        self.gpu_of = {j: self.spare.pop() for j in keep}
        self.gpu_arr[keep] = [self.gpu_of[j] for j in keep]
        return list(range(n)), list(range(n)), [(j, self.gpu_of[j]) for j in keep]

    def block_len(self, j: int) -> int:
        """Tokens logical block j holds (of `tokens`)."""
        return min(max(self.tokens - j * self.plan.block_size, 0), self.plan.block_size)

    def block_lens(self, n: int) -> list[int]:
        """`block_len(j)` of logical blocks 0 .. n - 1."""
        return [self.block_len(j) for j in range(n)]

    # ---- decode --------------------------------------------------------------------------------
    def advance(self, length: int) -> list[tuple[int, int]]:
        """The sequence now holds `length` tokens (the newest about to be written). Makes its block resident
        and returns the blocks that just left the window as (logical block, GPU block): the caller writes them
        back and computes their metadata before this step's selection."""
        p = self.plan
        n = blocks_for(length, p.block_size)
        self.tokens = length
        exits = []
        while self.num_blocks < n:
            j_new = self.num_blocks
            self.num_blocks += 1
            if p.placement == "host":
                self.gpu_of[j_new] = self.gpu_arr[j_new] = got = self.spare.pop()
                if self.leaving is not None and self.leaving[1] == got:
                    self.leaving = None  # its GPU block now holds the new one
            j_out = self.num_blocks - 1 - p.window_blocks
            if j_out >= p.sink_blocks:
                if p.placement == "host":
                    blk = self.gpu_of.pop(j_out)
                    self.gpu_arr[j_out] = -1
                    self.spare.append(blk)  # reused at the next block start, after this step's write-back
                    self.leaving = (j_out, blk)
                else:
                    blk = self.gpu_of[j_out]
                exits.append((j_out, blk))
        return exits

    def is_resident(self, j: int) -> bool:
        return j in self.gpu_of

    def is_middle(self, j: int) -> bool:
        """Logical block j is neither a sink nor in the recent window (the blocks selection chooses among)."""
        return self.plan.sink_blocks <= j < self.num_blocks - self.plan.window_blocks

    def dense_unit(self, j: int, d: int, num_gpu_blocks: int) -> int:
        """Flat unit (layer * NB + block) of logical block j in dense layer d."""
        if self.plan.placement == "device":
            return d * num_gpu_blocks + self.table[j]
        z = j * self.plan.dense_layers + d
        return (z % self.plan.num_layers) * num_gpu_blocks + self.packs[z // self.plan.num_layers]

    def dense_units(self, n: int, num_gpu_blocks: int) -> Int[np.ndarray, "D n"]:
        """`dense_unit(j, d, num_gpu_blocks)` for every dense layer d and logical block j < n, as one array."""
        p = self.plan
        j = np.arange(n)
        if p.placement == "device":
            table = np.asarray(self.table[:n], np.int64)
            return (np.arange(p.dense_layers)[:, None] * num_gpu_blocks + table).astype(np.int32)
        z = j * p.dense_layers + np.arange(p.dense_layers)[:, None]  # [D, n]
        return ((z % p.num_layers) * num_gpu_blocks + self._pack_arr[z // p.num_layers]).astype(np.int32)

    def owned_gpu_blocks(self) -> list[int]:
        if self.plan.placement == "device":
            return list(self.table)
        return sorted(set(self.gpu_of.values()) | set(self.spare) | set(self.slot_blocks) | set(self.packs))
