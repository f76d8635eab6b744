"""Dense decode throughput of the engine's jitted step (paged jnp attention) over a (context, batch) grid.

    python bench/dense_decode.py --model random:llama-3.1-8b --dtype bfloat16 --out DIR   # GPU
    python bench/dense_decode.py --smoke                                                  # CPU, tiny
    python bench/dense_decode.py --attention jnp,pallas --layer-loop scan,layerwise ...   # both axes

The KV pool is filled synthetically (random values, shuffled block tables: labelled as such in the
JSON) so long contexts cost no prefill time; decode cost does not depend on the values. Step time is the
median over --steps timed steps after a warm-up (compile) step, synchronised with block_until_ready.
`--layer-loop` compares the two ways a step runs its layers (pulseinfer_jax/runner/dense.py): "scan" (one jitted
call over the stacked weights) and "layerwise" (one jitted call per layer on per-layer weight arrays). The
JSON is rewritten after every grid point, so a timeout keeps what was measured.
A separate end-to-end run (`engine`) prefills a real prompt through generate_long and decodes, to time
chunked prefill and TTFT on the same machine.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import write_result  # noqa: E402


def step_times(model, ctx: int, batch: int, steps: int, block_size: int, attention: str = "jnp",
               layer_loop: str = "scan", split: list[dict] | None = None) -> dict:
    """split: the per-layer weights (LoadedModel.layer_params) for layer_loop="layerwise"."""
    from pulseinfer_jax.kv.blocks import blocks_for, bucket
    from pulseinfer_jax.kv.cache import CacheSpec
    from pulseinfer_jax.runner.dense import decode_step, decode_step_layerwise

    c = model.cfg
    per_seq = blocks_for(ctx + steps + 1, block_size)
    spec = CacheSpec(c.num_layers, batch * per_seq + 1, c.num_kv_heads, block_size, c.head_dim,
                     jnp.dtype(model.dtype))
    key = jax.random.key(ctx * 1000 + batch)
    kv = jax.jit(lambda k: jax.random.normal(k, spec.shape, spec.dtype))(key)  # synthetic KV, on device
    perm = np.random.default_rng(0).permutation(np.arange(1, spec.num_blocks))
    mb = bucket(per_seq)
    tables = np.zeros((batch, mb), np.int32)
    tables[:, :per_seq] = perm.reshape(batch, per_seq)
    tables = jnp.asarray(tables)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, c.vocab_size, batch), jnp.int32)
    if layer_loop == "layerwise":
        ids = [jnp.int32(i) for i in range(c.num_layers)]

        def step(kv, *args):
            return decode_step_layerwise(model.transformer, model.params, split, ids, kv, *args, attention=attention)
    else:
        def step(kv, *args):
            return decode_step(model.transformer, model.params, kv, *args, attention=attention)
    times = []
    for i in range(steps + 1):
        pos = jnp.full((batch,), ctx + i, jnp.int32)
        t0 = time.perf_counter()
        kv, logits = step(kv, tokens, pos, tables)
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tokens.block_until_ready()
        if i:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    kv_bytes = batch * (ctx + 1) * c.kv_bytes_per_token(jnp.dtype(model.dtype).itemsize)
    del kv
    return {"attention": attention, "layer_loop": layer_loop, "context": ctx, "batch": batch,
            "step_s_median": med, "step_s_all": times,
            "tokens_per_s": batch / med, "kv_bytes_read_per_step": kv_bytes,
            "kv_gb_per_s": kv_bytes / med / 1e9, "kv_fill": "synthetic random"}


def engine_run(model, prompt_tokens: int, batch: int, new_tokens: int) -> dict:
    from pulseinfer_jax import generate_long

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.cfg.vocab_size, prompt_tokens).tolist() for _ in range(batch)]
    kw = dict(max_new_tokens=new_tokens, ignore_eos=True, progress=False)
    generate_long(prompts, model, **kw)  # first call compiles every shape this workload meets
    t0 = time.perf_counter()
    res = generate_long(prompts, model, **kw)
    wall = time.perf_counter() - t0
    return {"prompt_tokens": prompt_tokens, "batch": batch, "new_tokens": new_tokens, "wall_s": wall,
            "prefill_s": [r.stats["prefill_s"] for r in res], "ttft_s": [r.stats["ttft_s"] for r in res],
            "tpot_s": [r.stats["tpot_s"] for r in res], "note": "second identical call (the first compiled)"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--max-kv-tokens", type=int, default=600_000, help="skip grid points above this many KV tokens")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--attention", default="jnp", help="comma list of decode attentions: jnp,pallas")
    ap.add_argument("--layer-loop", default="scan", help="comma list of scan,layerwise (runner/dense.py)")
    ap.add_argument("--engine-prompt", type=int, default=8192)
    ap.add_argument("--engine-batch", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="tiny model and sizes (CPU check of the script)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.model, args.dtype, args.contexts, args.batches = "random:tiny-llama", "float32", "256,1024", "1,4"
        args.steps, args.engine_prompt, args.engine_batch = 3, 600, 2

    from pulseinfer_jax.models.loading import load_model

    t0 = time.perf_counter()
    model = load_model(args.model, dtype=args.dtype)
    jax.block_until_ready(model.params)
    load_s = time.perf_counter() - t0
    name = "dense_decode_smoke" if args.smoke else f"dense_decode_{jax.devices()[0].platform}"
    meta = {"model": args.model, "dtype": args.dtype, "load_s": load_s}
    loops = args.layer_loop.split(",")
    split = None
    if "layerwise" in loops:
        split = jax.block_until_ready(model.layer_params)
    grid = []
    for ctx in map(int, args.contexts.split(",")):  # contexts outermost: a timeout keeps every variant of the first
        for b in map(int, args.batches.split(",")):
            if ctx * b > args.max_kv_tokens:
                continue
            for attention in args.attention.split(","):
                for loop in loops:
                    r = step_times(model, ctx, b, args.steps, 16, attention, loop, split)
                    grid.append(r)
                    print(f"{attention:6s} {loop:9s} ctx {ctx:6d} batch {b:3d}: step {r['step_s_median'] * 1e3:8.2f} "
                          f"ms, {r['tokens_per_s']:8.1f} tok/s, KV {r['kv_gb_per_s']:.1f} GB/s", flush=True)
                    write_result(name, {**meta, "grid": grid, "complete": False}, args.out)
    eng = engine_run(model, args.engine_prompt, args.engine_batch, 16)
    print(f"engine: {args.engine_batch} x {args.engine_prompt}-token prompts, wall {eng['wall_s']:.1f} s, "
          f"prefill {statistics.median(eng['prefill_s']):.2f} s/request, "
          f"TPOT {statistics.median(eng['tpot_s']) * 1e3:.1f} ms", flush=True)
    path = write_result(name, {**meta, "grid": grid, "engine": eng, "complete": True}, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
