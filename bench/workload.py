"""Trace-shaped request mixes for the throughput bench.

`mooncake_mix` draws (prompt, output) length pairs from the public Mooncake trace (Kimi's production serving,
FAST'25 release `mooncake_trace.jsonl`, Apache-2.0): `bench/data/mooncake_lengths.json` holds the lengths of the
1,000 consecutive requests (about 150 s of arrivals) of the copy we could read offline. Pairs are drawn with
replacement as pairs, so the joint distribution is the trace's (input median 6.4K tokens, mean 8.3K, p99 53K;
output median 28, mean 177; weakly correlated). Prompt lengths are then multiplied by `scale` (the trace's
contexts are shorter than the 32K-128K this engine targets: a scale of 4 gives a median of ~26K and a tail
past 128K, capped at `max_prompt`) and outputs capped at `max_output` (GPU time); the JSON records both.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

DATA = pathlib.Path(__file__).resolve().parent / "data" / "mooncake_lengths.json"


def load_mooncake(path: pathlib.Path = DATA) -> tuple[np.ndarray, np.ndarray, str]:
    """(input lengths [N], output lengths [N], source description) of the stored Mooncake sample."""
    d = json.loads(path.read_text())
    inp, out = np.asarray(d["input_length"], np.int64), np.asarray(d["output_length"], np.int64)
    if inp.shape != out.shape or inp.size == 0 or (inp < 1).any() or (out < 1).any():
        raise ValueError(f"{path}: expected equally long, non-empty lists of positive lengths")
    return inp, out, f"{d['source']} ({d['count']} requests)"


def mooncake_mix(n: int, *, scale: float = 4.0, max_prompt: int = 131072, max_output: int = 256, min_output: int = 2,
                 seed: int = 0, path: pathlib.Path = DATA) -> tuple[list[tuple[int, int]], str]:
    """`n` (prompt tokens, output tokens) pairs drawn from the Mooncake sample (see the module docstring)."""
    if n < 1 or scale <= 0 or max_prompt < 1 or not 1 <= min_output <= max_output:
        raise ValueError(f"bad mix parameters n={n}, scale={scale}, max_prompt={max_prompt}, "
                         f"output in [{min_output}, {max_output}]")
    inp, out, source = load_mooncake(path)
    idx = np.random.default_rng(seed).integers(0, inp.size, n)
    prompts = np.clip(np.round(inp[idx] * scale), 1, max_prompt).astype(int)
    outputs = np.clip(out[idx], min_output, max_output).astype(int)
    desc = (f"{source}; pairs drawn with replacement (seed {seed}), prompt x {scale} capped at {max_prompt}, "
            f"output clipped to [{min_output}, {max_output}]")
    return [(int(p), int(o)) for p, o in zip(prompts, outputs, strict=True)], desc
