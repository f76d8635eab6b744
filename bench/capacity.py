"""How much context each system holds under a GPU KV budget, from the engine's own accounting (nothing is timed).

    python bench/capacity.py [--model llama-3.1-8b] [--hbm-gb 141] [--host-gb 100,1024] [--lengths 32768,131072]
    python bench/capacity.py --passkey [--tokens 7000]   # SmolLM2 on this machine, a quarter of its dense KV

Accounting (default): for each system (dense, offload-headwise, PulseInfer offloading every request, PulseInfer with
IOAA), the longest single prompt the engine admits and the most requests of each length it decodes at once. It runs
the engine's sizing (`pools.pool_sizes`), scheduler and offload placer (`scheduler.Scheduler`,
`placer.OffloadPlacer`) over requests that are only bookkeeping: prefill is a step per request, no model is built,
and the host pool is its row allocator only, `--host-gb` of pinned memory. The GPU KV budget is what the engine takes
on a GPU of `--hbm-gb` next to the model's bf16 weights (`aot.suite.kv_cap`: 85% of jax's share after the weights).
IOAA admits offloaded requests while their predicted recall fits `ioaa_slack` of a decode step at `--h2d-gbs`
(20 ms steps assumed before any is measured: the engine's default), so its count can be below the memory's. Requests
"held at once" decode their new tokens to the end together: a dense request's KV grows as it decodes (admission takes
its prompt's blocks), and one preempted on the way does not count.

Passkey (`--passkey`): SmolLM2-135M-Instruct on this machine with a `--tokens`-token passkey document under a GPU KV
budget of a quarter of its dense KV: the dense engine refuses it, the offloaded one runs it (budget 1,024 tokens),
and the run records whether the passkey is found and the peak GPU KV (the allocator's high-water mark of blocks plus
the key bounds) against the budget. Results: `bench/results/capacity_<model>.json` / `capacity_passkey_cpu.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import write_result  # noqa: E402

SYSTEMS = {
    "dense": dict(mode="dense"),
    "offload-headwise": dict(mode="offload", selection="headwise", io="fragmented", recall="sync"),
    "pulseinfer-offload": dict(mode="offload"),
    "pulseinfer": dict(mode="auto"),
}
NEW_TOKENS = 128


class HostRows:
    """The part of a host KV pool admission reads: its row allocator and the size of a row (no storage)."""

    def __init__(self, rows: int, align: int, layer_block_bytes: int):
        from pulseinfer_jax.kv.blocks import BlockAllocator, ExtentAllocator

        self.allocator = BlockAllocator(rows) if align == 1 else ExtentAllocator(rows, align)
        self.row_align = align
        self.layer_block_bytes = layer_block_bytes

    def allocate(self, n: int, owner: int) -> list[int]:
        return self.allocator.allocate(n, owner)

    def free(self, rows: list[int], owner: int) -> None:
        self.allocator.free(rows, owner)


@dataclasses.dataclass
class Run:
    admitted: int  # most requests decoding at once
    refused: int  # requests the engine refused when they were submitted
    gpu_bytes: int  # GPU KV bytes of the pools (blocks + key bounds)
    host_rows: int


def admit(model_cfg, config, prompts: list[int], gpu_budget: int, host_bytes: int, h2d: float) -> Run:
    """Submit `prompts` together; run admission (prefill one request per step, nobody finishes) until it settles, then
    decode every running request to its last token: `admitted` counts those that got there without a preemption."""
    from pulseinfer_jax.kv.blocks import BlockAllocator, blocks_for
    from pulseinfer_jax.kv.quant import layer_block_bytes, resolve_kv_dtype, storage_dtype
    from pulseinfer_jax.request import Request, SamplingParams
    from pulseinfer_jax.sched.admission import IOAAConfig
    from pulseinfer_jax.sched.placer import OffloadPlacer
    from pulseinfer_jax.sched.pools import metadata_bytes, pool_sizes
    from pulseinfer_jax.sched.scheduler import FixedStepTime, Scheduler

    c, bs = model_cfg, config.block_size
    kv = storage_dtype(resolve_kv_dtype(config.kv_dtype, "bfloat16"))  # a bf16 model's KV, or float8's bytes
    per_block = c.num_layers * layer_block_bytes(bs, c.num_kv_heads, c.head_dim, kv)
    row_bytes = (c.num_layers - config.offload.dense_layers) * per_block // c.num_layers
    reqs = [Request(i, range(p), SamplingParams(max_new_tokens=NEW_TOKENS), NEW_TOKENS) for i, p in enumerate(prompts)]
    wanted = sum(blocks_for(r.need_tokens, bs) for r in reqs) * row_bytes
    if config.mode != "dense" and wanted > host_bytes:  # the host pool: what they need, within the pinned memory
        config = config.with_settings(host_kv_tokens=max(bs, host_bytes // row_bytes * bs))
    try:
        sizes = pool_sizes(config, c, kv, config.scoring.metadata_dtype("bfloat16").itemsize, reqs, gpu_budget)
    except ValueError:
        return Run(0, len(prompts), 0, 0)
    alloc = BlockAllocator(sizes.num_blocks)
    if sizes.plan is None:
        sched, meta = Scheduler(alloc, bs, config.max_batch), 0
    else:
        layer_block = per_block // c.num_layers
        pool = HostRows(sizes.host_rows, config.scoring.coarse_group, layer_block)
        placer = OffloadPlacer(sizes.plan, alloc, pool, bs)
        ioaa = IOAAConfig(h2d_bytes_per_s=h2d, slack=config.offload.ioaa_slack)
        sched = Scheduler(alloc, bs, config.max_batch, mode=config.mode, placer=placer, ioaa=ioaa,
                          cost=FixedStepTime(config.offload.ioaa_step_time_s))
        meta = metadata_bytes(sizes.plan, sizes.host_rows, c.head_dim, 1, config.scoring.sub_blocks,
                              config.scoring.coarse_group)
    refused = 0
    for r in reqs:
        try:
            sched.add(r)
        except ValueError:
            refused += 1
    for _ in range(4 * len(reqs) + 4):
        sched.admit()
        pf = sched.next_prefill()
        if pf is None:
            break
        sched.prefill_done(pf)
        pf.output.append(0)
    for _ in range(NEW_TOKENS - 1):  # they decode to the end: a dense request's KV grows, the youngest preempted
        sched.reserve_decode()
        for r in sched.running:
            r.output.append(0)
    return Run(len(sched.running), refused, sizes.num_blocks * per_block + meta, sizes.host_rows)


def largest(fits, lo: int, hi: int) -> int:
    """The largest n in [lo, hi] with fits(n) (fits monotone), lo - 1 if none."""
    if not fits(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def accounting(args) -> dict:
    from pulseinfer_jax.models.config import ModelConfig
    from pulseinfer_jax.models.presets import PRESETS

    from bench.aot.suite import kv_cap
    from pulseinfer_jax.config import EngineConfig

    cfg = ModelConfig.from_hf_dict(PRESETS[args.model], name=args.model)
    budget = kv_cap(cfg, int(args.hbm_gb * 1e9))
    lengths = [int(x) for x in args.lengths.split(",")]
    rows, h2d = [], args.h2d_gbs * 1e9
    for kv_dtype, host_gb in ((k, float(x)) for k in args.kv_dtypes.split(",") for x in args.host_gb.split(",")):
        host = int(host_gb * 2**30)
        for name, over in SYSTEMS.items():
            config = EngineConfig.of(**over, max_batch=4096, budget_tokens=args.budget_tokens, kv_dtype=kv_dtype)

            def holds(prompts: list[int], config=config, host=host) -> bool:  # every request decoding at once
                return not prompts or admit(cfg, config, prompts, budget, host, h2d).admitted == len(prompts)

            longest = largest(lambda p: holds([p]), 1024, 1 << 26)
            row = {"system": name, "config": over, "kv_dtype": kv_dtype, "host_bytes": host, "longest_prompt": longest,
                   "concurrent": {}}
            for n in lengths:
                row["concurrent"][str(n)] = largest(lambda k, n=n: holds([n] * k), 0, 4096)
            rows.append(row)
            print(f"kv {kv_dtype:13s} host {host_gb:6.0f} GiB  {name:20s} longest prompt {longest:>10,d} tokens; "
                  "concurrent "
                  + ", ".join(f"{n // 1024}K: {row['concurrent'][str(n)]}" for n in lengths), flush=True)
    return {"model": args.model, "gpu_kv_budget": budget, "hbm_gb": args.hbm_gb,
            "h2d_bytes_per_s": args.h2d_gbs * 1e9, "budget_tokens": args.budget_tokens, "new_tokens": NEW_TOKENS,
            "max_position_embeddings": cfg.max_position_embeddings, "rows": rows}


def passkey(args) -> dict:
    from pulseinfer_jax import Engine, EngineConfig, generate_long, load_model
    from pulseinfer_jax.demo import passkey_prompt

    m = load_model(None)
    c = m.cfg
    key = 71893
    prompt = passkey_prompt(m.tokenizer, args.tokens, args.depth, key)
    ids = m.tokenizer.encode(prompt, add_special_tokens=True)
    per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 4  # float32 on CPU
    budget = (len(ids) + 12) * per_token // 4
    base = dict(gpu_kv_budget=budget, progress=False)
    out = {"model": m.source, "prompt_tokens": len(ids), "gpu_kv_budget": budget,
           "dense_kv_bytes": (len(ids) + 12) * per_token, "passkey": key, "depth": args.depth}
    try:
        generate_long([ids], m, max_new_tokens=12, engine_config=EngineConfig.of(**base))
        out["dense"] = "ran"
    except ValueError as e:
        out["dense"] = f"refused: {e}"
    config = EngineConfig.of(**base, mode="offload", budget_tokens=args.budget_tokens)
    middle = config.budget_blocks - config.offload.sink_blocks - config.window_blocks
    config = config.with_settings(slot_cache_blocks=args.slot_cache_blocks or middle)  # one step's selection
    eng = Engine(m, config)
    t0 = time.perf_counter()
    res = generate_long([ids], eng, max_new_tokens=12, chat=False)[0]
    wall = time.perf_counter() - t0
    per_block = eng.spec.bytes_per_block
    peak = eng.allocator.peak_used * per_block + eng.sparse.metadata_bytes
    out.update({"offload": {"config": {"mode": "offload", "budget_tokens": args.budget_tokens,
                                       "slot_cache_blocks": config.slot_blocks},
                            "text": res.text, "found": str(key) in res.text,
                            "peak_gpu_kv_bytes": peak, "peak_blocks": eng.allocator.peak_used,
                            "pool_blocks": eng.spec.num_blocks, "metadata_bytes": eng.sparse.metadata_bytes,
                            "prefill_s": res.stats["prefill_s"], "wall_s": wall,
                            "recall_bytes": res.stats["recall_bytes"]}})
    print(f"{len(ids)}-token passkey document, GPU KV budget {budget / 2**20:.1f} MiB (a quarter of "
          f"{out['dense_kv_bytes'] / 2**20:.1f} MiB): dense {out['dense'][:60]}; offloaded "
          f"found={out['offload']['found']} ({res.text!r}), peak GPU KV {peak / 2**20:.1f} MiB", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="a models/presets.py name (accounting)")
    ap.add_argument("--hbm-gb", type=float, default=141.0, help="GPU memory (H200: 141 GB)")
    ap.add_argument("--host-gb", default="100,1024", help="pinned host memory for the KV pool (GiB), a comma list")
    ap.add_argument("--h2d-gbs", type=float, default=50.0, help="host-to-device GB/s IOAA assumes")
    ap.add_argument("--lengths", default="32768,131072", help="request lengths (tokens) for the concurrency count")
    ap.add_argument("--budget-tokens", type=int, default=None, help="sparse attention budget (default: the engine's; "
                    "1024 with --passkey)")
    ap.add_argument("--kv-dtypes", default="auto", help="EngineConfig.kv_dtype values, a comma list (accounting)")
    ap.add_argument("--passkey", action="store_true", help="run SmolLM2 on this machine instead (see above)")
    ap.add_argument("--tokens", type=int, default=7000)
    ap.add_argument("--depth", type=float, default=0.4)
    ap.add_argument("--slot-cache-blocks", type=int, default=None, help="--passkey: the offloaded request's slot "
                    "cache (default: one step's selection, the smallest)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.passkey:
        args.budget_tokens = args.budget_tokens or 1024
        path = write_result("capacity_passkey_cpu", passkey(args), args.out)
    else:
        args.budget_tokens = args.budget_tokens or 2048
        path = write_result(f"capacity_{args.model}", accounting(args), args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
