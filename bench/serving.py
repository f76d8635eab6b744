"""Serving benchmark: concurrency (or request-rate) sweep against any OpenAI-compatible endpoint, like vLLM's
`benchmark_serving`: throughput, TTFT and TPOT percentiles per level.

    python bench/serving.py --url http://127.0.0.1:8000 --concurrency 1,4,16 --input-len 256 --output-len 64
    python bench/serving.py --launch [--model ...] [--dtype ...] [engine options: --mode auto ...]   # this server,
                                                                                                    # in-process

Requests go to `/v1/completions` as token-id prompts of `--input-len` random ids (a fixed length on any server that
takes token ids, as vLLM and SGLang do) with `max_tokens = --output-len` and `ignore_eos` (a fixed output length; a
server without that extension stops where its model does, and the row counts what came back), streamed with
`stream_options.include_usage`. `--mix mooncake` draws (input, output) pairs from bench/workload.py's Mooncake-shaped
mix instead. Each level sends `--num-requests` (default 4x the concurrency, at least 8) with at most `concurrency` in
flight, or, with `--request-rate R`, Poisson arrivals at R per second. Per level: request and output-token throughput,
TTFT (send to first token) and TPOT ((last token - first token) / (tokens - 1)) p50 / p99, failed requests; each level
after an untimed round at its concurrency (`--no-warmup` to time compiles too).
`--launch` starts this repository's server on a free port in this process (the engine's options as `pulseinfer
serve` takes them) and stops it at the end. Results: bench/results/serving_<name>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import write_result  # noqa: E402


def percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one_request(client, url: str, model: str | None, prompt: list[int], out_len: int) -> dict:
    body = {"prompt": prompt, "max_tokens": out_len, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "temperature": 0}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "status": r.status_code, "error": (await r.aread()).decode()[:200]}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return {"ok": False, "status": 200, "error": data["error"].get("message", "")[:200]}
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
                choice = (data.get("choices") or [{}])[0]
                if choice.get("text") or (choice and choice.get("finish_reason") is None):  # a token's event
                    now = time.perf_counter()
                    first = first or now
                    last = now
    except Exception as e:  # noqa: BLE001 - a failed request is a row, not the end of the sweep
        return {"ok": False, "status": None, "error": f"{type(e).__name__}: {e}"[:200]}
    end = time.perf_counter()
    ttft = (first - t0) if first else None
    tpot = (last - first) / (tokens - 1) if first and tokens > 1 else None
    return {"ok": True, "ttft": ttft, "tpot": tpot, "tokens": tokens, "latency": end - t0}


async def run_level(url: str, model: str | None, pairs: list[tuple[int, int]], vocab: int, *, concurrency: int,
                    rate: float | None, seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(n_in)] for n_in, _ in pairs]
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:

        async def go(i: int) -> dict:
            async with sem:
                return await one_request(client, url, model, prompts[i], pairs[i][1])

        t0 = time.perf_counter()
        tasks = []
        for i in range(len(pairs)):
            tasks.append(asyncio.create_task(go(i)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        rows = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ok = [r for r in rows if r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    out_tokens = sum(r["tokens"] for r in ok)
    return {"concurrency": concurrency, "request_rate": rate, "requests": len(rows), "completed": len(ok),
            "failed": len(rows) - len(ok), "errors": sorted({r["error"] for r in rows if not r["ok"]})[:5],
            "duration_s": wall, "request_throughput": len(ok) / wall, "output_tokens": out_tokens,
            "output_throughput": out_tokens / wall,
            "input_tokens": sum(n for (n, _), r in zip(pairs, rows, strict=True) if r["ok"]),
            "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
            "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else None,
            "tpot_mean_s": statistics.fmean(tpot) if tpot else None}


def workload(args, n: int, seed: int) -> list[tuple[int, int]]:
    if args.mix == "fixed":
        return [(args.input_len, args.output_len)] * n
    from bench.workload import mooncake_mix

    return mooncake_mix(n, seed=seed, scale=args.mix_scale, max_prompt=args.input_len, max_output=args.output_len)[0]


def launch(args, rest: list[str]):
    """This repository's server on a free port of this process: (ServerThread, model name, vocabulary size)."""
    from pulseinfer_jax.cli import _add_engine_args, engine_config
    from pulseinfer_jax.console import load_for
    from pulseinfer_jax.engine.core import Engine
    from pulseinfer_jax.serving.app import ServerThread
    from pulseinfer_jax.serving.engine_loop import EngineLoop

    ep = argparse.ArgumentParser(prog="serving.py --launch")
    _add_engine_args(ep)
    eargs = ep.parse_args(rest)
    config = engine_config(eargs, progress=False)
    engine = Engine(load_for(config, args.model, args.dtype), config)
    srv = ServerThread(EngineLoop(engine, max_queue=4096), "served").start()
    print(f"serving.py: launched {engine.model.source} ({config.mode}) at {srv.url}", flush=True)
    return srv, "served", engine.model.cfg.vocab_size, {"model": engine.model.source, "engine": rest}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="an OpenAI-compatible server (default: --launch)")
    ap.add_argument("--served-model", default=None, help="the 'model' field to send (default: none)")
    ap.add_argument("--vocab", type=int, default=32000, help="token ids are drawn below this (--url)")
    ap.add_argument("--launch", action="store_true", help="start this repository's server in-process")
    ap.add_argument("--model", default=None, help="--launch: the model (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--concurrency", default="1,4,16", help="comma list of levels")
    ap.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (else closed loop)")
    ap.add_argument("--num-requests", type=int, default=None, help="per level (default: 4x the concurrency, >= 8)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--mix", choices=("fixed", "mooncake"), default="fixed")
    ap.add_argument("--mix-scale", type=float, default=1.0, help="--mix mooncake: prompt length factor")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="before each level, one untimed round at its concurrency (compiles its batch sizes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="cpu")
    ap.add_argument("--out", default=None)
    args, rest = ap.parse_known_args(argv)
    if rest and not args.launch:
        ap.error(f"unknown arguments {rest} (engine options go with --launch)")
    srv, info = None, {}
    if args.url is None or args.launch:
        srv, model, vocab, info = launch(args, rest)
        url = srv.url
    else:
        url, model, vocab = args.url.rstrip("/"), args.served_model, args.vocab
    levels = []
    try:
        for c in (int(x) for x in args.concurrency.split(",")):
            if args.warmup:  # the level's batch sizes compiled before it is timed
                asyncio.run(run_level(url, model, workload(args, c, args.seed + 99), vocab, concurrency=c, rate=None,
                                      seed=args.seed + 99))
            n = args.num_requests or max(8, 4 * c)
            row = asyncio.run(run_level(url, model, workload(args, n, args.seed + c), vocab, concurrency=c,
                                        rate=args.request_rate, seed=args.seed + c))
            levels.append(row)
            fmt = (lambda v: "-" if v is None else f"{v * 1e3:.0f} ms")  # noqa: E731
            print(f"concurrency {c:3d}: {row['completed']}/{row['requests']} ok, {row['output_throughput']:.1f} "
                  f"tok/s, {row['request_throughput']:.2f} req/s, TTFT p50 {fmt(row['ttft_p50_s'])} p99 "
                  f"{fmt(row['ttft_p99_s'])}, TPOT p50 {fmt(row['tpot_p50_s'])} p99 {fmt(row['tpot_p99_s'])}",
                  flush=True)
    finally:
        if srv is not None:
            srv.stop()
    path = write_result(f"serving_{args.name}", {
        "url": None if args.launch or args.url is None else url, **info, "input_len": args.input_len,
        "output_len": args.output_len, "mix": args.mix, "request_rate": args.request_rate, "levels": levels},
        args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
