"""Block selection policies for sparse decode: budgets, top-k with sinks + window, SoloHead, calibration.

Everything here is plain jnp and jittable (except the offline `calibrate_retrieval_head`, which returns a Python
int). Candidates are *logical* block indices 0..K-1 of each sequence, in order. In the engine, a sparse layer's
selection call (`sparse_layer.sparse_pre`) scores them from their key bounds (`pallas_kernels.block_scoring`, with the
`BlockScoring` here), selects with `select_blocks` and plans the slot cache (`slot_plan.layer_plan`) in one jitted
call; `candidate_ids` / `logical_to_physical` / `selected_block_lens` are the same steps for callers that hold
physical block tables (tests, benches).

Selection contract (`select_blocks`), per sequence b with n = num_blocks_total[b] blocks:
  - n <= budget: every block 0..n-1 is selected.
  - otherwise the first `sink_blocks` and the last `window_blocks` (the partial last block included) are
    always selected and count toward the budget; the remaining budget - sink - window slots go to the
    highest-scoring middle blocks; on equal scores the lower logical index wins (NaN counts as -inf).
  - output int32 [B, S, budget_blocks], each row sorted ascending and padded with -1.
Forced middle blocks (`with_middle`: a replayed trace's, per layer, row and lane): a lane's middle blocks are its
list's instead (entries >= 0 in the middle range, each once; -1 pads), or the scored ones where the list holds
`SCORER`; the engine passes such a list every step, so that a replay runs the same programs.
Modes: "headwise" (S = number of score heads, an independent top-k per KV head: Quest's per-head baseline, one small
transfer per (block, head)) and "solohead" (S = 1: one shared set for all heads, so a layer's recall is whole blocks
in one contiguous transfer).

SoloHead aggregation `normalized_sum` = per-head softmax over the sequence's scored blocks, then the sum over heads.
A block's Quest score bounds its best logit, so softmax(score * scale) estimates the share of that head's attention
mass the block holds, and the sum over heads estimates the mass a shared set covers: the quantity SoloHead must keep
(what `calibrate_retrieval_head` measures). Softmax also gives every head the same total vote, so a head with flat
scores barely moves the ranking (z-scores would blow its noise up to unit variance). By default the sinks and the
window are scored too, from their key bounds like any block (`BlockScoring.kept_blocks`; each decoded key joins its
block's bounds as it is written, `block_scoring.append_and_score`), so a head whose mass sits there claims less of
the middle. `score_scale` is the softmax temperature: the attention scale
1/sqrt(hd) for per-query-head scores (the default, `BlockScoring.per_query_head`), 1/(G sqrt(hd)) for group sums.
What each choice measured: bench/RESULTS.md ("Accuracy of sparse decoding").
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from pulseinfer_jax.kv.blocks import bucket
from pulseinfer_jax.options import check_choices, option
from pulseinfer_jax.pallas_kernels.select_plan import SCORER

Mode = Literal["headwise", "solohead"]
SoloHead = Literal["normalized_sum", "retrieval_head"]


BoundsDtype = Literal["float8_e4m3fn", "kv"]
BOUNDS_DTYPES: tuple[str, ...] = typing.get_args(BoundsDtype)


@dataclasses.dataclass(frozen=True)
class BlockScoring:
    """How blocks are scored from their key bounds (`pallas_kernels.block_scoring`; measured in bench/RESULTS.md).

    beta: weight of the key-range term (score = q.mid + beta |q|.half; 1 = Quest's upper bound).
    per_query_head: SoloHead normalized_sum scores every query head on its own and softmaxes per query head
      (else per KV head, on the sum of its group's bounds). Same metadata bytes, G times the (cheap) arithmetic.
      Headwise and retrieval_head selections always score per KV head (they select per KV head).
    sub_blocks: bound m equal slices of each block separately (m rows of metadata per block, m times the bytes
      and the scoring reads) and score a block as the log-sum-exp of its slices; recall stays whole blocks.
    kept_blocks: SoloHead normalized_sum also scores the always-kept blocks (sinks, window; from their key bounds,
      kept current as each key is written), so their estimated mass is in the softmax (else the middle blocks share
      all of it). Changes no selection rule, only how the middle blocks' shares are estimated.
    resident_bonus: SoloHead normalized_sum ranks a middle block already in the layer's GPU slot cache as if its
      estimated mass were (1 + resident_bonus) times larger, so a block not resident must beat it by that factor
      to be recalled in its place (hysteresis: fewer recalls, see select_blocks). 0 = off.
    bounds_dtype: how the key bounds (the metadata the GPU keeps for every block of an offloaded request and
      reads every step) are stored: "float8_e4m3fn" (rounded outward so they still bound: a quarter / half of the
      bytes of float32 / bfloat16 bounds) or "kv" (the KV dtype: exact).
    coarse_group, coarse_keep: two-level scoring (1 = off): the GPU also keeps one bound per group of `coarse_group`
      consecutive blocks (the min / max over its blocks' bounds, 1 / coarse_group more metadata); a step scores the
      groups first, keeps `coarse_keep` x the middle budget's worth of the best ones (`top_groups`) and scores only
      their blocks' own bounds. At long contexts that cuts the metadata a step reads from every block's to
      1 / coarse_group of it plus the kept groups'; the selection rule after that is unchanged.
    """

    beta: float = option(0.5, "block scores' key-range weight: 1 = Quest's upper bound, 0 = the block midpoint",
                         flat="score_beta")
    per_query_head: bool = option(True, "SoloHead scores and softmaxes each query head on its own (off: per KV head "
                                  "on its group's summed bounds)", flat="score_per_query_head")
    sub_blocks: int = option(1, "key bounds per 1/m slice of a block (m x the metadata bytes; finer selection)",
                             flat="score_sub_blocks")
    kept_blocks: bool = option(True, "SoloHead also scores the sink and window blocks, so their attention share "
                               "is counted", flat="score_kept_blocks")
    resident_bonus: float = option(0.25, "SoloHead favours blocks already on the GPU: a block must hold (1 + bonus)"
                                   " x a resident one's estimated attention to replace it (0 = off)")
    bounds_dtype: BoundsDtype = option("float8_e4m3fn", "how the key bounds are stored on the GPU: float8_e4m3fn "
                                       "(rounded outward) or kv (the KV dtype, exact)", flat="score_bounds_dtype")
    coarse_group: int = option(1, "two-level scoring: score groups of this many blocks first, then only the best "
                               "groups' blocks (1 = off)", flat="score_coarse_group")
    coarse_keep: float = option(2.0, "groups two-level scoring keeps, in middle budgets' worth of blocks",
                                flat="score_coarse_keep")

    def __post_init__(self) -> None:
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not 0 <= self.beta <= 1:
            raise ValueError(f"score_beta={self.beta!r} must be a number in [0, 1] (1 = Quest's bound)")
        if not isinstance(self.per_query_head, bool):
            raise ValueError(f"score_per_query_head={self.per_query_head!r} must be a bool")
        m = self.sub_blocks
        if isinstance(m, bool) or not isinstance(m, int) or m < 1 or m & (m - 1):
            raise ValueError(f"score_sub_blocks={m!r} must be a power of two >= 1 (metadata slices per block)")
        if not isinstance(self.kept_blocks, bool):
            raise ValueError(f"score_kept_blocks={self.kept_blocks!r} must be a bool")
        rb = self.resident_bonus
        if isinstance(rb, bool) or not isinstance(rb, (int, float)) or not 0 <= rb < float("inf"):
            raise ValueError(f"resident_bonus={rb!r} must be a finite number >= 0 (0 = off)")
        check_choices(self)
        f = self.coarse_group
        if isinstance(f, bool) or not isinstance(f, int) or f < 1 or f & (f - 1):
            raise ValueError(f"score_coarse_group={f!r} must be a power of two >= 1 (blocks per group; 1 = off)")
        ck = self.coarse_keep
        if isinstance(ck, bool) or not isinstance(ck, (int, float)) or not 1 <= ck < float("inf"):
            raise ValueError(f"score_coarse_keep={ck!r} must be a finite number >= 1 (groups kept, in middle budgets)")

    def metadata_dtype(self, kv_dtype) -> jnp.dtype:
        """The dtype the key bounds are stored in for a KV cache of `kv_dtype`."""
        return jnp.dtype(kv_dtype if self.bounds_dtype == "kv" else self.bounds_dtype)

    def check_block_size(self, block_size: int) -> None:
        if block_size % self.sub_blocks:
            raise ValueError(f"score_sub_blocks={self.sub_blocks} must divide block_size={block_size} (equal "
                             "token slices per block); lower score_sub_blocks")

    def coarse_groups(self, budget_blocks: int, sink_blocks: int, window_blocks: int, candidates: int) -> int:
        """Groups two-level scoring keeps for `candidates` logical blocks; 0 = score every block (off, or the kept
        groups would cover them all anyway)."""
        if self.coarse_group == 1:
            return 0
        kept = coarse_groups_kept(budget_blocks, sink_blocks, window_blocks, self.coarse_group, self.coarse_keep)
        return kept if kept < -(-candidates // self.coarse_group) else 0

    def per_head(self, mode: str, solohead: str) -> bool:
        """Whether a selection with this mode / SoloHead variant scores per query head."""
        return self.per_query_head and mode == "solohead" and solohead == "normalized_sum"

    def scores_kept(self, mode: str, solohead: str) -> bool:
        """Whether a selection with this mode / SoloHead variant scores the always-kept blocks (only a softmax over
        blocks, SoloHead's normalized_sum, reads their scores)."""
        return self.kept_blocks and mode == "solohead" and solohead == "normalized_sum"

    def favours_resident(self, mode: str, solohead: str) -> bool:
        """Whether a selection with this mode / SoloHead variant applies the resident-block bonus (SoloHead
        normalized_sum: its ranking key is an estimated mass, which a factor compares across blocks)."""
        return self.resident_bonus > 0 and mode == "solohead" and solohead == "normalized_sum"


def bucket_budget(tokens: int, block_size: int, *, min_blocks: int = 16) -> int:
    """Token budget -> number of blocks, rounded up to a power of two (at least `min_blocks`), so the
    number of distinct selection/attention shapes compiled stays logarithmic in the budget."""
    if tokens <= 0 or block_size <= 0 or min_blocks <= 0:
        raise ValueError(f"tokens={tokens}, block_size={block_size} and min_blocks={min_blocks} must be positive")
    return max(int(min_blocks), bucket(-(-int(tokens) // int(block_size))))


def candidate_ids(
    block_tables: Int[Array, "B MB"], num_blocks_total: Int[Array, " B"], num_candidates: int | None = None
) -> Int[Array, "B K"]:
    """Physical ids of each sequence's logical blocks 0..K-1 (K = num_candidates or MB), -1 past its end:
    the `cand_ids` input of `block_scores` whose scores `select_blocks` expects."""
    k = block_tables.shape[1] if num_candidates is None else int(num_candidates)
    tables = block_tables[:, :k]
    if tables.shape[1] < k:
        tables = jnp.pad(tables, ((0, 0), (0, k - tables.shape[1])), constant_values=-1)
    live = jnp.arange(k)[None, :] < num_blocks_total[:, None]
    return jnp.where(live, tables, -1).astype(jnp.int32)


def resident_mask(slot_keys: Int[Array, "B C"], num_candidates: int) -> Bool[Array, "B K"]:
    """Logical blocks held by each sequence's slot cache (`slot_keys`: a logical block per slot, -1 = free; see
    pulseinfer_jax/selection/slot_table.py) -> a [B, K] membership mask over candidates 0..K-1 (the `resident` input of
    `select_blocks`). A compare-and-reduce over the slots (one fused kernel on a GPU, where `membership_mask`'s
    scatter is two: a slot cache holds a few hundred blocks)."""
    k = jnp.arange(int(num_candidates), dtype=slot_keys.dtype)
    return (slot_keys[:, None, :] == k[None, :, None]).any(axis=-1)


def membership_mask(ids: Int[Array, "B C"], n: int) -> Bool[Array, "B N"]:
    """Per row, which of 0..n-1 appear in `ids` (entries outside 0..n-1, e.g. -1, are ignored): [B, n] bool."""
    b, n = ids.shape[0], int(n)
    idx = jnp.where((ids >= 0) & (ids < n), ids, n)
    return jnp.zeros((b, n + 1), bool).at[jnp.arange(b)[:, None], idx].set(True)[:, :n]


def logical_to_physical(selected: Int[Array, "B S N"], block_tables: Int[Array, "B MB"]) -> Int[Array, "B S N"]:
    """Map selected logical block indices to physical block ids; -1 stays -1."""
    safe = jnp.clip(selected, 0, block_tables.shape[1] - 1)
    phys = jnp.take_along_axis(block_tables[:, None, :], safe, axis=2)
    return jnp.where(selected >= 0, phys, -1).astype(jnp.int32)


def selected_block_lens(
    selected: Int[Array, "B S N"], lengths: Int[Array, " B"], block_size: int
) -> Int[Array, "B S N"]:
    """Valid tokens of each selected logical block (block_size, fewer for the partial last one, 0 for -1):
    the `block_lens` input of `sparse_decode_attention` that goes with `logical_to_physical(selected, ...)`."""
    n = jnp.clip(lengths[:, None, None] - selected * block_size, 0, block_size)
    return jnp.where(selected >= 0, n, 0).astype(jnp.int32)


def _top_blocks(
    key: Float[Array, "R K"], n: Int[Array, " R"], budget: int, sink: int, window: int
) -> Int[Array, "R N"]:
    """Rows of scores -> the selected logical indices per the module contract, [R, budget]."""
    r, k = key.shape
    idx = lax.broadcasted_iota(jnp.int32, (r, k), 1)
    n = jnp.clip(n, 0, k)[:, None]
    valid = idx < n
    forced = valid & ((idx < sink) | (idx >= n - window))
    # Sort by (category, -score, index): forced first, then middle blocks by descending score, then the
    # invalid tail, as two keys: the category folded into the score key (forced -inf, invalid +inf, the middle's
    # -score clipped to the finite floats; one sort operand fewer). The explicit index key makes the order (ties
    # included) deterministic on every backend.
    score = jnp.nan_to_num(key.astype(jnp.float32), nan=-jnp.inf, posinf=jnp.inf, neginf=-jnp.inf)
    big = jnp.finfo(jnp.float32).max
    rank_key = jnp.where(forced, -jnp.inf, jnp.where(valid, jnp.clip(-score, -big, big), jnp.inf)) + 0.0
    _, order = lax.sort((rank_key, idx), dimension=1, num_keys=2)  # (+ 0.0: -0.0 -> +0.0, a total order)
    m = min(budget, k)
    top = order[:, :m]
    keep = top < n  # the invalid tail sorts last: an index past the blocks is padding
    top = jnp.sort(jnp.where(keep, top, k), axis=1)  # ascending, invalid (sentinel k) last
    top = jnp.where(top == k, -1, top)
    if m < budget:
        top = jnp.pad(top, ((0, 0), (0, budget - m)), constant_values=-1)
    return top.astype(jnp.int32)


def _softmax_over_valid(
    scores: Float[Array, "B H K"], valid: Bool[Array, "B H K"], scale: float | Float[Array, ""]
) -> Float[Array, "B H K"]:
    s = jnp.nan_to_num(scores.astype(jnp.float32) * scale, nan=-jnp.inf, posinf=jnp.finfo(jnp.float32).max,
                       neginf=-jnp.inf)
    s = jnp.where(valid, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a head with no finite score contributes nothing
    e = jnp.where(valid, jnp.exp(s - m), 0.0)
    return e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), jnp.finfo(jnp.float32).tiny)


def summed_shares(scores: Float[Array, "B H K"], num_blocks_total: Int[Array, " B"],
                  score_scale: float | Float[Array, ""]) -> Float[Array, "B 1 K"]:
    """SoloHead normalized_sum's ranking key before the resident bonus: each head's softmax over the valid blocks,
    summed over heads (under tensor parallelism the sum over devices is one all-reduce of [B, K])."""
    valid = jnp.arange(scores.shape[2])[None, None, :] < num_blocks_total[:, None, None]
    return jnp.sum(_softmax_over_valid(scores, valid, score_scale), axis=1, keepdims=True)


def select_blocks(
    scores: Float[Array, "B H K"],
    num_blocks_total: Int[Array, " B"],
    *,
    budget_blocks: int,
    sink_blocks: int,
    window_blocks: int,
    mode: Mode,
    solohead: SoloHead = "normalized_sum",
    retrieval_head: int | Int[Array, ""] = 0,
    score_scale: float | Float[Array, ""] = 1.0,
    resident: Bool[Array, "B K"] | None = None,
    resident_bonus: float = 0.0,
) -> Int[Array, "B S N"]:
    """Select logical blocks per the module contract; returns int32 [B, S, budget_blocks] (N = budget).

    scores: [B, H, K] block scores of logical blocks 0..K-1 (H = Hkv from `block_scores`, or Hq with
      per_head=True; entries at or past num_blocks_total are ignored).
    num_blocks_total: [B] blocks of each sequence (clamped to [0, K]: the candidates must cover them).
    budget_blocks, sink_blocks, window_blocks: static ints (bucket the budget with `bucket_budget`).
    mode: "headwise" -> S = H, a top-k per head; "solohead" -> S = 1, one set shared by all heads.
    solohead: "normalized_sum" (softmax per head over valid blocks, summed; see the module docstring) or
      "retrieval_head" (the scores of head `retrieval_head`, an int or a traced per-layer scalar, clamped).
    score_scale: softmax temperature of normalized_sum (1/sqrt(hd) per query head, 1/(G sqrt(hd)) for
      group sums); unused otherwise.
    resident, resident_bonus: normalized_sum only: blocks marked resident (already in the GPU slot cache) rank by
      (1 + resident_bonus) x their summed share; sinks, window and the budget are unchanged.
    Jittable: the static arguments are plain Python values, scores/num_blocks_total/retrieval_head/
    score_scale may be traced.
    """
    if scores.ndim != 3:
        raise ValueError(f"scores must be [B, H, K], got shape {scores.shape}")
    b, h, _ = scores.shape
    if num_blocks_total.shape != (b,):
        raise ValueError(f"num_blocks_total must be [B] = [{b}], got shape {num_blocks_total.shape}")
    if min(budget_blocks, sink_blocks, window_blocks) < 0 or budget_blocks == 0:
        raise ValueError(f"need budget_blocks > 0 and sink_blocks, window_blocks >= 0; got {budget_blocks=}, "
                         f"{sink_blocks=}, {window_blocks=}")
    if sink_blocks + window_blocks > budget_blocks:
        raise ValueError(f"{sink_blocks=} + {window_blocks=} exceed {budget_blocks=}: the always-kept blocks "
                         "count toward the budget; raise the budget or shrink sinks/window")
    if mode not in ("headwise", "solohead"):
        raise ValueError(f"mode={mode!r} must be 'headwise' or 'solohead'")
    if solohead not in ("normalized_sum", "retrieval_head"):
        raise ValueError(f"solohead={solohead!r} must be 'normalized_sum' or 'retrieval_head'")
    if isinstance(retrieval_head, int | np.integer) and not 0 <= int(retrieval_head) < h:
        raise ValueError(f"retrieval_head={retrieval_head} must index one of the H={h} score heads")
    if resident is not None:
        if mode != "solohead" or solohead != "normalized_sum":
            raise ValueError("resident (the resident-block bonus) applies to SoloHead normalized_sum only, got "
                             f"{mode=}, {solohead=}")
        if resident.shape != (b, scores.shape[2]):
            raise ValueError(f"resident must be [B, K] = [{b}, {scores.shape[2]}], got shape {resident.shape}")
        if not 0 <= float(resident_bonus) < float("inf"):
            raise ValueError(f"resident_bonus={resident_bonus!r} must be a finite number >= 0")
    return _select_blocks(scores, num_blocks_total, retrieval_head, score_scale, resident, budget=int(budget_blocks),
                          sink=int(sink_blocks), window=int(window_blocks), mode=mode, solohead=solohead,
                          bonus=float(resident_bonus))


@functools.partial(jax.jit, static_argnames=("budget", "sink", "window", "mode", "solohead", "bonus"))
def _select_blocks(
    scores: Float[Array, "B H K"],
    num_blocks_total: Int[Array, " B"],
    retrieval_head: Int[Array, ""],
    score_scale: Float[Array, ""],
    resident: Bool[Array, "B K"] | None,
    *,
    budget: int,
    sink: int,
    window: int,
    mode: str,
    solohead: str,
    bonus: float,
) -> Int[Array, "B S N"]:
    b, h, k = scores.shape
    n = num_blocks_total.astype(jnp.int32)
    if mode == "headwise":
        sel = _top_blocks(scores.reshape(b * h, k), jnp.repeat(n, h), budget, sink, window)
        return sel.reshape(b, h, budget)
    if solohead == "normalized_sum":
        key = summed_shares(scores, n, score_scale)[:, 0]  # [B, K]
        if resident is not None:
            key = jnp.where(resident, key * (1.0 + bonus), key)
    else:  # retrieval_head
        head = jnp.clip(jnp.asarray(retrieval_head, jnp.int32), 0, h - 1)
        key = lax.dynamic_index_in_dim(scores, head, axis=1, keepdims=False)  # [B, K]
    return _top_blocks(key, n, budget, sink, window)[:, None, :]


def with_middle(sel: Int[Array, "B S N"], middle: Int[Array, "B S M"], num_blocks: Int[Array, " B"], sink: int,
                window: int) -> Int[Array, "B S N"]:
    """`select_blocks`' selection `sel` with each lane's middle blocks replaced by `middle`'s (module docstring):
    its sinks and window, then the listed blocks of the middle range (sinks <= j < n - window), each once, sorted and
    -1 padded; lanes whose list holds `SCORER` keep `sel`. Two sorts of a lane's N + M entries."""
    big = jnp.iinfo(jnp.int32).max
    n = num_blocks[:, None, None]
    fixed = jnp.where((sel >= 0) & ((sel < sink) | (sel >= n - window)), sel, big)
    mid = middle.astype(jnp.int32)
    mid = jnp.sort(jnp.where((mid >= sink) & (mid < n - window), mid, big), axis=-1)
    mid = jnp.where(mid == jnp.pad(mid, ((0, 0), (0, 0), (1, 0)), constant_values=-1)[..., :-1], big, mid)  # repeats
    both = jnp.sort(jnp.concatenate([fixed.astype(jnp.int32), mid], axis=-1), axis=-1)[..., : sel.shape[-1]]
    replaced = jnp.where(both == big, -1, both).astype(sel.dtype)
    return jnp.where(jnp.any(middle == SCORER, axis=-1, keepdims=True), sel, replaced)


def coarse_groups_kept(budget_blocks: int, sink_blocks: int, window_blocks: int, group: int, keep: float) -> int:
    """Two-level scoring: how many groups of `group` blocks the first level keeps, `keep` x the middle budget's worth
    (static: shapes depend on it)."""
    middle = max(1, budget_blocks - sink_blocks - window_blocks)
    return max(1, -(-int(np.ceil(keep * middle)) // group))


def top_groups(
    scores: Float[Array, "B H G"], keep_groups: int, score_scale: float | Float[Array, ""]
) -> Int[Array, "B KG"]:
    """First level of two-level scoring: the `keep_groups` groups of blocks with the largest estimated attention
    share, from one bound per group (`scores`: a group's block score from the min / max of its blocks' key bounds,
    -inf or NaN = a group with no scored block). The share is SoloHead normalized_sum's: a softmax per score head over
    the valid groups, summed over heads (for every selection mode: the groups only prefilter which blocks the second
    level scores). Ties go to the lower index; groups with no valid score are never kept. Returns the kept groups'
    indices [B, min(keep_groups, G)] int32, best first, -1 where fewer groups are valid."""
    valid = scores.astype(jnp.float32) > -jnp.inf  # (False for NaN)
    share = jnp.sum(_softmax_over_valid(scores, valid, score_scale), axis=1)  # [B, G]
    any_valid = jnp.any(valid, axis=1)
    key = jnp.where(any_valid, share, -1.0)  # shares are >= 0: an invalid group ranks last
    _, idx = lax.top_k(key, min(int(keep_groups), scores.shape[2]))  # lower index first on ties
    return jnp.where(jnp.take_along_axis(any_valid, idx, axis=1), idx, -1).astype(jnp.int32)


def block_attention_mass(
    q: Float[Array, "P Hq hd"] | Float[Array, "Hq hd"],
    keys: Float[Array, "T Hkv hd"],
    block_size: int,
    *,
    scale: float | None = None,
    q_positions: Int[Array, " P"] | None = None,
    average: bool = True,
) -> Float[Array, "Hq nblocks"] | Float[Array, "P Hq nblocks"]:
    """True attention mass per block for a calibration pass: softmax(q k^T * scale) over the T prompt keys
    (GQA: query head i reads KV head i // G), summed inside each block of `block_size` tokens and averaged
    over the P query positions (`average=False`: one row per position, [P, Hq, nblocks]). Rows sum to 1.
    `q_positions` (token index of each query) applies the causal mask; without it every query sees all T keys
    (queries at the end of the prompt). Float32 result."""
    q = jnp.asarray(q, jnp.float32)
    keys = jnp.asarray(keys, jnp.float32)
    if q.ndim == 2:
        q = q[None]
    if q.ndim != 3 or keys.ndim != 3 or q.shape[-1] != keys.shape[-1]:
        raise ValueError(f"q must be [P, Hq, hd] or [Hq, hd] and keys [T, Hkv, hd] with the same hd; got "
                         f"{q.shape} and {keys.shape}")
    p, hq, hd = q.shape
    t, hkv, _ = keys.shape
    if hq % hkv:
        raise ValueError(f"num_q_heads={hq} must be divisible by num_kv_heads={hkv}")
    g = hq // hkv
    scale = hd ** -0.5 if scale is None else scale
    logits = jnp.einsum("pkgd,tkd->pkgt", q.reshape(p, hkv, g, hd), keys,
                        precision=lax.Precision.HIGHEST).reshape(p, hq, t) * scale
    if q_positions is not None:
        visible = jnp.arange(t)[None, :] <= jnp.asarray(q_positions)[:, None]  # [P, T]
        logits = jnp.where(visible[:, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)  # [P, Hq, T]
    nblocks = -(-t // block_size)
    probs = jnp.pad(probs, ((0, 0), (0, 0), (0, nblocks * block_size - t)))
    mass = probs.reshape(p, hq, nblocks, block_size).sum(-1)
    return mass.mean(0) if average else mass


def calibrate_retrieval_head(
    attn_probs: Float[Array, "Hq nblocks"] | Float[Array, "P Hq nblocks"],
    budget_blocks: int,
    sink_blocks: int,
    window_blocks: int,
    group_size: int,
) -> int:
    """The KV head whose own top-k block selection covers the most attention mass of all heads.

    attn_probs: true attention mass per block (e.g. `block_attention_mass`), rows = query heads grouped by
      `group_size` consecutive rows per KV head (pass group_size=1 for rows that already are KV heads);
      an optional leading axis of P calibration prompts (same block count) adds their coverages.
    Each KV head's mass is its group's sum, normalised to 1 (every head counts equally). Candidate head h
    selects with `select_blocks` on its own mass (same sinks/window/budget as at runtime); its coverage
    is the sum over all KV heads (itself included: the set serves every head) of the mass inside that
    set. Returns the argmax (lowest index on ties) as a Python int; run once per layer, offline.
    """
    mass = jnp.asarray(attn_probs, jnp.float32)
    if mass.ndim == 2:
        mass = mass[None]
    if mass.ndim != 3:
        raise ValueError(f"attn_probs must be [Hq, nblocks] or [P, Hq, nblocks], got shape {mass.shape}")
    p, hq, nb = mass.shape
    if group_size <= 0 or hq % group_size:
        raise ValueError(f"attn_probs has {hq} head rows, not a multiple of group_size={group_size}")
    hkv = hq // group_size
    mass = jnp.nan_to_num(mass).reshape(p, hkv, group_size, nb).sum(2)  # [P, Hkv, nb]
    mass = mass / jnp.maximum(mass.sum(-1, keepdims=True), jnp.finfo(jnp.float32).tiny)
    sel = select_blocks(mass, jnp.full((p,), nb, jnp.int32), budget_blocks=budget_blocks,
                        sink_blocks=sink_blocks, window_blocks=window_blocks, mode="headwise")  # [P, Hkv, N]
    member = jnp.zeros((p, hkv, nb + 1), jnp.float32)
    member = member.at[jnp.arange(p)[:, None, None], jnp.arange(hkv)[None, :, None],
                       jnp.where(sel >= 0, sel, nb)].set(1.0)[..., :nb]  # [P, Hkv(candidate), nb]
    coverage = jnp.einsum("pcn,phn->c", member, mass, precision=lax.Precision.HIGHEST)  # [Hkv]
    return int(jnp.argmax(coverage))
