"""Status lines on stderr for the command-line tools (the CLI and the demo), and model loading that reports them."""

from __future__ import annotations

import sys


def say(message: str) -> None:
    """One status line on stderr (what the command is doing while it does it)."""
    print(f"pulseinfer: {message}", file=sys.stderr, flush=True)


def load_for(config, model: str | None, dtype: str):
    """Load `model` laid out as an engine with `config` reads it on this machine's device, saying so."""
    import time

    from pulseinfer_jax.api import load_for_engine

    say(f"loading {model or 'the embedded SmolLM2-135M-Instruct'} ({dtype}) ...")
    t0 = time.perf_counter()
    m = load_for_engine(model, dtype, config)
    say(f"loaded {m.source}: {m.cfg.num_layers} layers, {m.cfg.num_parameters() / 1e6:.0f}M parameters, in "
        f"{time.perf_counter() - t0:.1f} s")
    if m.placement is not None:
        say(m.placement.describe())
    return m


