"""The start-up checks of the GPU's fast paths: each program the GPU default runs, once at tiny shapes on the device,
against its plain-jnp (or numpy) reference. `backends.resolve_backends` runs the ones an engine's choices use.

A check returns None when the path runs and agrees, else one line saying what failed. Checks of Pallas kernels take
`interpret` (run them interpreted) so that the checks themselves are tested off a GPU. The paths:
  - `check_attention`: the sparse decode attention at each split count the engine can pick (`ATTENTION_SPLITS`,
    up to the kernel's largest), the splits merged inside the kernel through its arrival counters, twice on one
    counter buffer, and the one-split kernel alone (the dense decode's);
  - `check_scoring`: block scoring from key bounds (per KV head and, where the engine scores so, per query head),
    and the same kernel with the step's new keys appended to their bounds (`append_and_score`);
  - `check_select_plan`: the fused selection + slot plan kernel, two steps carrying the slot state, the spare
    block's fill copied inside, bit for bit;
  - `check_landing`: a recall's blocks written into their slots (`sparse_layer.land`), bit for bit;
  - the host transfers (`host_pool.probe_host_io`) and the grouped-GEMM kernel (`models.moe.probe_grouped_kernel`)
    live beside their code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pulseinfer_jax.kv.quant import pack_blocks, storage_dtype
from pulseinfer_jax.selection.policy import BlockScoring

TOL = dict(atol=3e-2, rtol=3e-2)  # bf16 kernels against float32-accumulating references


def attention_splits() -> tuple[int, ...]:
    """The split counts checked: 1, 2, 4 and the largest the kernel's heuristic picks."""
    from pulseinfer_jax.pallas_kernels.sparse_decode_attention import MAX_SPLIT_K

    return tuple(sorted({1, 2, 4, MAX_SPLIT_K}))


def _close(got, want, tol=TOL) -> bool:
    return bool(np.allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol))


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def check_attention(device: jax.Device, dtype=None, kv_dtype=None, *, interpret: bool = False) -> str | None:
    """The sparse decode attention in model dtype `dtype` (default bfloat16) over a cache of `kv_dtype` (default
    `dtype`; float8: bytes and scales) at every split count of `attention_splits()`, each against its reference."""
    import pulseinfer_jax.pallas_kernels.sparse_decode_attention as sda

    dtype = jnp.dtype(dtype or jnp.bfloat16)
    rng = np.random.default_rng(0)
    try:
        with jax.default_device(device):
            q = jnp.asarray(rng.standard_normal((2, 4, 64)), dtype)
            pool = pack_blocks(jnp.asarray(rng.standard_normal((6, 2, 16, 2, 64)), dtype), kv_dtype or dtype)
            ids = jnp.array([[[1, 2]], [[3, 1]]], jnp.int32)
            lens = jnp.array([[[16, 9]], [[16, 16]]], jnp.int32)
            got = sda.sparse_decode_attention(q, pool, ids, lens, interpret=interpret)[0]
            if not _close(got, sda.sparse_decode_attention_reference(q, pool, ids, lens)[0]):
                return "sparse_decode_attention (one split) disagrees with its jnp reference"
            counters = jnp.zeros((2 * 2,), jnp.int32)  # one per (sequence, KV head), shared by every call
            for split in attention_splits()[1:]:
                many = jnp.asarray(rng.integers(-1, 6, (2, 1, 2 * split)), jnp.int32)  # (-1: padding)
                lens = jnp.asarray(rng.integers(0, 17, (2, 1, 2 * split)), jnp.int32)
                want = sda.sparse_decode_attention_reference(q, pool, many, lens)[0]
                for _ in range(2):
                    got, _, _, counters = sda.sparse_decode_attention(q, pool, many, lens, counters, split_k=split,
                                                                      blocks_per_step=1, interpret=interpret)
                    if not _close(got, want):
                        return f"sparse_decode_attention's merge inside the kernel at {split} splits disagrees with " \
                               "its jnp reference"
                if np.any(np.asarray(counters)):
                    return f"sparse_decode_attention's merge inside at {split} splits left its arrival counters set"
    except Exception as e:  # noqa: BLE001 - any lowering / compile / runtime error of the kernel
        return _error(e)
    return None


def check_scoring(device: jax.Device, dtype=None, scoring: BlockScoring = BlockScoring(), kv_dtype=None, *,
                  interpret: bool = False) -> str | None:
    """Block scoring with the engine's `scoring` (key bounds in its metadata dtype, beta, sub-blocks; per KV head
    and, where it scores so, per query head), alone and with new keys appended to their bounds, against the
    references: scores within bf16 tolerance, the updated bounds bit for bit."""
    import pulseinfer_jax.pallas_kernels.block_scoring as bsc

    dtype = jnp.dtype(dtype or jnp.bfloat16)
    rng = np.random.default_rng(1)
    m = scoring.sub_blocks
    try:
        with jax.default_device(device):
            q = jnp.asarray(rng.standard_normal((2, 4, 64)), dtype)
            meta_dtype = scoring.metadata_dtype(dtype)
            lo = jnp.asarray(rng.standard_normal((6 * m, 2, 64)), meta_dtype)
            hi = jnp.asarray(np.asarray(lo, np.float32) + 1.0, meta_dtype)
            ids = jnp.array([[1, 2, -1], [3, 1, 4]], jnp.int32)
            pool = pack_blocks(jnp.asarray(rng.standard_normal((6, 2, 16, 2, 64)), dtype), kv_dtype or dtype)
            # row 0's key joins block 2 mid-slice, row 1's opens block 4 (its first token)
            append = bsc.KeyAppend(jnp.array([2, 4], jnp.int32), jnp.array([2, 4], jnp.int32),
                                   jnp.array([5, 0], jnp.int32))
            for per_head in sorted({False, scoring.per_query_head}):
                kw = dict(per_head=per_head, beta=scoring.beta, sub_blocks=m)
                got = bsc.block_scores(q, lo, hi, ids, interpret=interpret, **kw)
                if not _close(got, bsc.block_scores_reference(q, lo, hi, ids, **kw), dict(atol=5e-2, rtol=2e-2)):
                    return f"block_scores (per_head={per_head}) disagrees with its jnp reference"
                got = bsc.append_and_score(q, lo, hi, ids, None, append, pool, 0, interpret=interpret, **kw)
                want = bsc.append_and_score_reference(q, lo, hi, ids, None, append, pool, 0, **kw)
                if not _close(got[0], want[0], dict(atol=5e-2, rtol=2e-2)):
                    return f"append_and_score (per_head={per_head}) scores disagree with its jnp reference"
                for name, a, b in (("lower", got[1], want[1]), ("upper", got[2], want[2])):
                    if np.asarray(a).tobytes() != np.asarray(b).tobytes():
                        return f"append_and_score (per_head={per_head}) wrote other {name} key bounds than its " \
                               "jnp reference"
    except Exception as e:  # noqa: BLE001
        return _error(e)
    return None


def check_select_plan(device: jax.Device, *, interpret: bool = False) -> str | None:
    """The fused selection + slot plan (SoloHead, resident bonus, the spare block's fill copied inside, one row's
    middle blocks forced as a replayed trace's, the other's scored) over two steps that carry the slot state, bit for
    bit against `select_plan_reference`."""
    from pulseinfer_jax.pallas_kernels.select_plan import SCORER, select_plan, select_plan_reference
    from pulseinfer_jax.selection import slot_plan

    b, h, k, c, unit, bs = 2, 2, 12, 6, 40, 4
    kw = dict(budget=5, sink=1, window=1, select="normalized_sum", scale=0.3, bonus=0.25, block_size=bs)
    rng = np.random.default_rng(2)
    middle = np.full((2, b, 1, 3), SCORER, np.int32)  # (the engine always passes it: [SL, B, S, M])
    middle[1, 1, 0] = (4, 2, -1)
    try:
        with jax.default_device(device):
            stamp, key = slot_plan.init_state(2, 3, 1, c)
            kv = np.full((2, unit, 2, bs, 2, 8), np.nan, np.float32)  # (layer 0 never read: NaN shows a stray read)
            kv[1] = rng.standard_normal(kv[1].shape)
            for step in range(2):
                scores = rng.standard_normal((b, h, k)).astype(np.float32)
                nb = np.array([k, 7], np.int32)
                scores[1, :, 7:] = np.nan  # past row 1's blocks: never read
                gpu = np.full((b, k), -1, np.int32)
                gpu[:, 0], gpu[0, k - 1], gpu[1, 6] = (30, 31), 32, 33  # sinks and windows resident
                spare = (np.array([k - 2, -1], np.int32), np.array([34, 35], np.int32))
                scores[0, :, k - 2] = 3.0  # the block that just left the window, selected
                args = tuple(jnp.asarray(a) for a in (
                    scores, nb, stamp, key, np.int32(1), np.array([2, 0], np.int32), np.array([c, c - 2], np.int32),
                    gpu, rng.integers(1, 100, (b, k)).astype(np.int32),
                    np.arange(1, 1 + b * c, dtype=np.int32).reshape(b, c), nb * bs - np.array([0, 1], np.int32),
                    np.int32(unit)))
                spare = tuple(map(jnp.asarray, spare))
                want = select_plan_reference(*args, spare, 0, None, jnp.asarray(kv), jnp.asarray(middle), **kw)
                got = select_plan(*args[:2], jnp.array(args[2]), jnp.array(args[3]), *args[4:], spare, 0, None,
                                  jnp.asarray(kv), jnp.asarray(middle), interpret=interpret, **kw)
                for name, a, w in zip(want._fields, got, want, strict=True):
                    if np.asarray(a).tobytes() != np.asarray(w).tobytes():
                        return f"select_plan's {name} (step {step}) differs from its jnp reference"
                stamp, key, kv = want.stamp, want.key, np.asarray(want.kv)
    except Exception as e:  # noqa: BLE001
        return _error(e)
    return None


def check_landing(device: jax.Device, kv_dtype="bfloat16") -> str | None:
    """A recall landed into its slots (`sparse_layer.land`: two lanes' misses, padding into the null block) in the
    cache's storage dtype, bit for bit against numpy."""
    from pulseinfer_jax.runner.sparse_inputs import Landing
    from pulseinfer_jax.runner.sparse_layer import land

    rng = np.random.default_rng(3)
    dt = np.dtype(storage_dtype(kv_dtype))
    shape = (2, 8, 2, 4, 2, 8)  # [L, NB, 2, rows, Hkv, hd]
    kv_np = rng.integers(0, 256, shape).astype(dt) if dt == np.uint8 else rng.standard_normal(shape).astype(dt)
    staging = rng.integers(0, 256, (4, *shape[2:])).astype(dt) if dt == np.uint8 else \
        rng.standard_normal((4, *shape[2:])).astype(dt)
    misses = np.array([[[5, 0]], [[2, 7]]], np.int32)  # [B, S, N]: lane 0 one miss, lane 1 two
    info = np.zeros((2, 1, 6), np.int32)
    info[:, :, -3] = [[1], [2]]  # misses per lane
    try:
        with jax.default_device(device):
            landing = Landing(*(jnp.asarray(a) for a in (staging, misses, info)))
            got = np.asarray(land(jnp.asarray(kv_np), jnp.int32(1), landing))
    except Exception as e:  # noqa: BLE001
        return _error(e)
    want = kv_np.copy()
    want[1, [5, 2, 7]] = staging[:3]
    want[1, 0] = staging[3]  # (the padding entry: the null block)
    return None if got.tobytes() == want.tobytes() else "land wrote other bytes than the recall's into its slots"
