"""`pulseinfer` command line: generate, demo, serve, info. Bad input prints one line and exits 2."""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import typing
from collections.abc import Sequence

from pulseinfer_jax.console import load_for, say
from pulseinfer_jax.models.config import UnsupportedModelError
from pulseinfer_jax.models.weights import CheckpointError

USER_ERRORS = (ValueError, FileNotFoundError, UnsupportedModelError, CheckpointError, OSError)


class _Parser(argparse.ArgumentParser):
    """Bad options are user errors like any other: one line, exit status 2 (`main` adds the `pulseinfer: error:`
    prefix; the message names the command's --help)."""

    def error(self, message: str):
        raise ValueError(f"{message} (see {self.prog} --help)")

    def parse_args(self, args=None, namespace=None):
        """argparse's, with an unrecognized option answered by the subcommand's option it most likely meant."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            # the options first: a word after an unknown option was its value or the prompt, argparse cannot tell
            extras = [a for a in extras if a[:1] == "-"] or extras
            sub = self._subcommand(ns)
            known = [s for a in sub._actions for s in a.option_strings if s.startswith("--")]
            guesses = {a: difflib.get_close_matches(a.partition("=")[0], known, n=1) for a in extras if a[:1] == "-"}
            guesses = {a: g[0] for a, g in guesses.items() if g}
            message = f"unrecognized argument{'s' if len(extras) > 1 else ''} {', '.join(extras)}"
            if len(guesses) == 1 and len(extras) == 1:
                message += f"; did you mean {next(iter(guesses.values()))}?"
            elif guesses:
                message += "; did you mean " + ", ".join(f"{g} (for {a})" for a, g in guesses.items()) + "?"
            sub.error(message)
        return ns

    def _subcommand(self, ns: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the subcommand `ns` ran (this one if none)."""
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction) and getattr(ns, a.dest, None) in a.choices:
                return a.choices[getattr(ns, a.dest)]
        return self


def _port(text: str) -> int:
    """--port: a TCP port number, 1-65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number; give one in 1-65535") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside 1-65535, the TCP port numbers")
    return port


SECTIONS = {(): "engine", ("offload",): "KV offloading", ("offload", "scoring"): "KV offloading: block scoring",
            ("offload", "ablation"): "KV offloading: ablations (baselines)", ("backends",): "backends"}


def _add_model_args(p: argparse.ArgumentParser, stats: bool = True) -> None:
    p.add_argument("--model", default=None,
                   help="HF directory, .gguf file or random:<preset> (random weights, no tokenizer: token ids only); "
                        "default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="weights dtype, and the KV cache's unless --kv-dtype (default: %(default)s; use bfloat16 on a "
                        "GPU)")
    h = p.add_argument_group("several hosts (jax.distributed; every process runs the same command)")
    h.add_argument("--coordinator", default=None, help="host:port of process 0's coordination service")
    h.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    h.add_argument("--process-id", type=int, default=None, help="this process's index, 0 .. num-processes - 1")
    if stats:
        p.add_argument("--stats", action="store_true",
                       help="print per-request stats as JSON to stderr (timings, placement, backends, recall counters)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("sampling")
    s.add_argument("--max-new-tokens", type=int, default=128, help="default: %(default)s")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0, help="default: %(default)s")
    s.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    s.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _value_type(tp):
    """argparse type of a config field's annotation (int, float or str; Optional unwrapped)."""
    for t in (int, float):
        if tp is t or t in typing.get_args(tp):
            return t
    return str


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """One option per CLI-visible EngineConfig setting, from the field's flat name, help and default."""
    from pulseinfer_jax.config import EngineConfig
    from pulseinfer_jax.options import leaves

    groups: dict[tuple, argparse._ArgumentGroup] = {}
    for leaf in leaves(EngineConfig):
        if not leaf.field.metadata.get("cli", True):
            continue
        section = leaf.path[:-1]
        g = groups.get(section) or groups.setdefault(section, p.add_argument_group(SECTIONS[section]))
        flag, default = "--" + leaf.flat.replace("_", "-"), leaf.field.default
        text = leaf.help.replace("%", "%%")  # (argparse formats help with %)
        suffix = "" if default is None else f" (default: {default})"  # (a None default's help says what it means)
        if leaf.type is bool:
            g.add_argument(flag, dest=leaf.flat, action=argparse.BooleanOptionalAction, default=None,
                           help=f"{text} (default: {'on' if default else 'off'})")
        elif leaf.choices is not None:
            g.add_argument(flag, dest=leaf.flat, choices=leaf.choices, default=None,
                           help=text + suffix)
        else:
            g.add_argument(flag, dest=leaf.flat, type=_value_type(leaf.type), default=None,
                           help=text + suffix)


def engine_config(args: argparse.Namespace, **extra):
    """EngineConfig from the engine options given on the command line (ValueError on bad values, one line)."""
    from pulseinfer_jax.config import EngineConfig
    from pulseinfer_jax.options import leaves

    given = {leaf.flat: getattr(args, leaf.flat) for leaf in leaves(EngineConfig)
             if getattr(args, leaf.flat, None) is not None}
    return EngineConfig.of(**given, **extra)


def build_parser() -> argparse.ArgumentParser:
    from pulseinfer_jax import __version__

    ap = _Parser(prog="pulseinfer", description="PulseInfer-JAX long-context decoding engine")
    ap.add_argument("--version", action="version", version=f"pulseinfer-jax {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate a continuation of a prompt")
    g.add_argument("prompt", nargs="?", help="prompt text; '-' or omitted reads stdin")
    g.add_argument("--file", help="read the prompt from this file")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the chat template (default: on when the model has one)")
    g.add_argument("--no-stream", action="store_true", help="print the text only when done")
    _add_model_args(g)
    _add_sampling_args(g)
    _add_engine_args(g)

    d = sub.add_parser("demo", help="long-context demo: find a passkey hidden in a ~2K-token document")
    d.add_argument("--tokens", type=int, default=2000, help="approximate document length in tokens")
    d.add_argument("--depth", type=float, default=0.5, help="where the passkey sits, 0..1")
    d.add_argument("--seed", type=int, default=0, help="picks the passkey (decoding is greedy); default 0")
    _add_model_args(d)
    _add_engine_args(d)

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    v.add_argument("--port", type=_port, default=8000, help="TCP port to listen on, 1-65535 (default: %(default)s)")
    v.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting for admission before new ones get HTTP 429 (default: %(default)s)")
    v.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: the model's file or directory name)")
    v.add_argument("--seed", type=int, default=0, help="random stream of requests that give no seed (default 0)")
    v.add_argument("--shutdown-grace", type=float, default=5.0, metavar="SECONDS",
                   help="on SIGINT / SIGTERM, new requests get 503 and running ones have this long to finish before "
                        "they end with finish_reason abort (default: %(default)s; a second Ctrl-C ends them at once)")
    _add_model_args(v, stats=False)
    _add_engine_args(v)

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
    from pulseinfer_jax.api import generate_long

    options = generate_options(args)  # the sampling flags, then the engine's, before the prompt or the model
    config = engine_config(args, progress=True)
    prompt = _read_prompt(args)
    if not prompt.strip():
        raise ValueError("the prompt is empty; give some text")
    model = load_for(config, args.model, args.dtype)
    if model.tokenizer is None:
        raise ValueError(f"{model.source} has no tokenizer (random:<preset> models carry random weights for "
                         "throughput and compile checks: bench/, `pulseinfer info`); generate needs a real model")

    def on_token(ev) -> None:
        if not args.no_stream:
            sys.stdout.write(ev.text)
            sys.stdout.flush()

    # the model, not an engine: generate_long builds one for this prompt (a budget past its context is cut to it)
    results = generate_long([prompt], model, options=options, engine_config=config, on_token=on_token)
    if args.no_stream:
        sys.stdout.write(results[0].text)
    sys.stdout.write("\n")
    if args.stats:
        _print_stats(results)
    return 0


SAMPLING_FLAGS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")


def generate_options(args: argparse.Namespace):
    """GenerateOptions from the sampling flags; a bad value is an error naming its flag (exit 2, like argparse's)."""
    from pulseinfer_jax.api import GenerateOptions

    try:
        return GenerateOptions(chat=args.chat, stop=tuple(args.stop),
                               **{f: getattr(args, f) for f in SAMPLING_FLAGS if f != "stop"})
    except ValueError as e:
        flag = next((f for f in SAMPLING_FLAGS if str(e).startswith(f + "=")), None)
        if flag is None:
            raise
        raise ValueError(f"argument --{flag.replace('_', '-')}: {e} (see pulseinfer generate --help)") from None


def _demo(args: argparse.Namespace) -> int:
    from pulseinfer_jax.demo import run_demo

    ok = run_demo(model=args.model, dtype=args.dtype, tokens=args.tokens, depth=args.depth, seed=args.seed,
                  config=engine_config(args, progress=True), stats=args.stats)
    return 0 if ok else 1


def _serve(args: argparse.Namespace) -> int:

    from pulseinfer_jax.engine.core import Engine

    try:
        from pulseinfer_jax.serving.app import default_model_name, serve
        from pulseinfer_jax.serving.engine_loop import EngineLoop
    except ImportError as e:
        raise ValueError(f"the server needs its extra: pip install 'pulseinfer-jax[serve]' ({e})") from None
    if not args.shutdown_grace >= 0:
        raise ValueError(f"--shutdown-grace {args.shutdown_grace} must be >= 0 seconds")
    config = engine_config(args, progress=False)
    engine = Engine(load_for(config, args.model, args.dtype), config)
    if engine.model.tokenizer is None:
        raise ValueError(f"{engine.model.source} has no tokenizer (random:<preset> models are for throughput and "
                         "compile checks); serve a real model")
    loop = EngineLoop(engine, max_queue=args.max_queue, seed=args.seed)
    name = args.served_model_name or default_model_name(loop)
    say(f"serving {name} on http://{args.host}:{args.port}/v1 (mode {config.mode}; GET /health, /metrics)")
    serve(loop, name, host=args.host, port=args.port, shutdown_grace=args.shutdown_grace)
    return 0


def _info(args: argparse.Namespace) -> int:
    import dataclasses

    import jax.numpy as jnp

    from pulseinfer_jax.kv.quant import STORAGE, layer_block_bytes
    from pulseinfer_jax.models.loading import describe_model
    from pulseinfer_jax.models.transformer import resolve_dtype

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
        # kv_dtype="float8_e4m3fn" at block size 16: e4m3 values and their bfloat16 scales
        "float8_kv_bytes_per_token": c.num_layers * layer_block_bytes(16, c.num_kv_heads, c.head_dim, STORAGE) // 16,
        "tokenizer": None if tok is None else {"vocab_size": tok.vocab_size, "eos_token_ids": list(tok.eos_token_ids),
                                               "chat_template": tok.has_chat_template},
    }
    print(json.dumps(info, indent=2, default=str))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    try:
        args = build_parser().parse_args(argv)
    except ValueError as e:
        print(f"pulseinfer: error: {e}", file=sys.stderr)
        return 2
    log = logging.getLogger("pulseinfer_jax")  # the engine's one line on the backends it chose
    if not any(getattr(h, "pulseinfer_cli", False) for h in log.handlers):
        handler = logging.StreamHandler()  # (writes to the current sys.stderr)
        handler.setFormatter(logging.Formatter("pulseinfer: %(message)s"))
        handler.pulseinfer_cli = True
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        from pulseinfer_jax.parallel.distributed import cluster_from_args

        cluster = cluster_from_args(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                                    getattr(args, "process_id", None))
        if cluster is not None:
            cluster.initialize()
        return {"generate": _generate, "demo": _demo, "serve": _serve, "info": _info}[args.cmd](args)
    except USER_ERRORS as e:
        print(f"pulseinfer: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pulseinfer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
