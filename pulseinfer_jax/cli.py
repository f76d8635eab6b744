"""`pulseinfer` command line: generate, demo, info. Bad input prints one line and exits 2."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from models.config import UnsupportedModelError
from models.weights import CheckpointError

USER_ERRORS = (ValueError, FileNotFoundError, UnsupportedModelError, CheckpointError, OSError)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF directory, .gguf file or random:<preset>; default: embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    p.add_argument("--stats", action="store_true",
                   help="print per-request stats as JSON to stderr (timings, placement, recall counters)")
    o = p.add_argument_group("KV offloading")
    o.add_argument("--mode", default="dense", help="dense | offload | auto (IOAA decides per request); default dense")
    o.add_argument("--budget-tokens", type=int, default=2048, help="tokens attended per sparse layer (default 2048)")
    o.add_argument("--selection", default="solohead", help="solohead | headwise (default solohead)")
    o.add_argument("--io", default="coalesced", help="coalesced | fragmented (default coalesced)")
    o.add_argument("--recall", default="interruptible", help="interruptible | eager | sync (default interruptible)")
    o.add_argument("--gpu-kv-budget", type=int, default=None, help="cap on GPU KV bytes (emulates a smaller GPU)")
    o.add_argument("--host-kv-tokens", type=int, default=None, help="pinned host pool size in tokens")
    o.add_argument("--dense-layers", type=int, default=2, help="first layers that attend densely (default 2)")
    o.add_argument("--score-beta", type=float, default=None,
                   help="block scores' key-range weight: 1 = Quest's bound, 0 = block midpoint (default: the engine's)")
    o.add_argument("--score-per-kv-head", action="store_true",
                   help="SoloHead scores per KV head (group-summed bounds) instead of per query head")
    o.add_argument("--score-sub-blocks", type=int, default=1,
                   help="key bounds per 1/m of a block (m x the metadata bytes; finer selection); default 1")
    o.add_argument("--score-kept-blocks", action=argparse.BooleanOptionalAction, default=True,
                   help="SoloHead also scores the sink and window blocks so their attention share is counted "
                        "(default on; --no-score-kept-blocks scores the middle blocks only)")
    o.add_argument("--resident-bonus", type=float, default=None,
                   help="SoloHead favours blocks already on the GPU: a block must hold (1 + bonus) x a resident "
                        "one's estimated attention to be recalled in its place (fewer recalls; default: the engine's)")
    o.add_argument("--score-bounds-dtype", default=None,
                   help="how the key bounds are stored on the GPU: float8_e4m3fn (rounded outward, half of bf16's "
                        "bytes) | kv (the KV dtype, exact); default: the engine's")
    o.add_argument("--score-coarse-group", type=int, default=1,
                   help="two-level scoring: score groups of this many blocks first, then only the best groups' blocks "
                        "(less metadata read per step at long contexts); default 1 = off")
    o.add_argument("--score-coarse-keep", type=float, default=None,
                   help="groups two-level scoring keeps, in middle budgets' worth of blocks (default: the engine's)")
    o.add_argument("--host-io", default="auto",
                   help="auto | xla (pinned host pool) | numpy (pageable, the fallback); default auto")
    o.add_argument("--moe-strategy", default="auto",
                   help="mixture-of-experts layers: auto | dense | gather | grouped | grouped-pallas (GPU kernel); "
                        "default auto (grouped on CPU, dense/gather by token count on a GPU)")


def engine_config(args: argparse.Namespace, **extra):
    """EngineConfig from the shared CLI options (ValueError on bad values, reported as one line)."""
    from pulseinfer_jax.config import EngineConfig

    return EngineConfig(block_size=args.block_size, mode=args.mode, budget_tokens=args.budget_tokens,
                        selection=args.selection, io=args.io, recall=args.recall, gpu_kv_budget=args.gpu_kv_budget,
                        host_kv_tokens=args.host_kv_tokens, dense_layers=args.dense_layers, host_io=args.host_io,
                        moe_strategy=args.moe_strategy,
                        score_per_query_head=not args.score_per_kv_head, score_sub_blocks=args.score_sub_blocks,
                        score_kept_blocks=args.score_kept_blocks, score_coarse_group=args.score_coarse_group,
                        **({} if args.score_coarse_keep is None else {"score_coarse_keep": args.score_coarse_keep}),
                        **({} if args.score_beta is None else {"score_beta": args.score_beta}),
                        **({} if args.resident_bonus is None else {"resident_bonus": args.resident_bonus}),
                        **({} if args.score_bounds_dtype is None else {"score_bounds_dtype": args.score_bounds_dtype}),
                        **extra)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pulseinfer", description="PulseInfer-JAX long-context decoding engine")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate a continuation of a prompt")
    g.add_argument("prompt", nargs="?", help="prompt text; '-' or omitted reads stdin")
    g.add_argument("--file", help="read the prompt from this file")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the chat template (default: on when the model has one)")
    g.add_argument("--no-stream", action="store_true", help="print the text only when done")
    _add_model_args(g)
    _add_sampling_args(g)

    d = sub.add_parser("demo", help="long-context demo: find a passkey hidden in a ~2K-token document")
    d.add_argument("--tokens", type=int, default=2000, help="approximate document length in tokens")
    d.add_argument("--depth", type=float, default=0.5, help="where the passkey sits, 0..1")
    _add_model_args(d)
    _add_sampling_args(d)

    i = sub.add_parser("info", help="model config, parameter count and KV bytes per token")
    i.add_argument("model", nargs="?", default=None, help="HF directory, .gguf file, random:<preset>; default SmolLM2")
    i.add_argument("--dtype", default="float32")
    return ap


def _read_prompt(args: argparse.Namespace) -> str:
    if args.file:
        with open(args.file, encoding="utf-8") as f:
            return f.read()
    if args.prompt is not None and args.prompt != "-":
        return args.prompt
    if sys.stdin is None or (args.prompt is None and sys.stdin.isatty()):
        raise ValueError("no prompt: pass it as an argument, with --file, or on stdin")
    return sys.stdin.read()


def _print_stats(results) -> None:
    for k, r in enumerate(results):
        print(json.dumps({"prompt": k, "finish_reason": r.finish_reason, **r.stats}), file=sys.stderr)


def _generate(args: argparse.Namespace) -> int:
    import jax

    from models.loading import load_model
    from pulseinfer_jax.api import generate_long
    from pulseinfer_jax.config import weights_layout
    from pulseinfer_jax.engine import Engine

    config = engine_config(args, progress=True)
    prompt = _read_prompt(args)
    if not prompt.strip():
        raise ValueError("the prompt is empty; give some text")
    model = load_model(args.model, dtype=args.dtype,
                       layout=weights_layout(config.layer_loop, jax.devices()[0].platform))
    chat = args.chat
    if chat is None:
        chat = bool(model.tokenizer and model.tokenizer.has_chat_template)
    engine = Engine(model, config)

    def on_token(ev) -> None:
        if not args.no_stream:
            sys.stdout.write(ev.text)
            sys.stdout.flush()

    results = generate_long([prompt], engine, on_token=on_token, **_sampling_kwargs(args), chat=chat,
                            engine_config=engine.config)
    if args.no_stream:
        sys.stdout.write(results[0].text)
    sys.stdout.write("\n")
    if args.stats:
        _print_stats(results)
    return 0


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, seed=args.seed, stop=tuple(args.stop))


def _demo(args: argparse.Namespace) -> int:
    from pulseinfer_jax.demo import run_demo

    ok = run_demo(model=args.model, dtype=args.dtype, tokens=args.tokens, depth=args.depth, seed=args.seed,
                  config=engine_config(args, progress=True), stats=args.stats)
    return 0 if ok else 1


def _info(args: argparse.Namespace) -> int:
    import dataclasses

    import jax.numpy as jnp

    from models.loading import describe_model
    from models.transformer import resolve_dtype

    itemsize = jnp.dtype(resolve_dtype(args.dtype)).itemsize
    c, tok, source = describe_model(args.model)
    info = {
        "source": source,
        "config": dataclasses.asdict(c),
        "parameters": c.num_parameters(),
        "active_parameters_per_token": c.num_parameters(active=True),
        "dtype": args.dtype,
        "weight_bytes": c.num_parameters() * itemsize,
        "kv_bytes_per_token": c.kv_bytes_per_token(itemsize),
        "kv_bytes_per_16_token_block_per_layer": 2 * 16 * c.kv_dim * itemsize,
        "tokenizer": None if tok is None else {"vocab_size": tok.vocab_size, "eos_token_ids": list(tok.eos_token_ids),
                                               "chat_template": tok.has_chat_template},
    }
    print(json.dumps(info, indent=2, default=str))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"generate": _generate, "demo": _demo, "info": _info}[args.cmd](args)
    except USER_ERRORS as e:
        print(f"pulseinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pulseinfer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
