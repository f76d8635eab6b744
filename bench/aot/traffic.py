"""Bytes each kernel of an optimised HLO module moves through HBM, counted per instruction.

XLA's own HloCostAnalysis charges a gather or a dynamic slice its whole operand (a decode step's whole KV cache)
and a while body once; `compiled.cost_analysis()` is not implemented on the compile-only client. So bytes are
counted here, per kernel-producing instruction, with these rules:
  - a fusion reads, of each operand, what its fused computation reads: a sliced, dynamically sliced or gathered
    parameter only the slice or the gathered rows; the buffer a scatter / dynamic-update-slice updates in place
    nothing (the update is what is written); anything else whole (followed through bitcasts and nested
    fusions). It writes its root's bytes, or only the updates of an in-place root. What it reads of a host-memory
    operand, or writes into a host-memory result, crosses PCIe (a DMA) and is counted as a transfer, not HBM;
  - a copy reads and writes its bytes; an unfused dynamic-update-slice its update;
  - a Pallas kernel (a Triton custom call) moves what it is built to read (`PALLAS_TRAFFIC`: e.g. the sparse
    decode attention the listed blocks' K/V of each (sequence, KV head), never the whole pool it is handed);
  - other custom calls (cuBLAS GEMMs) read their operands and write their result;
  - loops count their body `known_trip_count` times; a conditional its costliest branch.
Each count is an estimate of compulsory traffic: a kernel re-reading its operands from L2 or HBM (small tiles,
split K) moves more; caches hide some re-reads of small operands.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from bench.aot.hlo import Array, Computation, Instruction
from pulseinfer_jax.kv.quant import SCALE_BYTES, block_tokens

NO_KERNEL = {"parameter", "constant", "bitcast", "get-tuple-element", "tuple", "after-all", "partition-id",
             "replica-id", "opt-barrier", "add-dependency", "domain", "iota"}
ASYNC_DONE = {"fusion-done", "copy-done", "async-done", "all-reduce-done", "send-done", "recv-done",
              "custom-call-done"}
VIEWS = {"bitcast", "reshape", "get-tuple-element"}  # a view of a parameter: follow its users


@dataclasses.dataclass
class KernelTraffic:
    """What one kernel-producing instruction moves, once."""

    name: str
    opcode: str
    read: int
    write: int
    kernel: str = ""  # Pallas kernel name, custom-call target or fusion kind
    host_to_device: int = 0  # bytes of a memory-space transfer (copy-start of a host buffer to the device)
    device_to_host: int = 0
    host_compute: bool = False  # runs on the host (compute_on("device_host") / HostExecute)

    @property
    def bytes(self) -> int:
        return self.read + self.write


# ---- Pallas kernels: name prefix -> (operand arrays, result arrays) -> (read, write) --------------
def _sparse_decode_attention(ops: list[tuple[Array, ...]], outs: tuple[Array, ...], valid: float = 1.0
                             ) -> tuple[int, int]:
    """q [B, Hkv, Gp, hd], pool (as K) [N, 2, bs, Hkv, hd], pool (as V), ids [B, S, Kp], lens: each (b, h)
    program reads its head's [bs, hd] K and V tile of every listed entry that holds tokens (padding entries are
    masked, not fetched): `valid` of the listed entries, as the caller knows them (1 = every entry). A float8 pool's
    blocks have bs + r rows: the program reads bs value rows and the 2 scale bytes of each token, and its rotation
    [hd, hd] (a sixth operand; L2-resident after the first program: read once). With the split merge inside (seven
    results: o, m, l, the splits' partials, the arrival counters, which are also the last operand) each program writes
    its partial and the last of each (sequence, KV head) reads them all back."""
    q, pool, _, ids, lens = (o[0] for o in ops[:5])
    small = sum(o[0].bytes for o in ops[5:])  # the rotation, the counters
    b, hkv = q.dims[:2]
    entries = b * hkv * ids.dims[2] * valid
    item = pool.bytes // max(1, _numel(pool))
    merged = sum(o.bytes for o in outs[3:6]) if len(outs) == 7 else 0
    return (int(q.bytes + ids.bytes + lens.bytes + small + merged + entries * 2 * _tile(pool) * item),
            sum(o.bytes for o in outs))


def _tile(pool: Array) -> int:
    """Elements a kernel reads of one block's K (or V) tile of one head, pool [.., rows, Hkv, hd]: rows x hd, or for a
    float8 cache's bytes bs value rows and 2 scale bytes a token."""
    rows, hd = pool.dims[-3], pool.dims[-1]
    if pool.dtype == "u8" or pool.dtype.startswith("f8"):
        return block_tokens(rows, hd, "float8_e4m3fn") * (hd + SCALE_BYTES)
    return rows * hd


def _block_scores(ops, outs, valid: float = 1.0) -> tuple[int, int]:
    """q4 [B, Hkv, G, hd], cand_ids [B, Kp], id_offset [1], meta_min [R, Hkv, hd], meta_max: each (b, h, tile) program
    reads its head's row of both bounds for every candidate (m rows each with sub-blocks: name `sub=m`); a padding
    candidate reads row 0 again (a cache hit, not HBM traffic): `valid` of the candidates are real. Appending
    (`append_and_score`: then the KeyAppend's three [B], the unit offset [1], the flat cache [U, 2, rows, Hkv, hd]
    (and a float8 cache's rotation [hd, hd]) follow, and the bounds come back aliased in place) each (b, h) program
    also reads its new key from the cache (a float8 one's: its value row and 2 scale bytes), one row of both bounds,
    and writes that row back."""
    q, ids, _, lo = (o[0] for o in ops[:4])
    b, hkv, _, hd = q.dims
    item = lo.bytes // max(1, _numel(lo))
    read = int(q.bytes + ids.bytes + 2 * b * ids.dims[1] * valid * hkv * hd * item)
    if len(outs) == 1:
        return read, outs[0].bytes
    pool = ops[9][0]
    f8 = pool.dtype == "u8" or pool.dtype.startswith("f8")
    key = b * hkv * (hd + SCALE_BYTES if f8 else hd * (pool.bytes // max(1, _numel(pool))))
    rows = 2 * b * hkv * hd * item  # the appended rows of both bounds
    small = sum(o[0].bytes for o in ops[5:9]) + sum(o[0].bytes for o in ops[10:])  # the KeyAppend, offset, rotation
    return read + small + key + rows, outs[0].bytes + rows


def _select_plan(ops, outs, valid: float = 1.0) -> tuple[int, int]:
    """Per (row, lane) program: its scores, block tables, kept scores and its rows of the slot state [SL*R*S, C] (not
    the whole state, which the call aliases in place); it writes the lists, counts and those state rows, and with the
    cache (aliased too) copies at most one block per row. The maps it keeps in scratch outputs stay in L2 (written and
    read back by the same program): not counted."""
    scores, gpu, host, slots, stamp = (o[0] for o in ops[9:14])
    rows_c = slots.dims[0] * outs[0].dims[1] * stamp.dims[-1] * 4  # B * S state rows of C int32 each
    kept_s, kept_l = (o[0] for o in ops[15:17])
    if kept_s.dims == scores.dims and kept_l.dims == gpu.dims:  # no kept scores: placeholders, one column read
        kept_s, kept_l = scores.bytes // scores.dims[-1], gpu.bytes // gpu.dims[-1]
    else:
        kept_s, kept_l = kept_s.bytes, kept_l.bytes
    small = sum(o[0].bytes for o in ops[:9]) + kept_s + kept_l
    read = small + scores.bytes + gpu.bytes + host.bytes + slots.bytes + 2 * rows_c
    write = sum(o.bytes for o in outs[:7]) + 2 * rows_c  # the lists and info, then the state rows
    if len(outs) > 16:  # the cache aliased in place: each row's spare fill reads and writes one block (at most)
        cache = outs[-1]
        block = cache.bytes // max(1, cache.dims[0])
        read, write = read + slots.dims[0] * block, write + slots.dims[0] * block
    return read, write


def _kept_scores(ops, outs, valid: float = 1.0) -> tuple[int, int]:
    """offset [1], units [B, KK], lens [B, KK], q [B, Hq, hd], pool [U, 2, rows, Hkv, hd] (, the float8 rotation): each
    (b, h) program reads its query group and its head's [bs, hd] K tile of every kept entry (padding and unwritten
    tokens masked: at most); a float8 pool's tiles bs value rows and 2 scale bytes a token."""
    off, units, lens, q, pool = (o[0] for o in ops[:5])
    b, kk = units.dims
    hkv = pool.dims[3]
    item = pool.bytes // max(1, _numel(pool))
    read = off.bytes + units.bytes + lens.bytes + q.bytes + sum(o[0].bytes for o in ops[5:])
    return read + int(b * kk * valid * hkv * _tile(pool) * item), sum(o.bytes for o in outs)


def _gather_rows(ops, outs, valid: float = 1.0) -> tuple[int, int]:
    """gather_blocks / gather_block_heads: the ids, then exactly the staging's bytes from the pool."""
    return sum(o[0].bytes for o in ops[:-1]) + sum(o.bytes for o in outs), sum(o.bytes for o in outs)


def _scatter_rows(ops, outs, valid: float = 1.0) -> tuple[int, int]:
    """scatter_blocks / scatter_block_heads: indices and staging read, the staging's bytes written in place."""
    staged = ops[-2][0].bytes
    return sum(o[0].bytes for o in ops[:-1]), staged


def _grouped_matmul(ops, outs, valid: float = 1.0) -> tuple[int, int]:
    """tile_group [T], x [T * tm, K], W (whole, indexed by each tile's group): each tile reads x's rows and its
    group's [K, N] matrix (an upper bound: tiles of no group read none)."""
    groups, x, w = (o[0] for o in ops)
    k = x.dims[1]
    n = outs[0].dims[1]
    item = w.bytes // max(1, _numel(w))
    return groups.bytes + x.bytes + groups.dims[0] * k * n * item, sum(o.bytes for o in outs)


PALLAS_TRAFFIC: dict[str, Callable] = {
    "sparse_decode_attention": _sparse_decode_attention,
    "block_scores": _block_scores,
    "select_plan": _select_plan,
    "kept_scores": _kept_scores,
    "gather_block_heads": _gather_rows,
    "gather_blocks": _gather_rows,
    "scatter_block_heads": _scatter_rows,
    "scatter_blocks": _scatter_rows,
    "grouped_matmul": _grouped_matmul,
}


def _numel(a: Array) -> int:
    n = 1
    for d in a.dims:
        n *= d
    return n


# ---- fusions -----------------------------------------------------------------------------------
def _param_read(comp: Computation, name: str, comps: dict[str, Computation], full: int) -> int:
    """Bytes the fused computation `comp` reads of its value `name` (a parameter or a view of one)."""
    total = 0
    for u in comp.users(name):
        if u.opcode in VIEWS:
            total += _param_read(comp, u.name, comps, full)
        elif u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == name:
            total += u.bytes
        elif u.opcode in ("scatter", "dynamic-update-slice") and u.operands[0] == name:
            pass  # the buffer updated in place: only the update is touched (counted as written)
        elif u.opcode == "fusion" and u.called("calls"):
            inner = comps[u.called("calls")[0]]
            params = inner.params()
            for idx, op in enumerate(u.operands):
                if op == name and idx in params:
                    total += _param_read(inner, params[idx].name, comps, params[idx].bytes)
        else:
            return full
        if total >= full:
            return full
    return total


def _written(comp: Computation, inst: Instruction, comps: dict[str, Computation]) -> int:
    """Bytes written by the value `inst` of a fused computation at its root: in-place updates count the update."""
    if inst.opcode == "tuple":
        return sum(_written(comp, comp.instructions[o], comps) for o in inst.operands if o in comp.instructions)
    if inst.opcode in VIEWS and inst.operands and inst.operands[0] in comp.instructions:
        return _written(comp, comp.instructions[inst.operands[0]], comps)
    if inst.opcode == "dynamic-update-slice":
        upd = comp.instructions.get(inst.operands[1])
        return upd.bytes if upd is not None else inst.bytes
    if inst.opcode == "scatter":
        n = len(inst.operands) // 2  # scatter(operands..., indices, updates...)
        upds = [comp.instructions.get(o) for o in inst.operands[n + 1:]]
        return sum(u.bytes for u in upds if u is not None) or inst.bytes
    return inst.bytes


def fusion_traffic(inst: Instruction, module: dict[str, Computation], caller: Computation
                   ) -> tuple[int, int, int, int]:
    """(HBM read, HBM write, host-to-device, device-to-host) bytes of one fusion: what it reads of a parameter in
    host memory (S(5)) crosses PCIe to the device, what it writes into a host-memory result crosses back (XLA's
    asynchronous dynamic slices of host buffers: DMAs)."""
    called = inst.called("calls")
    if not called or called[0] not in module:
        return sum(_operand_bytes(caller, o, module) for o in inst.operands), inst.bytes, 0, 0
    comp = module[called[0]]
    read = h2d = 0
    for p in comp.params().values():
        got = _param_read(comp, p.name, module, p.bytes)
        if any(a.host for a in p.shape):
            h2d += got
        else:
            read += got
    written = _written(comp, comp.root, module)
    if any(a.host for a in comp.root.shape):
        return read, 0, h2d, written
    return read, written, h2d, 0


def _operand_bytes(caller: Computation, name: str, module: dict[str, Computation]) -> int:
    inst = caller.instructions.get(name)
    return inst.bytes if inst is not None else 0


def instruction_traffic(inst: Instruction, caller: Computation, module: dict[str, Computation],
                        valid: dict[str, float] | None = None) -> KernelTraffic | None:
    """What `inst` (an instruction of a non-fused computation) moves when it runs once, or None if it launches
    nothing (views, tuples, parameters, the `-done` half of an async pair). `valid`: Pallas kernel name prefix ->
    the fraction of its listed entries that hold data (what the caller knows of its padding; default 1)."""
    op = inst.opcode
    if op in NO_KERNEL or op in ASYNC_DONE or op in ("while", "conditional", "call"):
        return None
    ops = [caller.instructions[o].shape if o in caller.instructions else () for o in inst.operands]
    if op in ("fusion", "fusion-start"):
        read, write, h2d, d2h = fusion_traffic(inst, module, caller)
        host = _host_compute(inst, module)
        return KernelTraffic(inst.name, op, read, write, inst.fusion_kind or "", host_to_device=h2d, device_to_host=d2h,
                             host_compute=host)
    if op == "copy-start":
        src = ops[0]
        dst = inst.shape[1:2] if len(inst.shape) > 1 else inst.shape
        nbytes = sum(a.bytes for a in src)
        h2d = nbytes if any(a.host for a in src) and not any(a.host for a in dst) else 0
        d2h = nbytes if not any(a.host for a in src) and any(a.host for a in dst) else 0
        return KernelTraffic(inst.name, op, nbytes, nbytes, "memcpy", host_to_device=h2d, device_to_host=d2h)
    if op == "copy":
        src = ops[0]
        h2d = inst.bytes if any(a.host for a in src) and not any(a.host for a in inst.shape) else 0
        d2h = inst.bytes if not any(a.host for a in src) and any(a.host for a in inst.shape) else 0
        return KernelTraffic(inst.name, op, inst.bytes, inst.bytes, "copy", host_to_device=h2d, device_to_host=d2h)
    if op == "dynamic-update-slice":
        upd = sum(a.bytes for a in ops[1]) if len(ops) > 1 else inst.bytes
        return KernelTraffic(inst.name, op, upd, upd)
    if op in ("custom-call", "custom-call-start"):
        target = inst.custom_call_target or ""
        kernel = inst.pallas_kernel
        if kernel is not None:
            fn = next((f for p, f in PALLAS_TRAFFIC.items() if kernel.startswith(p)), None)
            frac = next((v for p, v in (valid or {}).items() if kernel.startswith(p)), 1.0)
            if fn is not None:
                read, write = fn(ops, inst.shape, frac)
                return KernelTraffic(inst.name, op, read, write, kernel)
            return KernelTraffic(inst.name, op, sum(a.bytes for o in ops for a in o), inst.bytes, kernel)
        host = "host" in target.lower()
        return KernelTraffic(inst.name, op, sum(a.bytes for o in ops for a in o), inst.bytes, target,
                             host_compute=host)
    return KernelTraffic(inst.name, op, sum(a.bytes for o in ops for a in o), inst.bytes)


def _host_compute(inst: Instruction, module: dict[str, Computation]) -> bool:
    return bool(re.search(r'_xla_compute_type"?\s*[:=]\s*"?host', inst.attrs))
