"""Load check of the server: a few hundred requests from concurrent clients, some cancelled mid-stream, some malformed.

    python bench/serving_load.py [--requests 240] [--clients 16] [--gpu-kv-budget 120000000]

Starts `pulseinfer serve`'s server in this process (the embedded SmolLM2, mode auto with a host pool, a GPU KV
budget small enough that requests queue), then sends `--requests` requests from `--clients` threads: token-id
prompts of 16-400 random tokens, 4-32 new tokens with `ignore_eos`, half streamed, a quarter placed offloaded (the
`mode` extension: sparse decode over the host pool, `--budget-tokens` attended per layer) and the rest dense; a fifth
are streams the client closes after its first chunks; one in twelve is malformed (bad JSON, max_tokens 0, n = 2, an
unknown field, an empty prompt). Checks: every valid request completes with the text `generate_long` gives for its
prompt in its mode (greedy, batched runs of the same model and settings), every malformed one gets a 4xx with an
OpenAI error body, nothing gets a 5xx, and when the load is over every GPU block and host row is free again
(`Engine.check_drained`). Writes bench/results/serving_load_cpu.json (`--name`).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import pathlib
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.common import write_result  # noqa: E402

MALFORMED = [b"{not json", {"max_tokens": 0}, {"n": 2}, {"frobnicate": True}, {"prompt": ""}]


def plan(n: int, vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 12 == 11:
            bad = MALFORMED[(i // 12) % len(MALFORMED)]
            out.append({"kind": "bad", "body": bad})
            continue
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(16, 400))]
        body = {"prompt": prompt, "max_tokens": rng.randint(4, 32), "ignore_eos": True, "temperature": 0,
                "mode": "offload" if rng.random() < 0.25 else "dense"}
        if i % 5 == 2:
            out.append({"kind": "cancel", "body": {**body, "max_tokens": 64, "stream": True},
                        "after": rng.randint(1, 3)})
        else:
            out.append({"kind": "valid", "body": {**body, "stream": bool(rng.random() < 0.5)}})
    return out


def send(url: str, item: dict) -> dict:
    import httpx

    kind, body = item["kind"], item["body"]
    if kind == "bad":
        if isinstance(body, dict):
            body = {"prompt": [5, 6, 7], "max_tokens": 4, **body}
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(f"{url}/v1/completions", content=data, headers={"Content-Type": "application/json"},
                       timeout=600)
        ok = 400 <= r.status_code < 500 and set(r.json().get("error", {})) == {"message", "type", "param", "code"}
        return {"kind": kind, "status": r.status_code, "ok": ok}
    if not body.get("stream"):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
        return {"kind": kind, "status": r.status_code, "text": text}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        parts, chunks = [], 0
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                return {"kind": kind, "status": 500, "error": data["error"]}
            chunks += 1
            parts.append(data["choices"][0]["text"] if data.get("choices") else "")
            if kind == "cancel" and chunks >= item["after"]:
                return {"kind": kind, "status": r.status_code, "cancelled_after": chunks}
        return {"kind": kind, "status": r.status_code, "text": "".join(parts)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=240)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--gpu-kv-budget", type=int, default=120_000_000)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--budget-tokens", type=int, default=128, help="tokens an offloaded request attends per layer")
    ap.add_argument("--host-kv-tokens", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from pulseinfer_jax import Engine, EngineConfig, generate_long, load_model
    from pulseinfer_jax.serving.app import ServerThread
    from pulseinfer_jax.serving.engine_loop import EngineLoop

    model = load_model(None)
    sparse = {"budget_tokens": args.budget_tokens, "window_tokens": 32}
    config = EngineConfig.of(mode="auto", gpu_kv_budget=args.gpu_kv_budget, max_batch=args.max_batch,
                             host_kv_tokens=args.host_kv_tokens, progress=False, **sparse)
    engine = Engine(model, config)
    items = plan(args.requests, model.cfg.vocab_size, args.seed)
    t0 = time.perf_counter()
    with ServerThread(EngineLoop(engine, max_queue=4096), "smollm2") as srv:
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            results = list(pool.map(lambda it: send(srv.url, it), items))
        wall = time.perf_counter() - t0
        deadline = time.perf_counter() + 120
        while (engine.busy or srv.loop.queued) and time.perf_counter() < deadline:
            time.sleep(0.1)
        blocks_in_use = engine.allocator.num_used
        rows_in_use = engine.host_pool.allocator.capacity - engine.host_pool.allocator.num_free
        engine.check_drained()
        steps = srv.loop.steps
        preempted = {"swap": engine.scheduler.preempted_swap, "recompute": engine.scheduler.preempted_recompute}
    valid = [(it, r) for it, r in zip(items, results, strict=True) if it["kind"] == "valid"]
    t1 = time.perf_counter()
    # one pool size for every group (a pool resized per run would recompile every step function)
    ref = {"dense": Engine(model, EngineConfig.of(max_batch=32, kv_cache_tokens=32 * 448, progress=False)),
           "offload": Engine(model, EngineConfig.of(mode="offload", max_batch=32, kv_cache_tokens=32 * 448,
                                                    host_kv_tokens=32 * 448, progress=False, **sparse))}
    want: dict[int, str] = {}
    for mode, k in sorted({(it["body"]["mode"], it["body"]["max_tokens"]) for it, _ in valid}):
        # one batched run per placement and output length
        group = [i for i, (it, _) in enumerate(valid) if (it["body"]["mode"], it["body"]["max_tokens"]) == (mode, k)]
        out = generate_long([valid[i][0]["body"]["prompt"] for i in group], ref[mode], max_new_tokens=k,
                            ignore_eos=True)
        want.update({i: r.text for i, r in zip(group, out, strict=True)})
    ref_s = time.perf_counter() - t1
    mismatched = [i for i, (_, r) in enumerate(valid) if r.get("text") != want[i]]
    statuses = collections.Counter(r["status"] for r in results)
    by_kind = {k: sum(1 for it in items if it["kind"] == k) for k in ("valid", "cancel", "bad")}
    bad_ok = sum(1 for it, r in zip(items, results, strict=True) if it["kind"] == "bad" and r.get("ok"))
    row = {"requests": len(items), "clients": args.clients, "by_kind": by_kind, "wall_s": wall, "engine_steps": steps,
           "statuses": {str(k): v for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))},
           "server_errors": sum(v for k, v in statuses.items() if k is None or k >= 500),
           "valid_matching_generate_long": len(valid) - len(mismatched), "valid": len(valid),
           "valid_offloaded": sum(1 for it, _ in valid if it["body"]["mode"] == "offload"),
           "mismatched_offloaded": sum(1 for i in mismatched if valid[i][0]["body"]["mode"] == "offload"),
           "malformed_with_4xx_error_body": bad_ok, "gpu_blocks_in_use_at_end": blocks_in_use,
           "host_rows_in_use_at_end": rows_in_use, "preemptions": preempted, "budget_tokens": args.budget_tokens,
           "reference_s": ref_s, "gpu_kv_budget": args.gpu_kv_budget, "max_batch": args.max_batch}
    print(json.dumps(row, indent=1))
    path = write_result(f"serving_load_{args.name}", row, args.out)
    print(f"wrote {path}")
    if mismatched or row["server_errors"] or bad_ok != by_kind["bad"] or blocks_in_use or rows_in_use:
        sys.exit(1)


if __name__ == "__main__":
    main()
