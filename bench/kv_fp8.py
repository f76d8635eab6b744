"""float8 KV on a real model's keys and values: which scale granularity keeps attention (pulseinfer_jax/kv/quant.py).

Runs the model over a real text (the accuracy bench's: GPL-3 or CPython's NEWS), and at every layer quantises that
layer's K and V to float8 e4m3 with per-(token, head) scales (float32, or powers of two: the cache's stored format,
`kv_dtype="float8_e4m3fn"`) and per-(block, head) scales, then compares, for the last
`--queries` positions' real queries, the attention with the dequantised K / V against the exact one: relative error of
K, V and the attention output, and the KL divergence of the attention weights. Bytes per KV element with the scales.

    python -m bench.kv_fp8 --tokens 2048 --name kv_fp8_cpu
    python -m bench.kv_fp8 --tokens 2048 --hadamard --name kv_fp8_cpu_hadamard

`--hadamard` first rotates every head's q, k and v by the orthonormal Hadamard matrix of head_dim (q.k is unchanged; a
head's outlier channels spread over all of them), as the engine's float8 cache stores them (`kv_quant.rotate`).
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from bench.accuracy import TEXTS
from bench.common import write_result

# scales per (token, head): float32, a one-byte code (power of two, or float8_e5m2), bfloat16 (the engine's float8
# cache, kv_dtype="float8_e4m3fn"); per (block, head): float32
GRANULARITIES = ("token", "token-pow2", "token-e5m2", "token-bf16", "block")


@jax.jit(static_argnames=("block_size", "granularity", "queries"))
def layer_errors(q, k, v, *, block_size: int, granularity: str, queries: int) -> dict:
    """Errors of one layer's attention for its last `queries` queries with K / V quantised (q [t, Hq, hd], k / v
    [t, Hkv, hd], t a multiple of block_size)."""
    from pulseinfer_jax.kv.quant import dequantize, quantize

    t, hkv, hd = k.shape
    g = q.shape[1] // hkv

    def through_fp8(a):
        g, _, code = granularity.partition("-")
        qa, s = quantize(a.reshape(t // block_size, block_size, hkv, hd), g, code=code or None)
        return dequantize(qa, s).reshape(t, hkv, hd)

    k8, v8 = through_fp8(k), through_fp8(v)
    qq = q[-queries:].reshape(queries, hkv, g, hd)
    pos = jnp.arange(t - queries, t)
    causal = jnp.arange(t)[None, :] <= pos[:, None]  # [Q, t]
    hi = jax.lax.Precision.HIGHEST

    def attend(kk, vv):
        s = jnp.einsum("qhgd,thd->qhgt", qq, kk, precision=hi) * hd ** -0.5
        s = jnp.where(causal[:, None, None], s, -jnp.inf)
        logp = jax.nn.log_softmax(s, axis=-1)
        return logp, jnp.einsum("qhgt,thd->qhgd", jnp.exp(logp), vv, precision=hi)

    logp, o = attend(k, v)
    logp8, o8 = attend(k8, v8)
    p = jnp.exp(logp)
    kl = jnp.sum(jnp.where(p > 0, p * (logp - logp8), 0.0), axis=-1)  # [Q, Hkv, g]

    def rel(a, b):
        return jnp.linalg.norm(a - b) / jnp.linalg.norm(b)

    return {"k_rel_err": rel(k8, k), "v_rel_err": rel(v8, v), "out_rel_err": rel(o8, o), "kl_mean": jnp.mean(kl),
            "kl_max": jnp.max(kl)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--text", default=None)
    ap.add_argument("--tokens", type=int, default=2048, help="context length (a multiple of --block-size)")
    ap.add_argument("--queries", type=int, default=64, help="last positions whose attention is compared")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--hadamard", action="store_true", help="rotate q, k, v by a Hadamard matrix before quantising")
    ap.add_argument("--name", default="kv_fp8_cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.tokens % a.block_size:
        raise SystemExit(f"--tokens {a.tokens} must be a multiple of --block-size {a.block_size}")

    from pulseinfer_jax.models.loading import load_model
    from pulseinfer_jax.models.rope import rope_tables
    from pulseinfer_jax.models.transformer import split_layers

    from pulseinfer_jax.kv import quant as kv_quant
    from pulseinfer_jax.kv.quant import block_rows

    model = load_model(a.model)
    text_path = pathlib.Path(a.text) if a.text else next((p for p in TEXTS if p.is_file()), None)
    if text_path is None or model.tokenizer is None:
        raise SystemExit("needs a model with a tokenizer and a text (--text)")
    ids = model.tokenizer.encode(text_path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=True)
    ids = (ids * (a.tokens // len(ids) + 1))[: a.tokens]
    tr, params = model.transformer, model.params
    tokens = jnp.asarray(ids, jnp.int32)[None]
    cos, sin = rope_tables(model.cfg, jnp.arange(a.tokens, dtype=jnp.int32)[None])
    qkv = jax.jit(tr.layer_qkv)
    finish = jax.jit(lambda lp, x, q, k, v: tr.layer_finish(lp, x, tr.causal_attention(q, k, v)))
    x = tr.embed(params, tokens)
    per_layer: dict[str, list[dict]] = {g: [] for g in GRANULARITIES}
    rot = kv_quant.rotate if a.hadamard else (lambda x: x.astype(jnp.float32))
    for i, lp in enumerate(split_layers(params)):
        q, k, v = qkv(lp, x, cos, sin)
        for g in GRANULARITIES:
            errs = layer_errors(rot(q[0]), rot(k[0]), rot(v[0]), block_size=a.block_size, granularity=g,
                                queries=a.queries)
            per_layer[g].append({"layer": i, **{n: float(e) for n, e in errs.items()}})
        x = finish(lp, x, q, k, v)
        print(f"layer {i}: " + "  ".join(f"{g} out {per_layer[g][-1]['out_rel_err']:.2e} "
                                         f"kl {per_layer[g][-1]['kl_mean']:.2e}" for g in GRANULARITIES), flush=True)
    c = model.cfg
    summary = {}
    for g in GRANULARITIES:
        rows = per_layer[g]
        # scale bytes per element: float32 scales, one-byte codes, bfloat16 scales; the cache's bfloat16 scales as
        # stored: whole scale rows per block (kv_quant.block_rows)
        bs = a.block_size
        cache = block_rows(bs, c.head_dim, "float8_e4m3fn") / bs - 1
        scales_per_elt = {"token": 4 / c.head_dim, "token-pow2": 1 / c.head_dim, "token-e5m2": 1 / c.head_dim,
                          "token-bf16": cache, "block": 4 / (c.head_dim * bs)}[g]
        summary[g] = {**{f"{n}_mean": float(np.mean([r[n] for r in rows])) for n in rows[0] if n != "layer"},
                      **{f"{n}_worst_layer": float(np.max([r[n] for r in rows])) for n in rows[0] if n != "layer"},
                      "bytes_per_kv_element": 1 + scales_per_elt}
        print(g, summary[g])
    write_result(a.name, {"model": model.source, "text": str(text_path), "tokens": a.tokens, "queries": a.queries,
                          "hadamard": a.hadamard,
                          "block_size": a.block_size, "bf16_bytes_per_kv_element": 2, "summary": summary,
                          "per_layer": per_layer}, pathlib.Path(a.out) if a.out else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
